"""The persistent-kernel probe (`benchmarks/persistent_probe.py`): its chained GEMMs under Triton's interpreter with one
program (whose grid barriers pass at once: the interpreter runs programs one after another, so more would wait
forever), and its kernels (the programmatic-launch probe's too) compiled for the H200 without a GPU."""

from __future__ import annotations

import pytest

from _triton import compile_for_h200, run_interpreted

CHAIN = r"""
import json, torch
from benchmarks.persistent_probe import CHAIN, chain_persistent, chain_reference

torch.manual_seed(0)
weights = [torch.randn(n, k) * 0.03 for k, n in CHAIN]
arrivals = torch.zeros(2, dtype=torch.int32)
results = {}
for rows in (1, 3):
    x = torch.randn(rows, CHAIN[0][0])
    expected = chain_reference(x, weights)
    for prefetch in (False, True):
        got = chain_persistent(x, weights, arrivals, 1, prefetch)
        results[f"{rows} {prefetch}"] = ((got - expected).norm() / expected.norm()).item()
results["counters left at zero"] = arrivals.tolist() == [0, 0]
print(json.dumps(results))
"""


def test_the_persistent_chain_equals_torch_under_the_triton_interpreter() -> None:
    """A code-predictor layer's four GEMMs at full size, 1 and 3 rows, with and without each program loading its
    next weight block before it waits: torch's chain to float rounding, and the barrier counters left at zero."""
    results = run_interpreted(CHAIN)
    assert results.pop("counters left at zero") is True
    assert len(results) == 4
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


@pytest.mark.parametrize("wait", [False, True])
def test_the_programmatic_launch_probe_compiles_for_the_h200_without_a_gpu(wait: bool) -> None:
    """The spinning kernel that stamps the global timer: it waits for the kernel ahead only when told to, and always
    lets the next one start."""
    from benchmarks.persistent_probe import _stamped_spin_kernel

    ptx = compile_for_h200(_stamped_spin_kernel, {"times_ptr": "*i64", "spin_ns": "i64"}, {"WAIT": wait})
    assert "%globaltimer" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert ("griddepcontrol.wait" in ptx) == wait
