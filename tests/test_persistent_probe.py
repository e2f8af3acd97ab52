"""The persistent-kernel probe (`benchmarks/persistent_probe.py`): its chained GEMMs under Triton's interpreter with one
program (whose grid barriers pass at once: the interpreter runs programs one after another, so more would wait
forever), and its kernels (the programmatic-launch probe's too) compiled for the H200 without a GPU."""

from __future__ import annotations

import pytest

from _triton import compile_for_h200, run_interpreted

CHAIN = r"""
import json, torch
from benchmarks.persistent_probe import CHAIN, chain_balanced, chain_persistent, chain_reference, phase_plan

torch.manual_seed(0)
weights = [torch.randn(n, k) * 0.03 for k, n in CHAIN]
arrivals = torch.zeros(3, dtype=torch.int32)
results = {}
for rows in (1, 3):
    x = torch.randn(rows, CHAIN[0][0])
    expected = chain_reference(x, weights)
    for prefetch in (False, True):
        got = chain_persistent(x, weights, arrivals, 1, prefetch)
        results[f"{rows} {prefetch}"] = ((got - expected).norm() / expected.norm()).item()
    plans = [phase_plan(k, n, 132, 512, split=i > 0) for i, (k, n) in enumerate(CHAIN)]  # the narrow ones split
    for _ in range(2):  # twice: the split GEMMs' outputs are zeroed by the launch itself
        got = chain_balanced(x, weights, arrivals, 1, block_k=512, plans=plans)
    results[f"{rows} balanced"] = ((got - expected).norm() / expected.norm()).item()
results["counters left at zero"] = arrivals.tolist() == [0, 0, 0]
results["splits"] = [parts for _, parts in plans]
print(json.dumps(results))
"""


def test_the_persistent_chain_equals_torch_under_the_triton_interpreter() -> None:
    """A code-predictor layer's four GEMMs at full size, 1 and 3 rows, with and without each program loading its
    next weight block before it waits, and balanced (one program: every split of the narrow GEMMs' depth adds into
    the output its launch zeroed): torch's chain to float rounding, and the barrier counters left at zero."""
    results = run_interpreted(CHAIN)
    assert results.pop("counters left at zero") is True
    assert results.pop("splits")[1] > 1
    assert len(results) == 6
    for case, error in results.items():
        assert error < 1e-5, (case, error)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_probe_kernels_compile_for_the_h200_without_a_gpu(prefetch: bool) -> None:
    """Triton's compiler down to sm_90: the persistent chain (its spin-wait barriers included) and the barrier-only
    kernel."""
    from benchmarks.persistent_probe import BLOCK_K, BLOCK_N, CHAIN, _barriers_kernel, _chain_kernel

    pointers = {name: "*bf16" for name in ("x_ptr", "w0", "w1", "w2", "w3", "h0", "h1", "h2", "out_ptr")}
    dims = {f"{name}{i}": value for i, (k, n) in enumerate(CHAIN) for name, value in (("K", k), ("N", n))}
    constants = {**dims, "PROGRAMS": 132, "BLOCK_M": 32, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K, "PREFETCH": prefetch}
    compile_for_h200(_chain_kernel, {**pointers, "arrivals_ptr": "*i32", "M": "i32"}, constants)
    compile_for_h200(_barriers_kernel, {"arrivals_ptr": "*i32"}, {"ROUNDS": 4, "PROGRAMS": 132})


@pytest.mark.parametrize("l2_ahead", [0, 1, 2])
def test_the_balanced_chain_splits_the_narrow_gemms_and_compiles_for_the_h200(l2_ahead: int) -> None:
    """Its plan at 132 and 264 programs gives every GEMM about one item per program (the narrow, deep ones split in
    depth), and the kernel (bounded barriers, fp32 atomic adds) compiles down to sm_90; asking L2 for the weights
    ahead (all first, or the next GEMM's before each wait) adds L2 prefetches, and only then."""
    from benchmarks.persistent_probe import CHAIN, _balanced_chain_kernel, phase_plan

    plans = [phase_plan(k, n, 132, 128, split=i > 0) for i, (k, n) in enumerate(CHAIN)]
    assert plans[0][1] == 1 and plans[1][1] > 1 and plans[3][1] > 1
    for programs in (132, 264):
        for i, (k, n) in enumerate(CHAIN):
            block_n, parts = phase_plan(k, n, programs, 128, split=i > 0)
            assert programs / 2 < -(-n // block_n) * parts <= 3 * programs, (programs, k, n, block_n, parts)
    pointers = {name: "*bf16" for name in ("x_ptr", "w0", "w1", "w2", "w3")}
    hidden = {name: "*fp32" for name in ("h0", "h1", "h2", "out_ptr")}
    dims = {f"{name}{i}": value for i, (k, n) in enumerate(CHAIN) for name, value in (("K", k), ("N", n))}
    constants = {**dims, **{f"BN{i}": block_n for i, (block_n, _) in enumerate(plans)},
                 **{f"S{i}": parts for i, (_, parts) in enumerate(plans) if i > 0},
                 "PROGRAMS": 132, "BLOCK_M": 32, "BLOCK_K": 128, "SPINS": 1 << 16, "L2_AHEAD": l2_ahead}
    ptx = compile_for_h200(_balanced_chain_kernel, {**pointers, **hidden, "arrivals_ptr": "*i32", "M": "i32"},
                           constants)
    assert "red.global" in ptx or "atom.global" in ptx
    assert ("prefetch.global.L2::evict_last" in ptx) == (l2_ahead > 0)


@pytest.mark.parametrize("wait", [False, True])
def test_the_programmatic_launch_probe_compiles_for_the_h200_without_a_gpu(wait: bool) -> None:
    """The spinning kernel that stamps the global timer: it waits for the kernel ahead only when told to, and always
    lets the next one start."""
    from benchmarks.persistent_probe import _stamped_spin_kernel

    ptx = compile_for_h200(_stamped_spin_kernel, {"times_ptr": "*i64", "spin_ns": "i64"}, {"WAIT": wait})
    assert "%globaltimer" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert ("griddepcontrol.wait" in ptx) == wait
