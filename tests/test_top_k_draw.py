"""The Triton top-k draw against `sample`: under Triton's interpreter on the CPU, and its fallback off CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _triton import compile_for_h200, run_interpreted
from omni_ray.engine.sampler import CounterNoise, SamplingBatch, SamplingParams
from omni_ray.engine.top_k_draw import KernelDraw

# Run in a fresh interpreter: TRITON_INTERPRET must be set before the kernel is defined.
CHECK = r"""
import json, random, torch
from omni_ray.engine.sampler import (
    CounterNoise, NoiseSource, SamplingBatch, SamplingParams, _outside_nucleus, draw_keys, penalize_repeats, sample,
    top_k_cap,
)
from omni_ray.engine.top_k_draw import top_k_draw


# `sample`'s top-k draw with its candidates from a stable sort: equal logits rank by lower id, as aten's top-k takes
# them on a GPU (on the CPU, its order of equal logits is not defined)
def ranked_by_lower_id(logits, params, noise, seen, banned, cap):
    x = logits.float()
    if banned is not None:
        x = x.masked_fill(banned, float("-inf"))
    if seen is not None:
        x = penalize_repeats(x, seen, params.penalty)
    greedy = x.argmax(-1)
    x = x / params.temperature.clamp_min(1e-5)[:, None]
    values, index = (t[:, :cap] for t in torch.sort(x, dim=-1, descending=True, stable=True))
    rank = torch.arange(cap)
    values = values.masked_fill(rank[None, :] >= params.top_k.clamp(1, cap)[:, None], float("-inf"))
    values = values.masked_fill(_outside_nucleus(values.flip(-1), params.top_p).flip(-1), float("-inf"))
    scores = values - noise.at(index).clamp_min(1e-30).log()
    return torch.where(params.temperature > 0, index.gather(-1, scores.argmax(-1, keepdim=True))[:, 0], greedy)


torch.manual_seed(0)
random.seed(0)
results = []
cases = [(300, True, "rows", 4.0), (200, False, "vocab", 4.0), (130, False, None, 4.0), (100, False, None, 0.0)]
for case, (vocab, penalised, banned_shape, spread) in enumerate(cases):
    rows = 12
    logits = (spread * torch.randn(rows, vocab)).to(torch.bfloat16)  # bf16: equal logits at the top-k boundary
    if spread == 0.0:  # five values only: long runs of equal logits inside and across the top-k and top-p cuts
        logits = torch.randint(-2, 3, (rows, vocab)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0)] + [
        SamplingParams(temperature=random.choice([0.5, 0.9, 1.3]), top_k=random.choice([1, 5, 50, 64]),
                       top_p=random.choice([1.0, 0.8, 0.3]), repetition_penalty=random.choice([1.0, 1.05]), seed=i)
        for i in range(rows - 1)
    ]
    batch = SamplingBatch.of(params, "cpu")
    noise = CounterNoise(draw_keys([NoiseSource(p) for p in params]), 2048 * case)
    seen = torch.rand(rows, vocab) < 0.2 if penalised else None
    banned = None
    if banned_shape == "rows":
        banned = torch.zeros(rows, vocab, dtype=torch.bool)
        banned[:, 200:] = True
        banned[3, 250] = False
    elif banned_shape == "vocab":
        banned = torch.rand(vocab) < 0.3
    cap = top_k_cap(params)
    kernel = top_k_draw(logits, batch, noise, cap, seen, banned)
    reference = sample(logits, batch, noise, seen, banned, True, cap)
    stable = ranked_by_lower_id(logits, batch, noise, seen, banned, cap)
    results.append({"kernel": kernel.tolist(), "sample": reference.tolist(), "stable": stable.tolist(), "cap": cap,
                    "spread": spread})
print(json.dumps(results))
"""


def test_kernel_draws_what_sample_draws_under_the_triton_interpreter() -> None:
    """Greedy and sampled rows, top-k 1 to 64, top-p 0.3 to 1, repetition penalty, banned ids per row or shared,
    bf16 logits with ties: the kernel's token equals `sample`'s on every row. Rows of only five distinct logits
    (long runs of ties across the top-k and top-p cuts): equal to the same draw over a stable sort (on the CPU, aten's
    top-k leaves the order of equal logits undefined, so `sample` is no reference there)."""
    results = run_interpreted(CHECK)
    assert len(results) == 4
    for case in results:
        assert case["cap"] == 64
        assert case["kernel"] == case["stable"]
        if case["spread"] > 0:
            assert case["kernel"] == case["sample"]
        assert len(set(case["kernel"])) > 6  # the rows drew different tokens: the noise is per row


# The draw that also looks its tokens up and adds them to the feedback, against the draw alone and torch.
EMBED = r"""
import json, torch
from omni_ray.engine.sampler import CounterNoise, NoiseSource, SamplingBatch, SamplingParams, draw_keys
from omni_ray.engine.top_k_draw import top_k_draw, top_k_draw_and_embed

torch.manual_seed(0)
rows, vocab, width = 5, 300, 96
params = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=0.9, top_k=50, seed=i) for i in range(rows - 1)]
batch = SamplingBatch.of(params, "cpu")
noise = CounterNoise(draw_keys([NoiseSource(p) for p in params]), 4096)
logits = (4 * torch.randn(rows, vocab)).to(torch.bfloat16)
alone = top_k_draw(logits, batch, noise, 64)
results = {"distinct": len(set(alone.tolist()))}
for dtype in (torch.float32, torch.bfloat16):
    table, feedback = torch.randn(vocab, width).to(dtype), torch.randn(rows, width).to(dtype)
    tokens, embedded, summed = top_k_draw_and_embed(logits, batch, noise, 64, table, feedback)
    expected = feedback + table[tokens]
    results[str(dtype)] = {"tokens equal": bool((tokens == alone).all()),
                           "embedded equal": bool(torch.equal(embedded, table[tokens])),
                           "summed error": (summed.float() - expected.float()).abs().max().item(),
                           "largest": expected.float().abs().max().item()}
print(json.dumps(results))
"""


def test_the_draw_that_embeds_its_tokens_under_the_triton_interpreter() -> None:
    """Greedy and sampled rows: the kernel's tokens are `top_k_draw`'s and its embeddings the table's rows for them.
    Feedback + embeddings equal torch's sum in fp32, and in bf16 to one unit in the last place: the interpreter
    truncates fp32 to bf16, where a GPU rounds to nearest even as torch does."""
    results = run_interpreted(EMBED)
    assert results.pop("distinct") > 1
    for dtype, result in results.items():
        assert result["tokens equal"] and result["embedded equal"], (dtype, result)
        bf16 = "bfloat16" in dtype
        assert result["summed error"] <= (2 ** -7 * result["largest"] if bf16 else 0.0), (dtype, result)


@pytest.mark.parametrize("variant", ["group0", "code-predictor", "code-predictor-embedding"])
def test_kernel_compiles_for_the_h200_without_a_gpu(variant: str) -> None:
    """Triton's compiler, not its interpreter, down to Hopper machine code (sm_90): what the interpreter lets pass and a
    GPU would refuse (a Python annotation in a jit function, a type Triton cannot lower) fails here."""
    from omni_ray.engine.top_k_draw import _top_k_draw_kernel

    penalised = variant == "group0"
    pointers = {"logits_ptr": "*bf16", "temperature_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32",
                "penalty_ptr": "*fp32", "seen_ptr": "*i1", "banned_ptr": "*i1", "keys_ptr": "*i64", "out_ptr": "*i64",
                "table_ptr": "*bf16", "feedback_ptr": "*bf16", "embedded_ptr": "*bf16", "summed_ptr": "*bf16"}
    scalars = {name: "i32" for name in ("logits_stride", "vocab", "seen_stride", "banned_stride", "offset",
                                        "table_stride", "feedback_stride", "width")}
    constants = {"HAS_SEEN": penalised, "HAS_BANNED": penalised, "BLOCK": 4096 if penalised else 2048, "CAP": 64,
                 "EMBED": variant.endswith("embedding"), "BLOCK_WIDTH": 1024}
    compile_for_h200(_top_k_draw_kernel, {**pointers, **scalars}, constants, num_warps=8)


def test_kernel_draw_hands_what_it_cannot_take_to_its_fallback() -> None:
    """Off CUDA (and for an unfiltered draw, or a cap past the kernel's), the wrapped draw is the fallback's; so is
    the token `draw_and_embed` looks up."""
    calls: list[tuple[Any, ...]] = []

    def fallback(*args: Any) -> torch.Tensor:
        calls.append(args)
        return torch.zeros(2, dtype=torch.long)

    draw = KernelDraw(fallback)
    logits = torch.randn(2, 16)
    params = SamplingBatch.of([SamplingParams(top_k=5, seed=1)] * 2, "cpu")
    noise = CounterNoise(torch.zeros(2, 2, dtype=torch.long))
    draw(logits, params, noise, None, None, True, 8)
    draw(logits, params, noise, None, None, False, None)
    assert len(calls) == 2
    assert calls[0][5:] == (True, 8) and calls[1][5:] == (False, None)
    table, feedback = torch.randn(16, 4), torch.randn(2, 4)
    tokens, embedded, summed = draw.draw_and_embed(logits, params, noise, True, 8, table, feedback)
    assert len(calls) == 3 and tokens.tolist() == [0, 0]
    assert torch.equal(embedded, table[[0, 0]]) and torch.equal(summed, feedback + table[[0, 0]])
