"""The five-kernel dense decoder layer (`layers/small_batch.py`) against the eager layer: under Triton's interpreter
on the CPU, and compiled for the H200 without a GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _triton import compile_for_h200, run_interpreted
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers import small_batch
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack

# Run in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are defined.
CHECK = r"""
import copy, json, torch
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers import small_batch
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack

torch.manual_seed(0)
spec = DecoderSpec(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                   rope_theta=10000.0, mrope_section=None, intermediate_size=96)
results = {}
for dtype, rows_are_slots in ((torch.float32, True), (torch.float32, False), (torch.bfloat16, True)):
    eager = DecoderStack(spec).to(dtype)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15) + (1.0 if p.dim() == 1 else 0.0))
    fused = copy.deepcopy(eager)
    eager.fuse_projections()
    assert fused.use_small_batch_kernels()
    caches = [SlotKVCache(2, 4, 17, 2, 32, dtype, "cpu") for _ in range(2)]
    for k, v in caches[0].layers:  # stale keys past each row's position: the mask must hide them
        k.normal_(); v.normal_()
    for (k0, v0), (k1, v1) in zip(*[c.layers for c in caches]):
        k1.copy_(k0); v1.copy_(v0)
    rows = 3
    slots = torch.arange(rows) if rows_are_slots else torch.tensor([2, 0, 3])
    worst = {"hidden": 0.0, "keys": 0.0, "values": 0.0, "used": 0}
    start, length = 0, 2
    for step in range(4):
        batch = AttentionBatch.from_tensors(slots, torch.full((rows,), start), length, 17, rows_are_slots=rows_are_slots)
        batch.grouped_mask(2)
        x = torch.randn(rows, length, 64).to(dtype)
        cos, sin = eager.rotary((start + torch.arange(length))[None].expand(rows, -1), dtype)
        outs = []
        for stack, cache in zip((eager, fused), caches):
            before = sum(int(small_batch.applies(layer, x, batch)) for layer in stack.layers) if stack is fused else 0
            worst["used"] += before
            outs.append(stack(x, None, cache.layers, batch, rope=(cos, sin))[0].float())
        worst["hidden"] = max(worst["hidden"], (outs[0] - outs[1]).abs().max().item() / outs[0].abs().max().item())
        for (k0, v0), (k1, v1) in zip(*[c.layers for c in caches]):
            worst["keys"] = max(worst["keys"], (k0.float() - k1.float()).abs().max().item())
            worst["values"] = max(worst["values"], (v0.float() - v1.float()).abs().max().item())
        start, length = start + length, 1
    # the final norm and a head [50, 64] over the last position: one kernel, against the norm then the GEMM
    head, hidden = (torch.randn(50, 64) * 0.2).to(dtype), torch.randn(rows, 2, 64).to(dtype)
    expected = eager.head_logits(hidden, head).float()
    worst["head"] = (fused.head_logits(hidden, head).float() - expected).abs().max().item() / expected.abs().max().item()
    # one program per query head (the default) against one per KV head's pair of query heads: the same numbers
    attn = fused.layers[0].self_attn
    qkv = torch.randn(rows * length, attn.qkv.shape[0]).to(dtype)
    attended = []
    for query_heads in (1, 2):
        cache = copy.deepcopy(caches[1])
        attended += [small_batch.small_attention(qkv, attn, cos, sin, cache.layers[0], batch, rows,
                                                 query_heads=query_heads).float(), cache.layers[0][0].float()]
    worst["per query head"] = max((attended[0] - attended[2]).abs().max().item(),
                                  (attended[1] - attended[3]).abs().max().item())
    results[f"{dtype}-{'rows are slots' if rows_are_slots else 'slots'}"] = worst
print(json.dumps(results))
"""


def test_fused_layers_equal_the_eager_layers_under_the_triton_interpreter() -> None:
    """A two-layer dense stack over a 17-position cache holding stale keys: the first step writes two tokens per row,
    three more write one each, rows in the first slots or in others. The kernels' outputs and the keys and values
    they write equal the eager layers' (fp32: to float rounding; bf16: to its rounding), for every layer of every step
    (the second layer's input norm reads the sums of squares the first layer's kernels left). So do the last
    position's logits, the final norm fused into the head's GEMM. The attention kernel with a program per query
    head (the default) gives the same outputs and cache as with a program per KV head's pair of query heads."""
    results = run_interpreted(CHECK)
    assert set(results) == {"torch.float32-rows are slots", "torch.float32-slots", "torch.bfloat16-rows are slots"}
    for case, worst in results.items():
        assert worst["used"] == 8, case  # 2 layers x 4 steps ran the kernels
        bf16 = "bfloat16" in case
        assert worst["hidden"] < (3e-2 if bf16 else 1e-5), (case, worst)  # relative to the largest output
        assert worst["head"] < (3e-2 if bf16 else 1e-5), (case, worst)
        assert max(worst["keys"], worst["values"]) < (0.1 if bf16 else 1e-5), (case, worst)
        assert worst["per query head"] == 0.0, (case, worst)


# Each GEMM form against torch on 40 rows (two row tiles), fp32.
GEMMS = r"""
import json, torch
import torch.nn.functional as F
from omni_ray.layers import small_batch
from omni_ray.layers.small_batch import rows_matmul, rows_matmul_keeping_squares

torch.manual_seed(0)
x, residual = torch.randn(40, 64), torch.randn(40, 48)
weight, gate_up, norm = torch.randn(48, 64) * 0.1, torch.randn(96, 64) * 0.1, torch.rand(64) + 0.5
normed = F.rms_norm(x, (64,), norm, eps=1e-6)
expected_out = residual + x @ weight.T
gate, up = (normed @ gate_up.T).chunk(2, dim=-1)
sums, renormed = expected_out.pow(2).sum(-1), F.rms_norm(expected_out, (48,), norm[:48], eps=1e-6)
results = {}
# the default launch, and the depth split in three stretches of 32 (the last past the depth: all masked)
for name, config in (("whole depth", None), ("split depth", (16, 16, 1, 4, 3))):
    out, squares = rows_matmul_keeping_squares(x, weight[:, :64], residual, config)
    results[name] = {
        "plain": (rows_matmul(x, weight, config=config) - x @ weight.T).abs().max().item(),
        "norm": (rows_matmul(x, weight, norm, config=config) - normed @ weight.T).abs().max().item(),
        "gated": (rows_matmul(x, gate_up, norm, gated=True, config=config) - F.silu(gate) * up).abs().max().item(),
        "residual": (out - expected_out).abs().max().item(),
        "squares": (squares.sum(0) - sums).abs().max().item() / sums.max().item(),
        "norm from squares": (rows_matmul(out, weight[:, :48], norm[:48], squares=squares, config=config)
                              - renormed @ weight[:, :48].T).abs().max().item(),
        "partials": list(squares.shape),
    }
results["arrival counters left at zero"] = all(
    int(counters.abs().sum()) == 0 for counters in small_batch._arrivals.values()) and len(small_batch._arrivals) == 1
print(json.dumps(results))
"""


def test_each_gemm_form_equals_torch_over_two_row_tiles_under_the_triton_interpreter() -> None:
    """40 rows (two tiles of 32): the plain product, the RMSNorm prologue (its own pass over the rows, or the partial
    sums of squares a residual GEMM left), SiLU(gate) * up, and the residual with the partial sums of its output's
    squares, one per column block of 16. Each over the whole depth in one program, and split over three programs
    whose last to arrive adds their sums up (leaving its arrival counters at zero for the next launch)."""
    results = run_interpreted(GEMMS)
    assert results.pop("arrival counters left at zero") is True
    assert set(results) == {"whole depth", "split depth"}
    for launch, errors in results.items():
        assert errors.pop("partials") == [3, 40], launch  # 48 output columns in blocks of 16
        for form, error in errors.items():
            assert error < 1e-5, (launch, form, error)


# A Talker reply's frames with the code predictor's layers as kernels, against the same runner without them.
FRAMES = r"""
import json, sys, torch
from transformers import Qwen3OmniMoeConfig
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker

checkpoint, kernels_used = sys.argv[1], sys.argv[2]
config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
text = config.talker_config.text_config
hidden = config.talker_config.thinker_hidden_size
torch.manual_seed(0)
prefix = {"user_states": torch.randn(6, hidden), "user_multimodal": torch.zeros(6, dtype=torch.bool),
          "assistant_prefix": torch.randn(3, hidden)}
reply = [torch.randn(hidden) for _ in range(4)]
frames, used = {}, 0
for kernels in (False, True):
    cache = SlotKVCache(text.num_hidden_layers, 2, 256, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    runner = TalkerRunner(load_talker(checkpoint, config, "cpu", torch.float32), config, cache, max_batch=2)
    if kernels and kernels_used == "code predictor layers":
        assert runner.model.code_predictor.model.use_small_batch_kernels()
    elif kernels:  # the Talker's MoE layers, its shared expert folded into the expert kernels
        assert runner.model.model.use_moe_kernels()
        assert all(layer.mlp.shared_parts == 2 for layer in runner.model.model.layers)
    seqs = [TalkerSequence(f"r{i}", SamplingParams(temperature=0.0, repetition_penalty=1.05), speaker_id=0,
                           max_frames=12, prefix=prefix, text_embeds=reply[i:], thinker_done=True) for i in range(2)]
    for seq in seqs:
        runner.admit(seq)
    made = []
    while any(s.finish_reason is None for s in seqs):
        made += [out.codes for out in runner.step([s for s in seqs if s.finish_reason is None]) if out.codes]
    frames[kernels] = made
print(json.dumps({"eager": frames[False], "kernels": frames[True]}))
"""


@pytest.mark.parametrize("kernels_used", ["code predictor layers", "MoE experts"])
def test_talker_frames_with_kernels_equal_the_eager_frames_under_the_triton_interpreter(
    tiny_checkpoint: Path, kernels_used: str
) -> None:
    """The embedded checkpoint's Talker, two greedy replies batched: every frame's 16 codes are the same whether
    the code predictor's passes run its layers' eager code or the five-kernel layers, and whether the Talker's MoE
    layers run their experts in a loop plus the shared expert, or the expert kernels with the shared expert folded
    in (two more experts every token picks)."""
    frames = run_interpreted(FRAMES, str(tiny_checkpoint), kernels_used)
    assert len(frames["eager"]) >= 12 and all(len(codes) == 16 for codes in frames["eager"])
    assert frames["kernels"] == frames["eager"]
    assert len({tuple(codes[1:]) for codes in frames["eager"]}) > 1  # the code predictor's codes vary


def test_layers_without_triton_on_the_cpu_run_eagerly() -> None:
    """Off CUDA (no interpreter), a stack with the kernels turned on runs its layers' own code: same outputs."""
    spec = DecoderSpec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6,
                       rope_theta=10000.0, mrope_section=None, intermediate_size=48)
    stack = DecoderStack(spec)
    cache = SlotKVCache(1, 2, 17, 1, 16, torch.float32, "cpu")
    batch = AttentionBatch.from_tensors(torch.arange(2), torch.zeros(2, dtype=torch.long), 2, 17, rows_are_slots=True)
    x = torch.randn(2, 2, 32)
    cos, sin = stack.rotary(torch.arange(2)[None].expand(2, -1), torch.float32)
    expected = stack(x, None, cache.layers, batch, rope=(cos, sin))[0]
    if stack.use_small_batch_kernels():
        assert not small_batch.applies(stack.layers[0], x, batch) or os.environ.get("TRITON_INTERPRET") == "1"
    torch.testing.assert_close(stack(x, None, cache.layers, batch, rope=(cos, sin))[0], expected)


@pytest.mark.parametrize("variant", ["norm", "gated-from-squares", "residual-keeping-squares", "fp32",
                                     "gated-from-squares-split", "residual-keeping-squares-split",
                                     "gated-from-squares-evict-first", "attention-2", "attention-1"])
def test_kernels_compile_for_the_h200_without_a_gpu(variant: str) -> None:
    """Triton's compiler, not its interpreter, down to Hopper machine code (sm_90), in each form the code predictor
    launches: what the interpreter lets pass and a GPU would refuse fails here. With `weights_evict_first` the
    weights' loads (and only theirs) carry L2's evict_first policy."""
    evict_first = variant.endswith("-evict-first")
    if variant.startswith("attention"):
        kernel = small_batch._small_attention_kernel
        pointers = {name: "*bf16" for name in ("qkv_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr",
                                               "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        pointers |= {"slots_ptr": "*i64", "index_ptr": "*i64"}
        scalars = {name: "i32" for name in ("qkv_stride", "rope_stride", "slot_stride", "position_stride",
                                            "out_stride", "kv_len")} | {"eps": "fp32", "scale": "fp32"}
        constants = {"T": int(variant[-1]), "HEADS": 16, "KV_HEADS": 8, "D": 128, "KEYS": 32,
                     "QUERY_HEADS": 2 if variant == "attention-2" else 1, "ROWS_ARE_SLOTS": variant == "attention-1"}
    else:
        kernel = small_batch._rows_matmul_kernel
        element = "*fp32" if variant == "fp32" else "*bf16"
        pointers = {name: element for name in ("x_ptr", "w_ptr", "out_ptr", "res_ptr", "norm_ptr")}
        pointers |= {"squares_in_ptr": "*fp32", "squares_out_ptr": "*fp32", "partial_ptr": "*fp32",
                     "arrivals_ptr": "*i32"}
        scalars = {name: "i32" for name in ("x_stride", "w_stride", "out_stride", "res_stride", "M", "N",
                                            "squares_in_count")}
        scalars["eps"] = "fp32"
        block_n, block_k, _, _, _ = small_batch.matmul_config(1024, 3072)
        residual = variant.startswith("residual")
        split = 4 if variant.endswith("-split") else 1
        variant = variant.removesuffix("-split").removesuffix("-evict-first")
        constants = {"K": 1024, "NORM": not residual, "GATED": variant.startswith("gated"), "RESIDUAL": residual,
                     "SQUARES_IN": 64 if variant.endswith("from-squares") else 0, "SQUARES_OUT": residual,
                     "BLOCK_M": 32, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "FP32_DOT": False,
                     "PRECISION": "ieee" if variant == "fp32" else "tf32",
                     "WEIGHT_EVICTION": "evict_first" if evict_first else ""}
    ptx = compile_for_h200(kernel, {**pointers, **scalars}, constants)
    hinted = [line for line in ptx.splitlines() if "ld.global" in line and "L2::cache_hint" in line]
    if not evict_first:
        assert not hinted and "createpolicy" not in ptx
        return
    assert "createpolicy.fractional.L2::evict_first" in ptx
    plain = [line for line in ptx.splitlines() if "ld.global" in line and "L2::cache_hint" not in line]
    assert hinted and plain  # the gate and up weights hinted; x, the norm's scale, the squares not
