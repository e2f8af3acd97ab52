"""An MoE decoder layer's decode step at a few rows in eight Triton kernels, with no sort and no host sync.

Compiled by inductor, a Thinker or Talker MoE layer's decode step was about 29-33 kernels (cuBLAS GEMMs and their
split-K reductions, norms, rotary, the KV write, the attention kernel and its mask, the router's softmax and top-k
by comparison, the pairs' ranks and scatters, the expert kernels, the combine): on an H200 1,389 kernels and 4.1 ms of
GPU time per Thinker step at one row, against a 1.4 ms floor. Here a layer is eight:

1. input RMSNorm + the fused q/k/v projection (`small_batch.rows_matmul`);
2. q/k per-head RMSNorm + rotary + the KV-cache write + attention over the slot's keys in blocks (online softmax),
   a few programs per (row, KV head) when rows are few (the key blocks dealt out among them, the last to finish
   merging their partial results), its query heads as the rows of one tile;
3. the output projection + the residual, leaving the partial sums of its rows' squares;
4. post-attention RMSNorm + the router's GEMM (and the shared expert's gate column, when folded);
5. routing: softmax, top-k, renormalisation, the shared expert's sigmoid gate, and the list of picked experts, in one
   program;
6. post-attention RMSNorm + each picked expert's gate/up projection + SiLU(gate) * up, one program per (picked
   expert, column block), which finds its tokens among the picks itself;
7. each picked expert's down projection, the same way;
8. each token's picks weighted and summed, + the residual, leaving the partial sums of its rows' squares for the next
   layer's input norm.

Opt-in, one kernel fewer each (`decoder_layer`'s `route_in_router` and `combine_in_down`; the engines'
`moe_layer_folds`): 5 inside 4's kernel (its last program to finish routes), 8 inside 7's (each column block's last
program to finish combines it).

Kernels 6-8 live in `layers/picked_experts.py`. A pair's results are stored at its (token, pick) row, so nothing
sorts the pairs by expert and nothing gathers them back. Sums run in fp32 and each kernel rounds once where the eager
layer rounds after every op: outputs agree with the eager layer to bf16 rounding, not bit for bit. Only decode steps
(one token per row) over the cache take it.
"""

from __future__ import annotations

import torch

from omni_ray.layers import small_batch
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.picked_experts import combine, dot_precision, down_and_combine, picked_expert_matmul
from omni_ray.layers.small_batch import _on_device, interpreting, rows_matmul, rows_matmul_keeping_squares

try:
    import triton
    import triton.language as tl

    from omni_ray.layers.small_batch import _rows_matmul_kernel
except ImportError:  # a CPU-only install: the layers run their own code
    triton = None

MAX_ROWS = 64  # rows of a decode step the kernels take: every expert's tokens in one tile
# Keys per attention block (64 where a step's keys all fit in 64). On an H200 one program over blocks of 128 took 8.4
# and 11.9 us where blocks of 64 took 10.7 and 15.8 (Thinker, 1 and 32 rows, 256 keys).
KEY_BLOCK = 128
# The programs the split attention aims at in all: 256 beat 128 at 32 rows (Thinker 11.6 against 11.9 us, Talker 11.5
# against 12.9).
ATTENTION_PROGRAMS = 256


if triton is not None:

    @triton.jit
    def _norm_rope_rows(at, ok, norm_ptr, eps, cos_ptr, sin_ptr, D: tl.constexpr, D_PAD: tl.constexpr):
        """Head vectors at the pointers `at` [R, 1] (rows where `ok`), each RMS-normed with `norm_ptr`'s scale and
        rotated (rotate-half rotary), each step rounded to their dtype as the eager layer rounds it: [R, D_PAD], zero
        past D."""
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        turned = (d + D // 2) % D  # rotate_half: the other half, the first half negated
        mask = ok & d_ok[None, :]
        dtype = at.dtype.element_ty
        raw = tl.load(at + d[None, :], mask=mask, other=0.0).to(tl.float32)
        inverse_rms = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=1) / D + eps)
        scale = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        normed = (raw * inverse_rms[:, None] * scale[None, :]).to(dtype).to(tl.float32)
        other = tl.load(at + turned[None, :], mask=mask, other=0.0).to(tl.float32) * inverse_rms[:, None]
        other = (other * tl.load(norm_ptr + turned, mask=d_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        other = tl.where(d < D // 2, -1.0, 1.0)[None, :] * other.to(tl.float32)
        cos = tl.load(cos_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        return (normed * cos[None, :] + other * sin[None, :]).to(dtype)

    @triton.jit
    def _decode_attention_kernel(  # no annotations in jit functions: Triton reads them as its own types
        qkv_ptr, qkv_stride, q_norm_ptr, k_norm_ptr, eps, cos_ptr, sin_ptr, rope_stride, k_cache_ptr, v_cache_ptr,
        slot_stride, position_stride, slots_ptr, index_ptr, out_ptr, out_stride, scale, partial_ptr, arrivals_ptr,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, GROUP_ROWS: tl.constexpr,
        KEYS: tl.constexpr, KEY_BLOCK: tl.constexpr, SPLITS: tl.constexpr, ROWS_ARE_SLOTS: tl.constexpr,
        FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Row b's new token for KV head g: its key and value into the cache at its position, then the head's query
        heads (rows of one [GROUP_ROWS, D_PAD] tile; D_PAD >= 16 for the tile products) attend over the slot's
        positions up to it, KEY_BLOCK keys at a time with an online softmax (KEYS: a multiple of KEY_BLOCK past every
        row's position). The new key and value are taken from registers where their block is read.

        With SPLITS > 1 the blocks are dealt out over SPLITS programs (program_id(2): blocks s, s + SPLITS, ...), each
        leaving its running max, sum and unnormalised output in `partial_ptr`; the last of them to arrive (counted in
        `arrivals_ptr`, zeros of this launch's own) merges the partials in split order and writes the output."""
        GROUP: tl.constexpr = HEADS // KV_HEADS
        b = tl.program_id(0)
        g = tl.program_id(1)
        split = tl.program_id(2)
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        j = tl.arange(0, GROUP_ROWS)
        slot = b if ROWS_ARE_SLOTS else tl.load(slots_ptr + b)
        written = tl.load(index_ptr + b)
        base = qkv_ptr + b * qkv_stride
        cos_at, sin_at = cos_ptr + b * rope_stride, sin_ptr + b * rope_stride
        cache_dtype = k_cache_ptr.dtype.element_ty
        first = (j == 0)[:, None]
        key = _norm_rope_rows(base + (HEADS + g) * D + j[:, None] * 0, first, k_norm_ptr, eps, cos_at, sin_at, D, D_PAD)
        key = tl.sum(tl.where(first, key.to(tl.float32), 0.0), axis=0).to(cache_dtype)
        value = tl.load(base + (HEADS + KV_HEADS + g) * D + d, mask=d_ok, other=0.0).to(cache_dtype)
        at = slot * slot_stride + written * position_stride + g * D + d
        # The first split writes the cache (a split whose block holds it reads registers). A branch, not a mask
        # `d_ok & (split == 0)`: Triton's interpreter keeps that scalar comparison as int32 data, which Triton 3.9's
        # masked store refuses.
        if split == 0:
            tl.store(k_cache_ptr + at, key, mask=d_ok)
            tl.store(v_cache_ptr + at, value, mask=d_ok)
        head_ok = (j < GROUP)[:, None]
        query = _norm_rope_rows(base + (g * GROUP + j)[:, None] * D, head_ok, q_norm_ptr, eps, cos_at, sin_at, D,
                                D_PAD).to(cache_dtype)
        best = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_ROWS], dtype=tl.float32)
        acc = tl.zeros([GROUP_ROWS, D_PAD], dtype=tl.float32)
        for first_block in range(0, KEYS // KEY_BLOCK, SPLITS):  # static bounds: the same loop in every program
            start = (first_block + split) * KEY_BLOCK
            if start <= written:  # (past KEYS too: written < KEYS)
                positions = start + tl.arange(0, KEY_BLOCK)
                visible = positions <= written
                cache_at = slot * slot_stride + positions[:, None] * position_stride + g * D + d[None, :]
                here = (positions == written)[:, None]
                stored = visible[:, None] & ~here & d_ok[None, :]
                keys = tl.where(here, key[None, :], tl.load(k_cache_ptr + cache_at, mask=stored, other=0.0))
                values = tl.where(here, value[None, :], tl.load(v_cache_ptr + cache_at, mask=stored, other=0.0))
                q, k = query, keys
                if FP32_DOT:
                    q, k = q.to(tl.float32), k.to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                scores = tl.where(visible[None, :], scores, float("-inf"))
                new_best = tl.maximum(best, tl.max(scores, axis=1))
                fade = tl.exp(best - new_best)
                weights = tl.exp(scores - new_best[:, None])
                total = total * fade + tl.sum(weights, axis=1)
                p, v = weights.to(cache_dtype), values
                if FP32_DOT:
                    p, v = p.to(tl.float32), v.to(tl.float32)
                acc = acc * fade[:, None] + tl.dot(p, v, input_precision=PRECISION)
                best = new_best
        out_at = out_ptr + b * out_stride + (g * GROUP + j)[:, None] * D + d[None, :]
        if SPLITS == 1:
            tl.store(out_at, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok & d_ok[None, :])
        else:
            # per (row, KV head, split): GROUP_ROWS maxima, GROUP_ROWS sums, then [GROUP_ROWS, D_PAD] outputs
            PART: tl.constexpr = GROUP_ROWS * (D_PAD + 2)
            home = partial_ptr + (b * KV_HEADS + g) * SPLITS * PART
            mine = home + split * PART
            tl.store(mine + j, best)
            tl.store(mine + GROUP_ROWS + j, total)
            tl.store(mine + 2 * GROUP_ROWS + j[:, None] * D_PAD + d[None, :], acc)
            tl.debug_barrier()  # every thread's partials are out before the arrival is counted
            if tl.atomic_add(arrivals_ptr + b * KV_HEADS + g, 1) == SPLITS - 1:
                best = tl.load(home + j, cache_modifier=".cg")  # split 0 always holds block 0: a finite max
                total = tl.load(home + GROUP_ROWS + j, cache_modifier=".cg")
                acc = tl.load(home + 2 * GROUP_ROWS + j[:, None] * D_PAD + d[None, :], cache_modifier=".cg")
                for other in tl.static_range(1, SPLITS):
                    theirs = home + other * PART
                    their_best = tl.load(theirs + j, cache_modifier=".cg")  # -inf where they had no block
                    new_best = tl.maximum(best, their_best)
                    fade, their_fade = tl.exp(best - new_best), tl.exp(their_best - new_best)
                    total = total * fade + tl.load(theirs + GROUP_ROWS + j, cache_modifier=".cg") * their_fade
                    their_acc = tl.load(theirs + 2 * GROUP_ROWS + j[:, None] * D_PAD + d[None, :], cache_modifier=".cg")
                    acc = acc * fade[:, None] + their_acc * their_fade[:, None]
                    best = new_best
                tl.store(out_at, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok & d_ok[None, :])

    @triton.jit
    def _route_kernel(
        logits_ptr, logits_stride, picks_ptr, weights_ptr, hit_list_ptr, hits_ptr, M, num_experts,
        TOP_K: tl.constexpr, SHARED_PARTS: tl.constexpr, NORM_TOP_K: tl.constexpr, ROWS: tl.constexpr,
        EXPERTS: tl.constexpr, PICKS: tl.constexpr,
    ):
        """`_route_rows` in one program."""
        _route_rows(logits_ptr, logits_stride, picks_ptr, weights_ptr, hit_list_ptr, hits_ptr, M, num_experts, TOP_K,
                    SHARED_PARTS, NORM_TOP_K, ROWS, EXPERTS, PICKS, False)

    @triton.jit
    def _router_kernel(
        x_ptr, x_stride, w_ptr, w_stride, out_ptr, out_stride, res_ptr, res_stride, norm_ptr, eps, M, N,
        squares_in_ptr, squares_in_count, squares_out_ptr, partial_ptr, arrivals_ptr,
        picks_ptr, weights_ptr, hit_list_ptr, hits_ptr, route_counter_ptr, num_experts,
        K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
        SQUARES_IN: tl.constexpr, SQUARES_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, WEIGHT_EVICTION: tl.constexpr,
        TOP_K: tl.constexpr, SHARED_PARTS: tl.constexpr, NORM_TOP_K: tl.constexpr, ROUTE_ROWS: tl.constexpr,
        EXPERTS: tl.constexpr, PICKS: tl.constexpr,
    ):
        """The router's GEMM (`small_batch._rows_matmul_kernel`: its logits into out), then `_route_rows` over them
        by the launch's last program to finish (every program counted in route_counter_ptr, left at zero): each
        program's own part of the logits is stored before it counts itself, so the last sees them all."""
        _rows_matmul_kernel(
            x_ptr, x_stride, w_ptr, w_stride, out_ptr, out_stride, res_ptr, res_stride, norm_ptr, eps, M, N,
            squares_in_ptr, squares_in_count, squares_out_ptr, partial_ptr, arrivals_ptr, K=K, NORM=NORM,
            GATED=GATED, RESIDUAL=RESIDUAL, SQUARES_IN=SQUARES_IN, SQUARES_OUT=SQUARES_OUT, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, FP32_DOT=FP32_DOT, PRECISION=PRECISION,
            WEIGHT_EVICTION=WEIGHT_EVICTION,
        )
        tl.debug_barrier()  # every thread's stores made before the release below
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        if tl.atomic_add(route_counter_ptr, 1) == programs - 1:  # acq_rel: the others' logits are visible
            _route_rows(out_ptr, out_stride, picks_ptr, weights_ptr, hit_list_ptr, hits_ptr, M, num_experts, TOP_K,
                        SHARED_PARTS, NORM_TOP_K, ROUTE_ROWS, EXPERTS, PICKS, True)
            tl.atomic_xchg(route_counter_ptr, 0)  # zero again for the next launch

    @triton.jit
    def _route_rows(
        logits_ptr, logits_stride, picks_ptr, weights_ptr, hit_list_ptr, hits_ptr, M, num_experts,
        TOP_K: tl.constexpr, SHARED_PARTS: tl.constexpr, NORM_TOP_K: tl.constexpr, ROWS: tl.constexpr,
        EXPERTS: tl.constexpr, PICKS: tl.constexpr, FROM_L2: tl.constexpr,
    ):
        """Router logits [M, experts (+ the shared expert's gate)] → each row's TOP_K experts by softmax probability
        (ties to the lower id), their weights (renormalised with NORM_TOP_K, rounded to the logits' dtype), then
        SHARED_PARTS more picks of the shared expert's parts (ids num_experts..) weighted by the sigmoid of the last
        logit: picks and weights [M, TOP_K + SHARED_PARTS]. Also the picked experts' ids in increasing order
        (hit_list) and their number (hits). FROM_L2: the logits read past the L1 cache (written by other programs of
        the same launch)."""
        WIDTH: tl.constexpr = TOP_K + SHARED_PARTS
        CACHE: tl.constexpr = ".cg" if FROM_L2 else ""
        rows = tl.arange(0, ROWS)
        experts = tl.arange(0, EXPERTS)
        slots = tl.arange(0, PICKS)
        row_ok = rows < M
        dtype = logits_ptr.dtype.element_ty
        logits = tl.load(logits_ptr + rows[:, None] * logits_stride + experts[None, :],
                         mask=row_ok[:, None] & (experts < num_experts)[None, :], other=float("-inf"),
                         cache_modifier=CACHE).to(tl.float32)
        logits = tl.where(row_ok[:, None], logits, 0.0)  # padding rows: finite, never stored
        probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        probs = probs / tl.sum(probs, axis=1)[:, None]
        left = tl.where((experts < num_experts)[None, :], probs, -1.0)
        picks = tl.zeros([ROWS, PICKS], dtype=tl.int32)
        weights = tl.zeros([ROWS, PICKS], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            top = tl.max(left, axis=1)
            pick = tl.min(tl.where(left == top[:, None], experts[None, :], EXPERTS), axis=1)
            picks = tl.where(slots[None, :] == k, pick[:, None], picks)
            weights = tl.where(slots[None, :] == k, top[:, None], weights)
            left = tl.where(experts[None, :] == pick[:, None], -1.0, left)
        if NORM_TOP_K:
            weights = weights / tl.sum(weights, axis=1)[:, None]
        weights = weights.to(dtype).to(tl.float32)
        if SHARED_PARTS > 0:
            gate = tl.load(logits_ptr + rows * logits_stride + num_experts, mask=row_ok, other=0.0,
                           cache_modifier=CACHE).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            shared = (slots >= TOP_K) & (slots < WIDTH)
            picks = tl.where(shared[None, :], num_experts + slots[None, :] - TOP_K, picks)
            weights = tl.where(shared[None, :], gate[:, None], weights)
        stored = row_ok[:, None] & (slots < WIDTH)[None, :]
        tl.store(picks_ptr + rows[:, None] * WIDTH + slots[None, :], picks, mask=stored)
        tl.store(weights_ptr + rows[:, None] * WIDTH + slots[None, :], weights, mask=stored)
        # an expert is hit where some real row's top-k left it at -1 (experts past num_experts are -1 from the start)
        taken = (left < 0.0) & row_ok[:, None] & (experts < num_experts)[None, :]
        hit = tl.max(taken.to(tl.int32), axis=0)
        count = tl.sum(hit, axis=0)
        tl.store(hit_list_ptr + tl.cumsum(hit, axis=0) - 1, experts, mask=hit > 0)
        if SHARED_PARTS > 0:  # every row picks every part of the shared expert
            parts = tl.arange(0, PICKS)
            tl.store(hit_list_ptr + count + parts, num_experts + parts, mask=parts < SHARED_PARTS)
        tl.store(hits_ptr, count + SHARED_PARTS)

def attention_key_block(kv_len: int) -> int:
    """The attention's keys per block for a step over `kv_len` positions."""
    return 64 if kv_len <= 64 else KEY_BLOCK


def attention_splits(rows: int, kv_heads: int, key_blocks: int) -> int:
    """How many programs share a (row, KV head)'s key blocks: enough for about ATTENTION_PROGRAMS programs in all,
    at least one block each."""
    return max(1, min(key_blocks, ATTENTION_PROGRAMS // (rows * kv_heads)))


def new_arrivals(x: torch.Tensor, layers: int, kv_heads: int) -> torch.Tensor:
    """Zeroed arrival counters for a step's split attention, one row per layer: [layers, rows * kv_heads] int32.
    Each launch must get counters of its own (a step allocates them once for all its layers, so a CUDA graph replays
    one memset a step): two launches counting into the same ones, such as two engine lanes' steps at once on their
    own streams, would each see the other's programs arrive."""
    return torch.zeros(layers, x.shape[0] * kv_heads, dtype=torch.int32, device=x.device)


def decode_attention(
    qkv: torch.Tensor, attn: "torch.nn.Module", cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, arrivals: torch.Tensor | None = None,
    warps: int = 4, splits: int | None = None, key_block: int | None = None,
) -> torch.Tensor:
    """`Attention.forward` after its q/k/v projection for a decode step (one token per row) over any number of keys:
    qkv [rows, (H + 2G) * D] → attention output [rows, H * D], the new keys and values written into `kv_cache`.
    One kernel; `splits` programs per (row, KV head) share the key blocks (default: `attention_splits`), counting
    their arrivals in `arrivals` (zeros, used by this launch alone; default: its own, one memset more)."""
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rows = qkv.shape[0]
    k_cache, v_cache = kv_cache
    cos, sin = cos.reshape(rows, dim), sin.reshape(rows, dim)
    out = torch.empty(rows, heads * dim, dtype=qkv.dtype, device=qkv.device)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and cos.stride(-1) == 1
    key_block = key_block or attention_key_block(batch.kv_len)
    keys = triton.cdiv(batch.kv_len, key_block) * key_block
    splits = splits or attention_splits(rows, kv_heads, keys // key_block)
    group_rows, dim_pad = max(16, triton.next_power_of_2(heads // kv_heads)), max(16, dim)
    partial = out  # unused with one split
    if splits > 1:
        partial = torch.empty(rows * kv_heads * splits * group_rows * (dim_pad + 2), dtype=torch.float32,
                              device=qkv.device)
        arrivals = new_arrivals(qkv, 1, kv_heads)[0] if arrivals is None else arrivals
        assert arrivals.numel() >= rows * kv_heads and arrivals.dtype == torch.int32
    arrivals = out if arrivals is None else arrivals
    with _on_device(qkv):
        _decode_attention_kernel[(rows, kv_heads, splits)](
            qkv, qkv.stride(0), attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon, cos, sin,
            cos.stride(0), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), batch.slots,
            batch.write_index.reshape(-1), out, out.stride(0), dim**-0.5, partial, arrivals, HEADS=heads,
            KV_HEADS=kv_heads, D=dim, D_PAD=dim_pad, GROUP_ROWS=group_rows, KEYS=keys, KEY_BLOCK=key_block,
            SPLITS=splits, ROWS_ARE_SLOTS=batch.rows_are_slots, FP32_DOT=interpreting(),
            PRECISION=dot_precision(k_cache), num_warps=warps,
        )
    return out


def route_warps(rows: int) -> int:
    """The routing kernel's num_warps: one warp for one row (3.2-3.5 us a call where four took 3.7-4.5 on an H200),
    four for more (3.8-6.3 us at 2 to 32 rows, where one took 6.7-27.8)."""
    return 1 if rows == 1 else 4


def route(logits: torch.Tensor, top_k: int, norm_top_k: bool, num_experts: int, shared_parts: int,
          warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [M, num_experts (+1: the shared expert's gate, with shared_parts; more columns unread)] → picks
    [M, top_k + shared_parts] int32, their weights (fp32 holding the logits' dtype's values), the picked experts'
    ids in increasing order (a list as long as there are experts, its tail unused) and their number [1]. One kernel
    (`warps`: its num_warps, default `route_warps`). Keep the logits' row stride a multiple of 16 elements: Triton
    specialises on it, and on other strides the kernel took 2.7x the instructions (50 barriers instead of 10)."""
    rows = logits.shape[0]
    routes = _routes(logits, top_k, num_experts, shared_parts)
    with _on_device(logits):
        _route_kernel[(1,)](
            logits, logits.stride(0), *routes, rows, num_experts,
            **_route_constants(rows, top_k, norm_top_k, num_experts, shared_parts),
            num_warps=warps or route_warps(rows),
        )
    return routes


def router_and_route(
    x: torch.Tensor, router: torch.Tensor, norm_weight: torch.Tensor, eps: float, squares: torch.Tensor | None,
    top_k: int, norm_top_k: bool, num_experts: int, shared_parts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rows_matmul` (RMSNorm with `norm_weight`, then the `router` GEMM) and `route` over its logits in one kernel:
    the GEMM's last program to finish routes. Returns what `route` returns, the same values."""
    routes = _routes(x, top_k, num_experts, shared_parts)
    counter = small_batch.arrival_counters(x.device)[small_batch.TAIL_COUNTER:]
    small_batch.launch_rows_matmul(
        _router_kernel, (*routes, counter, num_experts),
        _route_constants(x.shape[0], top_k, norm_top_k, num_experts, shared_parts, "ROUTE_ROWS"), x, router,
        norm_weight, eps, squares)
    return routes


def _routes(
    like: torch.Tensor, top_k: int, num_experts: int, shared_parts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A routing's outputs, unfilled: picks, weights, the hit list and its length."""
    rows, width = like.shape[0], top_k + shared_parts
    return (torch.empty(rows, width, dtype=torch.int32, device=like.device),
            torch.empty(rows, width, dtype=torch.float32, device=like.device),
            torch.empty(num_experts + shared_parts, dtype=torch.int32, device=like.device),
            torch.empty(1, dtype=torch.int32, device=like.device))


def _route_constants(rows: int, top_k: int, norm_top_k: bool, num_experts: int, shared_parts: int,
                     rows_name: str = "ROWS") -> dict[str, int | bool]:
    return {"TOP_K": top_k, "SHARED_PARTS": shared_parts, "NORM_TOP_K": norm_top_k,
            rows_name: max(16, triton.next_power_of_2(rows)), "EXPERTS": triton.next_power_of_2(num_experts),
            "PICKS": triton.next_power_of_2(top_k + shared_parts)}


def applies(layer: "torch.nn.Module", x: torch.Tensor, batch: AttentionBatch) -> bool:
    """Whether `decoder_layer` can run this layer's step: Triton on a GPU (or its interpreter), an MoE layer with
    fused q/k/v and expert kernels on (a shared expert folded in, if it has one), a decode step of at most
    `MAX_ROWS` rows over the cache."""
    from omni_ray.layers.moe import SparseMoE

    mlp, attn = layer.mlp, layer.self_attn
    return (
        triton is not None and (x.is_cuda or interpreting()) and isinstance(mlp, SparseMoE) and mlp.experts.use_kernels
        and (mlp.shared_expert is None or mlp.router_and_shared_gate is not None) and attn.qkv is not None
        and x.shape[1] == 1 and x.shape[0] <= MAX_ROWS and not batch.from_zero
        and attn.head_dim & (attn.head_dim - 1) == 0
    )


def decoder_layer(
    layer: "torch.nn.Module", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, squares: torch.Tensor | None = None,
    arrivals: torch.Tensor | None = None, combine_in_down: bool = False, route_in_router: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DecoderLayer.forward` for an MoE layer's decode step in eight kernels (see the module's docstring). x [B, 1,
    h]; `squares`: the partial sums of x's rows' squares when the previous layer's kernels left them. Returns the
    layer's output and the same sums of it, for the next layer's input norm. `arrivals`: zeroed counters of this
    layer's own for a split attention (`new_arrivals`). `combine_in_down`: the combine inside the down projection's
    kernel (`down_and_combine`); `route_in_router`: the routing inside the router GEMM's (`router_and_route`); each
    one kernel fewer, the same outputs."""
    rows, _, width = x.shape
    attn, moe = layer.self_attn, layer.mlp
    flat = x.reshape(rows, width)
    norm = layer.input_layernorm
    qkv = rows_matmul(flat, attn.qkv, norm.weight, norm.variance_epsilon, squares=squares)
    attended = decode_attention(qkv, attn, cos, sin, kv_cache, batch, arrivals)
    flat, squares = rows_matmul_keeping_squares(attended, attn.o_proj.weight, flat)
    norm = layer.post_attention_layernorm
    router = moe.router_and_shared_gate if moe.router_and_shared_gate is not None else moe.gate.weight
    num_experts = moe.gate.weight.shape[0]
    if route_in_router:
        picks, weights, hit_list, hits = router_and_route(flat, router, norm.weight, norm.variance_epsilon, squares,
                                                          moe.gate.top_k, moe.gate.norm_topk_prob, num_experts,
                                                          moe.shared_parts)
    else:
        logits = rows_matmul(flat, router, norm.weight, norm.variance_epsilon, squares=squares)
        picks, weights, hit_list, hits = route(logits, moe.gate.top_k, moe.gate.norm_topk_prob, num_experts,
                                               moe.shared_parts)
    gate_up, down = moe.experts.stacked or (moe.experts.gate_up_proj, moe.experts.down_proj)
    hidden = picked_expert_matmul(flat, gate_up, picks, hit_list, hits, gated=True, per_pick=False,
                                  norm_weight=norm.weight, eps=norm.variance_epsilon, squares=squares)
    if combine_in_down:
        out, squares = down_and_combine(hidden, down, picks, hit_list, hits, weights, flat)
    else:
        y = picked_expert_matmul(hidden, down, picks, hit_list, hits, gated=False, per_pick=True)
        out, squares = combine(y, weights, flat)
    return out.reshape(rows, 1, width), squares
