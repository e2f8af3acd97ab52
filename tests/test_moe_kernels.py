"""The MoE expert kernels (`layers/moe_kernels.py`) against the per-expert loop: under Triton's interpreter on the
CPU, and compiled for the H200 without a GPU."""

from __future__ import annotations

import pytest

from _triton import compile_for_h200, run_interpreted
from omni_ray.layers import moe_kernels

# Run in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are defined.
CHECK = r"""
import json, torch
from omni_ray.layers import moe_kernels
from omni_ray.layers.moe import Experts

torch.manual_seed(0)
experts_module = Experts(num_experts=12, hidden_size=48, intermediate_size=40)
with torch.no_grad():
    experts_module.gate_up_proj.normal_(0, 0.2)
    experts_module.down_proj.normal_(0, 0.2)
experts_module.use_kernels = True
results = {}
for tokens, k in ((1, 4), (5, 3), (9, 4)):
    x = torch.randn(tokens, 48)
    experts = torch.stack([torch.randperm(12)[:k] for _ in range(tokens)])
    experts[:, 0] = 7  # one expert every token picks
    experts[experts == 0] = 11  # expert 0 unpicked: the first expert with pairs is not the first expert
    weights = torch.rand(tokens, k)
    assert moe_kernels.applies(x)
    got = experts_module(x, experts, weights)
    expected = experts_module.looped(x, experts, weights)
    results[f"{tokens}x{k}"] = {"error": (got - expected).abs().max().item(), "scale": expected.abs().max().item(),
                                "hit": len(set(experts.reshape(-1).tolist()))}
print(json.dumps(results))
"""


def test_expert_kernels_equal_the_per_expert_loop_under_the_triton_interpreter() -> None:
    """1, 5 and 9 tokens picking 3-4 of 12 experts (expert 0 never, expert 7 by every token): the two kernels
    (SiLU(gate) * up, then down, each program finding its expert and pairs in the counts) and the weighted sum give
    the loop's output. With 1 token, 4 programs for 4 picked experts; with 9, 12 programs, some past the last
    picked expert (they do nothing)."""
    results = run_interpreted(CHECK)
    assert set(results) == {"1x4", "5x3", "9x4"}
    for case, result in results.items():
        assert result["error"] < 1e-5 * max(1.0, result["scale"]), (case, result)
    assert results["9x4"]["hit"] < 12  # programs past the last picked expert were there


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("gated", [True, False], ids=["gate-up", "down"])
def test_expert_kernel_compiles_for_the_h200_without_a_gpu(gated: bool, tokens: int) -> None:
    """Triton's compiler, not its interpreter, down to Hopper machine code (sm_90), as the Thinker launches it for
    one token and for 32."""
    pointers = {"x_ptr": "*bf16", "token_ptr": "*i64", "w_ptr": "*bf16", "counts_ptr": "*i64", "out_ptr": "*bf16"}
    scalars = {name: "i32" for name in ("x_stride", "w_expert_stride", "w_row_stride", "out_stride", "N",
                                        "num_experts")}
    block_n, block_k, stages, warps = moe_kernels.launch_config(gated, tokens)
    constants = {"K": 2048 if gated else 768, "GATED": gated, "GATHER": gated, "EXPERTS": 128, "BLOCK_M": max(16, tokens),
                 "BLOCK_N": block_n, "BLOCK_K": block_k, "FP32_DOT": False, "PRECISION": "tf32"}
    compile_for_h200(moe_kernels._expert_matmul_kernel, {**pointers, **scalars}, constants, num_warps=warps)
