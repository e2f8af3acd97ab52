"""`sample`'s top-k draw as one Triton kernel: banned tokens, repetition penalty, temperature, top-k, top-p and noise.

The Talker draws 16 times per frame (group 0 and 15 code-predictor groups), each a top-k draw over a few thousand
logits. As aten ops and inductor kernels that is a radix top-k, a sort and a handful of small kernels per draw: a
frame's 16 draws took 0.57 ms on an H200, and 0.21 ms as this kernel (at 1 to 32 rows).
Here one program per row holds the row in registers and makes the same decisions as `sampler.draw_from_top_k`: the top
`cap` logits (ties: the lower token id first, as aten's top-k takes them), ranks past the row's top_k dropped, then
what lies outside the top-p nucleus of the rest (cumulated from the smallest probability up, as transformers does),
then argmax(logit/T - log(noise)) with the same counter noise. Greedy rows take the argmax (the first of equal
maxima). (Sorting only the fp32 logits instead, then finding the kept tokens and drawing over the whole row, was not
faster on an H200.)
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from omni_ray.engine.sampler import CounterNoise, SamplingBatch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU-only install): `KernelDraw` falls back
    triton = None


MAX_CAP = 256  # larger top-k caps keep the aten draw: the kernel sorts `cap` candidates in registers
MAX_VOCAB = 16384  # a row in one program's registers


def draw_warps(block: int) -> int:
    """num_warps of a draw over `block` (a power of two) candidates: 8 from 2,048 up (for the code predictor's 2,048,
    a frame's 16 draws on an H200 took 10% less time at 32 rows than with 4 warps, the same at 1 and 8 rows; 1, 2
    and 16 warps were slower)."""
    return 8 if block >= 2048 else 4


if triton is not None:

    @triton.jit
    def _mix32(x):  # no annotations in jit functions: Triton reads them as its own types
        """`sampler.mix32` on uint32 (its products wrap mod 2^32, as the int64 form masks them)."""
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x735A2D97
        return x ^ (x >> 15)

    @triton.jit
    def _orderable(bits):
        """float32 bits (as int32) ↔ int32 that orders as the floats do (an involution)."""
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _top_k_draw_kernel(
        logits_ptr, logits_stride, vocab, temperature_ptr, top_k_ptr, top_p_ptr, penalty_ptr,
        seen_ptr, seen_stride, banned_ptr, banned_stride, keys_ptr, offset, out_ptr,
        table_ptr, table_stride, feedback_ptr, feedback_stride, embedded_ptr, summed_ptr, width,
        HAS_SEEN: tl.constexpr, HAS_BANNED: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr,
        EMBED: tl.constexpr, BLOCK_WIDTH: tl.constexpr,
    ):
        """Row `row`'s token into out_ptr; EMBED: also its row of the table [V, width] into embedded_ptr [B, width],
        and that plus the row's feedback vector into summed_ptr (rounded once, as torch adds)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_BANNED:
            banned = tl.load(banned_ptr + row * banned_stride + cols, mask=inside, other=0) != 0
            x = tl.where(banned, float("-inf"), x)
        if HAS_SEEN:
            seen = tl.load(seen_ptr + row * seen_stride + cols, mask=inside, other=0) != 0
            penalty = tl.load(penalty_ptr + row)
            x = tl.where(seen, tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty)), x)
        greedy = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
        temperature = tl.load(temperature_ptr + row)
        x = tl.math.div_rn(x, tl.maximum(temperature, 1e-5))  # IEEE division, as torch divides
        # One int64 per token that sorts by logit, then by lower id: the top-k keeps both in one bitonic sort.
        packed = (_orderable(x.to(tl.int32, bitcast=True)).to(tl.int64) << 32) | (BLOCK - 1 - cols).to(tl.int64)
        top = tl.topk(packed, CAP)  # descending
        index = BLOCK - 1 - top.to(tl.int32)  # the low half
        values = _orderable((top >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
        rank = tl.arange(0, CAP)
        top_k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), CAP)
        values = tl.where(rank >= top_k, float("-inf"), values)
        # top-p: mass cumulated from the smallest kept probability up; the largest logit always stays
        weights = tl.exp(values - tl.max(values, axis=0))
        cumulative = tl.cumsum(weights / tl.sum(weights, axis=0), axis=0, reverse=True)
        outside = (cumulative <= 1.0 - tl.load(top_p_ptr + row)) | (values == float("-inf"))
        values = tl.where(outside & (rank > 0), float("-inf"), values)
        # the counter noise of `sampler.exponential_from_hash` at the candidates' ids
        key0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
        key1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
        hashed = _mix32(_mix32((index + offset).to(tl.uint32) ^ key0) + key1)
        uniform = ((hashed >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noise = -tl.log(uniform)
        scores = values - tl.log(tl.maximum(noise, 1e-30))
        best = tl.argmax(scores, axis=0, tie_break_left=True)
        drawn = tl.sum(tl.where(rank == best, index, 0), axis=0)
        drawn = tl.minimum(drawn, vocab - 1).to(tl.int64)  # every token banned: some token, never past the vocabulary
        token = tl.where(temperature > 0, drawn, greedy)
        tl.store(out_ptr + row, token)
        if EMBED:
            at = tl.arange(0, BLOCK_WIDTH)
            inside_width = at < width
            vector = tl.load(table_ptr + token * table_stride + at, mask=inside_width)
            tl.store(embedded_ptr + row * width + at, vector, mask=inside_width)
            previous = tl.load(feedback_ptr + row * feedback_stride + at, mask=inside_width).to(tl.float32)
            summed = (previous + vector.to(tl.float32)).to(summed_ptr.dtype.element_ty)
            tl.store(summed_ptr + row * width + at, summed, mask=inside_width)


def top_k_draw(
    logits: torch.Tensor,
    params: SamplingBatch,
    noise: CounterNoise,
    cap: int,
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """`sample(logits, params, noise, seen, banned, filtered=True, top_k_cap=cap)` as one kernel: logits [B, V] →
    tokens [B] long. `cap`: a power of two at most `MAX_CAP`; banned [B, V] or [V] bool; `warps`: another
    num_warps than `draw_warps`'. Graph-capturable."""
    return _launch(logits, params, noise, cap, seen, banned, None, warps)[0]


def top_k_draw_and_embed(
    logits: torch.Tensor,
    params: SamplingBatch,
    noise: CounterNoise,
    cap: int,
    table: torch.Tensor,
    feedback: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_k_draw` (no penalty, no banned ids) that also looks each token up in `table` [V, h] and adds that to
    the row's `feedback` [B, h], in the same kernel: tokens [B], their embeddings [B, h] and feedback + embeddings
    [B, h] (a codebook pass's draw, `F.embedding` and sum in one launch). Graph-capturable."""
    tokens, embedded, summed = _launch(logits, params, noise, cap, None, None, (table, feedback))
    assert embedded is not None and summed is not None
    return tokens, embedded, summed


def _launch(
    logits: torch.Tensor, params: SamplingBatch, noise: CounterNoise, cap: int, seen: torch.Tensor | None,
    banned: torch.Tensor | None, embedding: tuple[torch.Tensor, torch.Tensor] | None, warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    rows, vocab = logits.shape
    assert triton is not None and cap & (cap - 1) == 0 and cap <= MAX_CAP and vocab <= MAX_VOCAB
    block = max(triton.next_power_of_2(vocab), cap)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    seen_arg = seen if seen is not None else out
    banned_arg = banned if banned is not None else out
    banned_stride = 0 if banned is None or banned.dim() == 1 else banned.stride(0)
    keys = noise.keys.contiguous()
    table, feedback, embedded, summed = out, out, None, None
    if embedding is not None:
        table, feedback = embedding
        assert table.stride(-1) == 1 and feedback.stride(-1) == 1 and table.shape[1] == feedback.shape[1]
        embedded = torch.empty(rows, table.shape[1], dtype=table.dtype, device=table.device)
        summed = torch.empty(rows, table.shape[1], dtype=torch.promote_types(table.dtype, feedback.dtype),
                             device=table.device)
    width = table.shape[1] if embedding is not None else 1
    # Triton launches on the current device, which may be another (on the CPU: Triton's interpreter)
    with torch.cuda.device(logits.device) if logits.is_cuda else nullcontext():
        _top_k_draw_kernel[(rows,)](
            logits, logits.stride(0), vocab, params.temperature, params.top_k, params.top_p, params.penalty,
            seen_arg, seen_arg.stride(0), banned_arg, banned_stride, keys, noise.offset, out,
            table, table.stride(0), feedback, feedback.stride(0), embedded if embedded is not None else out,
            summed if summed is not None else out, width,
            HAS_SEEN=seen is not None, HAS_BANNED=banned is not None, BLOCK=block, CAP=cap,
            EMBED=embedding is not None, BLOCK_WIDTH=triton.next_power_of_2(width),
            num_warps=warps or draw_warps(block),
        )
    return out, embedded, summed


class KernelDraw:
    """A `sample`-shaped draw that runs `top_k_draw` where it applies (CUDA logits, Triton present, a filtered top-k
    draw with noise and a cap the kernel takes) and `fallback` otherwise; `draw_and_embed` also looks the tokens up
    in the same kernel."""

    def __init__(self, fallback: Callable[..., torch.Tensor]) -> None:
        self.fallback = fallback

    @staticmethod
    def applies(logits: torch.Tensor, noise: object, filtered: bool, top_k_cap: int | None) -> bool:
        """CUDA logits, Triton present, a filtered top-k draw with counter noise and a cap the kernel takes."""
        return (
            triton is not None and logits.is_cuda and isinstance(noise, CounterNoise) and filtered
            and top_k_cap is not None and top_k_cap <= MAX_CAP and logits.shape[-1] <= MAX_VOCAB
        )

    def __call__(
        self,
        logits: torch.Tensor,
        params: SamplingBatch,
        noise: torch.Tensor | CounterNoise | None,
        seen: torch.Tensor | None = None,
        banned: torch.Tensor | None = None,
        filtered: bool = True,
        top_k_cap: int | None = None,
    ) -> torch.Tensor:
        if self.applies(logits, noise, filtered, top_k_cap):
            assert isinstance(noise, CounterNoise) and top_k_cap is not None
            return top_k_draw(logits, params, noise, top_k_cap, seen, banned)
        return self.fallback(logits, params, noise, seen, banned, filtered, top_k_cap)

    def draw_and_embed(
        self,
        logits: torch.Tensor,
        params: SamplingBatch,
        noise: CounterNoise,
        filtered: bool,
        top_k_cap: int | None,
        table: torch.Tensor,
        feedback: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [B], `F.embedding(tokens, table)` and `feedback` plus that: one kernel where it applies."""
        if self.applies(logits, noise, filtered, top_k_cap):
            assert top_k_cap is not None
            return top_k_draw_and_embed(logits, params, noise, top_k_cap, table, feedback)
        tokens = self(logits, params, noise, None, None, filtered, top_k_cap)
        embedded = F.embedding(tokens, table)
        return tokens, embedded, feedback + embedded
