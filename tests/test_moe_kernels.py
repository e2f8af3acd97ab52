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


# A sparse MoE block with a shared expert twice the experts' inner size, folded into the expert kernels.
FOLDED = r"""
import copy, json, torch
from omni_ray.layers.moe import SparseMoE

torch.manual_seed(0)
block = SparseMoE(hidden_size=48, num_experts=12, top_k=3, intermediate_size=40, norm_topk_prob=True,
                  shared_intermediate_size=80)
with torch.no_grad():
    for parameter in block.parameters():
        parameter.normal_(0, 0.2)
plain = copy.deepcopy(block)
block.experts.use_kernels = True
folded = block.fold_shared_expert()
gate_up, down = block.experts.stacked
results = {"folded": folded, "parts": block.shared_parts, "stacked": [gate_up.shape[0], down.shape[0]],
           "experts are views": block.experts.gate_up_proj.data_ptr() == gate_up.data_ptr()
                                and block.experts.down_proj.data_ptr() == down.data_ptr(),
           "again": block.fold_shared_expert() and block.experts.stacked[0] is gate_up}
for tokens in (1, 7):
    x = torch.randn(tokens, 48)
    expected = plain(x)
    results[str(tokens)] = {"error": (block(x) - expected).abs().max().item(), "scale": expected.abs().max().item()}
print(json.dumps(results))
"""


def test_a_shared_expert_folded_into_the_expert_kernels_gives_the_blocks_output_under_the_triton_interpreter() -> None:
    """A block whose shared expert (inner size 80) is folded in as two experts of the experts' inner size (40) that
    every token picks, weighted by its sigmoid gate from the router's GEMM: 1 and 7 tokens give the unfolded block's
    output (routed experts in a loop, plus the gated shared expert); the experts' weights are views of the stacked
    ones, and folding twice changes nothing."""
    results = run_interpreted(FOLDED)
    assert results.pop("folded") is True and results.pop("parts") == 2
    assert results.pop("stacked") == [14, 14] and results.pop("experts are views") is True
    assert results.pop("again") is True
    for tokens, result in results.items():
        assert result["error"] < 1e-5 * max(1.0, result["scale"]), (tokens, result)


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("gated", [True, False], ids=["gate-up", "down"])
def test_expert_kernel_compiles_for_the_h200_without_a_gpu(gated: bool, tokens: int) -> None:
    """Triton's compiler, not its interpreter, down to Hopper machine code (sm_90), as the Thinker launches it for
    one token, and for 32 over 256 expert slots (the Talker's 128 and its shared expert's two folded in: 130)."""
    pointers = {"x_ptr": "*bf16", "token_ptr": "*i64", "w_ptr": "*bf16", "counts_ptr": "*i64", "out_ptr": "*bf16"}
    scalars = {name: "i32" for name in ("x_stride", "w_expert_stride", "w_row_stride", "out_stride", "N",
                                        "num_experts")}
    block_n, block_k, stages, warps = moe_kernels.launch_config(gated, tokens)
    constants = {"K": 2048 if gated else 768, "GATED": gated, "GATHER": gated, "EXPERTS": 128 if tokens == 1 else 256,
                 "BLOCK_M": max(16, tokens),
                 "BLOCK_N": block_n, "BLOCK_K": block_k, "FP32_DOT": False, "PRECISION": "tf32"}
    compile_for_h200(moe_kernels._expert_matmul_kernel, {**pointers, **scalars}, constants, num_warps=warps)
