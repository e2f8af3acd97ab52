"""The GEMV probe (`benchmarks/gemv_probe.py`): its kernel under Triton's interpreter against torch, and compiled for
the H200 without a GPU."""

from __future__ import annotations

import pytest

from _triton import compile_for_h200, run_interpreted

PRODUCTS = r"""
import json, torch
from benchmarks.gemv_probe import gemv

torch.manual_seed(0)
weight = torch.randn(20, 96) * 0.1
results = {}
for rows in (1, 3, 8):
    x = torch.randn(rows, 96)
    for block_n, block_k, warps in ((4, 32, 2), (8, 64, 4), (16, 128, 4)):
        got = gemv(x, weight, block_n, block_k, warps)
        results[f"{rows} rows, {block_n} x {block_k}"] = [list(got.shape), (got - x @ weight.T).abs().max().item()]
print(json.dumps(results))
"""


def test_the_gemv_kernel_equals_torch_under_the_triton_interpreter() -> None:
    """1, 3 and 8 rows (3: rows past M masked) of 96-deep products onto 20 columns, in column blocks of 4, 8 and 16
    (the last block partly past the width) and depth blocks of 32 to 128 (the last past the depth): torch's product
    to fp32 rounding."""
    results = run_interpreted(PRODUCTS)
    assert len(results) == 9
    for case, (shape, error) in results.items():
        assert shape == [int(case.split()[0]), 20], case
        assert error < 1e-5, (case, error)


@pytest.mark.parametrize("rows", [1, 8])
def test_the_gemv_kernel_compiles_for_the_h200_without_a_gpu(rows: int) -> None:
    """Triton's compiler down to sm_90 at a code-predictor shape (the q/k/v projection), one and eight rows."""
    from benchmarks.gemv_probe import triton

    if triton is None:
        pytest.skip("no Triton")
    from benchmarks.gemv_probe import _gemv_kernel

    types = {"x_ptr": "*bf16", "x_stride": "i32", "w_ptr": "*bf16", "w_stride": "i32", "out_ptr": "*bf16",
             "out_stride": "i32", "M": "i32", "N": "i32"}
    compile_for_h200(_gemv_kernel, types, {"K": 1024, "ROWS": rows, "BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4)
