"""The GEMV probe (`benchmarks/gemv_probe.py`): its kernels under Triton's interpreter against torch, and compiled
for the H200 without a GPU."""

from __future__ import annotations

import pytest

from _triton import compile_for_h200, run_interpreted

PRODUCTS = r"""
import json, torch
from benchmarks.gemv_probe import gemv, swapped

torch.manual_seed(0)
weight = torch.randn(20, 96) * 0.1
results = {}
for rows in (1, 3, 8):
    x = torch.randn(rows, 96)
    for block_n, block_k, warps in ((4, 32, 2), (8, 64, 4), (16, 128, 4)):
        got = gemv(x, weight, block_n, block_k, warps)
        results[f"{rows} rows, {block_n} x {block_k}"] = [list(got.shape), (got - x @ weight.T).abs().max().item()]
wide = torch.randn(80, 96) * 0.1
for rows in (1, 20):
    x = torch.randn(rows, 96)
    for block_n, block_k, split in ((64, 32, 1), (64, 64, 1), (64, 32, 2), (16, 16, 4)):
        got = swapped(x, wide, block_n, block_k, 2, split)
        results[f"{rows} rows, swapped {block_n} x {block_k} split {split}"] = [
            list(got.shape), (got - x @ wide.T).abs().max().item()]
print(json.dumps(results))
"""


def test_the_gemv_and_swapped_kernels_equal_torch_under_the_triton_interpreter() -> None:
    """GEMV: 1, 3 and 8 rows (3: rows past M masked) of 96-deep products onto 20 columns, in column blocks of 4, 8
    and 16 (the last block partly past the width) and depth blocks of 32 to 128 (the last past the depth). Swapped:
    1 and 20 rows (padded to 16 and 32) onto 80 columns in blocks of 64 (the last partly past the width) or 16, the
    depth whole or split in 2 or 4 stretches added up by atomics (96 in 2 x 64: the second stretch partly past it).
    Each equals torch's product to fp32 rounding."""
    results = run_interpreted(PRODUCTS)
    assert len(results) == 9 + 8
    for case, (shape, error) in results.items():
        assert shape == [int(case.split()[0]), 80 if "swapped" in case else 20], case
        assert error < 1e-5, (case, error)


TYPES = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*bf16", "w_stride": "i32", "out_ptr": "*bf16",
         "out_stride": "i32", "M": "i32", "N": "i32"}


@pytest.mark.parametrize("rows", [1, 8])
def test_the_gemv_kernel_compiles_for_the_h200_without_a_gpu(rows: int) -> None:
    """Triton's compiler down to sm_90 at a code-predictor shape (the q/k/v projection), one and eight rows."""
    from benchmarks.gemv_probe import triton

    if triton is None:
        pytest.skip("no Triton")
    from benchmarks.gemv_probe import _gemv_kernel

    compile_for_h200(_gemv_kernel, TYPES, {"K": 1024, "ROWS": rows, "BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4)


@pytest.mark.parametrize("split", [1, 4])
def test_the_swapped_kernel_compiles_to_warpgroup_mma_for_the_h200_without_a_gpu(split: int) -> None:
    """Down to sm_90 at the o projection's shape, 32 rows, whole and split in four (an fp32 output): the product is
    a warpgroup MMA (wgmma), the point of the swapped form."""
    from benchmarks.gemv_probe import triton

    if triton is None:
        pytest.skip("no Triton")
    from benchmarks.gemv_probe import _swapped_kernel

    types = TYPES | ({"out_ptr": "*fp32"} if split > 1 else {})
    ptx = compile_for_h200(_swapped_kernel, types, {"K": 2048, "ROWS": 32, "BLOCK_N": 64, "BLOCK_K": 128,
                                                    "SPLIT_K": split, "FP32_DOT": False}, num_warps=4)
    assert "wgmma" in ptx
