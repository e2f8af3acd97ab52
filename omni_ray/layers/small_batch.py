"""A dense decoder layer at a few rows in five Triton kernels: norm-fused GEMMs and one small-key attention kernel.

The Talker's code predictor runs 15 passes of 5 dense layers per frame, at most 32 rows and 17 keys. Compiled by
inductor, a layer is about 25 kernels (four cuBLAS GEMMs with split-K reductions, norms, rotary, the KV write, a
softmax over the keys, SwiGLU, residuals): about 1,500 kernels of 2-8 us per frame. Here a layer is five:

1. input RMSNorm + the fused q/k/v projection;
2. q/k per-head RMSNorm + rotary + the KV-cache write + attention over the slot's keys, one program per (row, query
   head) up to 16 rows, else per (row, KV head);
3. the output projection + the residual;
4. post-attention RMSNorm + the fused gate/up projection + SiLU(gate) * up;
5. the down projection + the residual.

Every GEMM holds up to 32 rows in one tile and splits the output columns over programs, so each weight is read once
per pass (per 32 rows); the narrow, deep ones also split their depth, the last program of a column block to finish
adding the others' partial sums in a fixed order. A norm-fused GEMM multiplies x times the norm's scale and scales
each row of the products by its inverse RMS at the end, so nothing holds the weights' loads back: the GEMMs that add
a residual (3, 5) leave each program's partial sums of its output's squares, which the next norm-fused GEMM (4, and 1
of the next layer) adds up after its loop, instead of passing over the rows (as the first layer's q/k/v GEMM still
does, after its loop). Summed inside the GEMM's own loop instead, the projection took 10-14 us instead of 6-11 us
on an H200. Sums run in fp32 and each kernel rounds once, where eager rounds after every op: outputs agree with
the eager layer to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch

from omni_ray.device_memory import StreamCounterSets
from omni_ray.layers.attention import AttentionBatch, SMALL_KEY_ATTENTION_MAX_KEYS

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the layers run their eager code
    triton = None

MAX_ROWS = 64  # rows x tokens of a step the kernels take (past it, the layer's own code: measured up to 64)
ROW_TILE = 32  # rows per GEMM program: 64 rows in one tile took 13-16 us where 32 took 8-11 (q/k/v, gate/up)
# Whether a GEMM that reads each weight once (its rows in one tile) marks the weights' lines first to go from L2
# (`evict_first`), so that they stop crowding out what the step reads again: activations, partial sums, keys. In the
# persistent code-predictor pass the same hint made a pass 4-5% faster on an H100; here it did not shorten the
# Talker's engine steps (at 1, 8 or 32 rows), so it is off unless `engine.weights_evict_first` sets it.
# `set_weights_evict_first`.
weights_evict_first = False


if triton is not None:

    @triton.jit
    def _rows_matmul_epilogue(acc, acc_up, rows, cols, out_mask, out_ptr, out_stride, residual, squares_out_ptr, M,
                              GATED: tl.constexpr, RESIDUAL: tl.constexpr, SQUARES_OUT: tl.constexpr):
        """SiLU(gate) * up (GATED), + the residual tile, rounded into out; SQUARES_OUT: the partial sums of the
        rounded block's squares, as the next norm would sum them, at row program_id(0) of [column blocks, M]."""
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if RESIDUAL:
            acc += residual.to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=out_mask)
        if SQUARES_OUT:
            rounded = tl.where(out_mask, out.to(tl.float32), 0.0)
            tl.store(squares_out_ptr + tl.program_id(0) * M + rows, tl.sum(rounded * rounded, axis=1),
                     mask=rows < M)

    @triton.jit
    def _rows_matmul_kernel(  # no annotations in jit functions: Triton reads them as its own types
        x_ptr, x_stride, w_ptr, w_stride, out_ptr, out_stride, res_ptr, res_stride, norm_ptr, eps, M, N,
        squares_in_ptr, squares_in_count, squares_out_ptr, partial_ptr, arrivals_ptr,
        K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
        SQUARES_IN: tl.constexpr, SQUARES_OUT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, WEIGHT_EVICTION: tl.constexpr,
    ):
        """out[rows, cols] = epilogue(prologue(x) @ w[cols].T) for this program's block of rows and output columns.
        SQUARES_IN (a power of two >= squares_in_count, or 0): the RMSNorm reads each row's sum of squares as
        squares_in_count partial sums [count, M] instead of summing x's squares; SQUARES_OUT: the program writes the
        partial sums of its output block's squares as row pid of [programs, M]. SPLIT_K > 1: program_id(2) takes
        one of SPLIT_K stretches of the depth and stores its fp32 sums in partial_ptr [SPLIT_K, 1 or 2, M, N]; the
        block's last program to arrive (counted in arrivals_ptr, one int32 per block, left at zero) adds the
        stretches up in their order (the same sums whichever arrives last) and runs the epilogue. (K is a constant:
        a loop bound that is an argument fails under the interpreter with NumPy 2. FP32_DOT: the tiles are
        multiplied as fp32, exact for half-precision values, for the interpreter, which multiplies bf16 tiles' raw
        bits. PRECISION: "ieee" for fp32 weights, which tensor cores would otherwise take as tf32. WEIGHT_EVICTION:
        the weights' loads' eviction policy, "" or "evict_first".)"""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        out_mask = row_ok[:, None] & col_ok[None, :]
        # Nothing the weights' loads wait for: the residual tile and the norm's partial sums are asked for first and
        # used after the loop (summing the partial sums across warps before it held the weights back by a round
        # trip and two barriers). The norm scales each row by its inverse RMS after the products, not before.
        residual = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if RESIDUAL:
            residual = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=out_mask,
                               other=0.0).to(tl.float32)
        if SQUARES_IN > 0:  # summed by the kernel that wrote x
            parts = tl.arange(0, SQUARES_IN)
            partial = tl.load(squares_in_ptr + parts[:, None] * M + rows[None, :],
                              mask=(parts < squares_in_count)[:, None] & row_ok[None, :], other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        STRETCH: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K  # depth per program
        k_start = tl.program_id(2) * STRETCH
        for k0 in range(0, STRETCH, BLOCK_K):
            kk = k_start + k0 + ks
            k_ok = (kk < K) & (k0 + ks < STRETCH)
            x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                scale = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                x = x.to(tl.float32) * scale[None, :]
            x = x.to(w_ptr.dtype.element_ty)
            w = tl.load(w_ptr + cols[:, None] * w_stride + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy=WEIGHT_EVICTION)
            if FP32_DOT:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GATED:  # the up rows sit N rows below the gate rows
                up = tl.load(w_ptr + (cols + N)[:, None] * w_stride + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                             other=0.0, eviction_policy=WEIGHT_EVICTION)
                if FP32_DOT:
                    up = up.to(tl.float32)
                acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision=PRECISION)
        if NORM:  # RMSNorm of each row: (x * r * scale) @ w.T = r * ((x * scale) @ w.T), r its inverse RMS
            if SQUARES_IN > 0:
                squares = tl.sum(partial, axis=0)
            else:
                squares = tl.zeros([BLOCK_M], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = (k0 + ks) < K
                    x = tl.load(x_ptr + rows[:, None] * x_stride + (k0 + ks)[None, :],
                                mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    squares += tl.sum(x * x, axis=1)
            inverse_rms = 1.0 / tl.sqrt(squares / K + eps)
            acc *= inverse_rms[:, None]
            if GATED:
                acc_up *= inverse_rms[:, None]
        if SPLIT_K == 1:
            _rows_matmul_epilogue(acc, acc_up, rows, cols, out_mask, out_ptr, out_stride, residual, squares_out_ptr,
                                  M, GATED, RESIDUAL, SQUARES_OUT)
        else:
            PARTS: tl.constexpr = 2 if GATED else 1
            block = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            at = rows[:, None] * N + cols[None, :]
            stretch_ptr = partial_ptr + tl.program_id(2) * PARTS * M * N
            tl.store(stretch_ptr + at, acc, mask=out_mask)
            if GATED:
                tl.store(stretch_ptr + M * N + at, acc_up, mask=out_mask)
            tl.debug_barrier()  # every thread's stores made before the release below
            if tl.atomic_add(arrivals_ptr + block, 1) == SPLIT_K - 1:  # acq_rel: the others' stores are visible
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):  # in depth order: the same sums in every run
                    acc += tl.load(partial_ptr + split * PARTS * M * N + at, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(partial_ptr + (split * PARTS + 1) * M * N + at, mask=out_mask, other=0.0,
                                          cache_modifier=".cg")
                _rows_matmul_epilogue(acc, acc_up, rows, cols, out_mask, out_ptr, out_stride, residual,
                                      squares_out_ptr, M, GATED, RESIDUAL, SQUARES_OUT)
                tl.atomic_xchg(arrivals_ptr + block, 0)  # zero again for the next launch

    @triton.jit
    def _head_norm_rope(ptr, norm_ptr, eps, cos_ptr, sin_ptr, D: tl.constexpr):
        """One head's vector at `ptr`, RMS-normed with `norm_ptr`'s scale and rotated (rotate-half rotary), each step
        rounded to the input's dtype as the eager layer rounds it."""
        d = tl.arange(0, D)
        turned = (d + D // 2) % D  # rotate_half: the other half, the first half negated
        x = tl.load(ptr + d).to(tl.float32)
        inverse_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        dtype = ptr.dtype.element_ty
        normed = (x * inverse_rms * tl.load(norm_ptr + d).to(tl.float32)).to(dtype).to(tl.float32)
        other = (tl.load(ptr + turned).to(tl.float32) * inverse_rms * tl.load(norm_ptr + turned).to(tl.float32))
        other = tl.where(d < D // 2, -1.0, 1.0) * other.to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32)
        return (normed * cos + other * sin).to(dtype)

    @triton.jit
    def _small_attention_kernel(
        qkv_ptr, qkv_stride, q_norm_ptr, k_norm_ptr, eps, cos_ptr, sin_ptr, rope_stride, k_cache_ptr, v_cache_ptr,
        slot_stride, position_stride, slots_ptr, index_ptr, out_ptr, out_stride, kv_len, scale,
        T: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, KEYS: tl.constexpr,
        QUERY_HEADS: tl.constexpr, ROWS_ARE_SLOTS: tl.constexpr,
    ):
        """Row b's T new tokens for KV head g: their keys and values into the cache (by the group's first program),
        then QUERY_HEADS of the head's query heads (program_id(1) % the programs per KV head picks which) attend over
        the slot's first kv_len positions up to its own (the new keys are taken from registers, not read back: every
        program of the group computes them). ROWS_ARE_SLOTS: row b is slot b (slots_ptr is not read)."""
        PROGRAMS_PER_KV_HEAD: tl.constexpr = HEADS // KV_HEADS // QUERY_HEADS
        b = tl.program_id(0)
        g = tl.program_id(1) // PROGRAMS_PER_KV_HEAD
        part = tl.program_id(1) % PROGRAMS_PER_KV_HEAD
        d = tl.arange(0, D)
        positions = tl.arange(0, KEYS)
        slot = b if ROWS_ARE_SLOTS else tl.load(slots_ptr + b)
        cache_at = slot * slot_stride + positions[:, None] * position_stride + g * D + d[None, :]
        in_range = (positions < kv_len)[:, None]
        keys = tl.load(k_cache_ptr + cache_at, mask=in_range, other=0.0).to(tl.float32)
        values = tl.load(v_cache_ptr + cache_at, mask=in_range, other=0.0).to(tl.float32)
        for t in tl.static_range(T):
            row = b * T + t
            written = tl.load(index_ptr + row)
            base = qkv_ptr + row * qkv_stride
            key = _head_norm_rope(base + (HEADS + g) * D, k_norm_ptr, eps, cos_ptr + row * rope_stride,
                                  sin_ptr + row * rope_stride, D)
            value = tl.load(base + (HEADS + KV_HEADS + g) * D + d)
            at = slot * slot_stride + written * position_stride + g * D + d
            # The group's first program writes the cache. A branch, not a mask `(d < D) & (part == 0)`: Triton's
            # interpreter keeps that scalar comparison as int32 data, which Triton 3.9's masked store refuses.
            if part == 0:
                tl.store(k_cache_ptr + at, key.to(k_cache_ptr.dtype.element_ty))
                tl.store(v_cache_ptr + at, value.to(v_cache_ptr.dtype.element_ty))
            here = (positions == written)[:, None]
            keys = tl.where(here, key.to(k_cache_ptr.dtype.element_ty).to(tl.float32)[None, :], keys)
            values = tl.where(here, value.to(v_cache_ptr.dtype.element_ty).to(tl.float32)[None, :], values)
        for t in tl.static_range(T):
            row = b * T + t
            written = tl.load(index_ptr + row)
            visible = (positions <= written) & (positions < kv_len)
            for j in tl.static_range(QUERY_HEADS):
                head = g * (HEADS // KV_HEADS) + part * QUERY_HEADS + j
                query = _head_norm_rope(qkv_ptr + row * qkv_stride + head * D, q_norm_ptr, eps,
                                        cos_ptr + row * rope_stride, sin_ptr + row * rope_stride, D).to(tl.float32)
                scores = tl.where(visible, tl.sum(keys * query[None, :], axis=1) * scale, float("-inf"))
                weights = tl.exp(scores - tl.max(scores, axis=0))
                weights = weights / tl.sum(weights, axis=0)
                out = tl.sum(weights[:, None] * values, axis=0)
                tl.store(out_ptr + row * out_stride + head * D + d, out.to(out_ptr.dtype.element_ty))


def set_weights_evict_first(on: bool) -> None:
    """Whether this process's one-tile GEMMs mark their weights' lines first to go from L2 (`weights_evict_first`).
    Each launch reads it, but CUDA graphs captured before keep the kernels they captured: set it before warm-up."""
    global weights_evict_first
    weights_evict_first = on


def interpreting() -> bool:
    """Triton runs its interpreter (on the CPU): kernels launch on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _on_device(tensor: torch.Tensor):  # type: ignore[no-untyped-def]
    """Triton launches on the current device, which may be another (on the CPU: Triton's interpreter)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else nullcontext()


MatmulConfig = tuple[int, int, int, int, int]  # BLOCK_N, BLOCK_K, num_stages, num_warps, SPLIT_K


def matmul_config(n: int, k: int) -> MatmulConfig:
    """The launch of `rows_matmul` for an output width n and depth k, as measured on an H200 with each weight
    streamed from memory (`benchmarks/small_batch_bench.py`). Narrow column blocks, so that even a 1,024-wide
    projection spreads over 64 programs; a narrow and deep one (the code predictor's and the Talker's o, the code
    predictor's down) also splits its depth in four, 256 programs in all (13-25% faster at 1 row). Splitting
    the wider ones at a depth of 1,024 was slower (q/k/v, gate/up, the code head). At a depth of 2,048 or more (the
    Thinker's, each 5-25% faster at 1 to 32 rows than without its own config): its o (2,048 wide, 4,096 deep) in
    32-column blocks split in four, its router (128 wide) in 32-column blocks split in eight, its q/k/v (5,120 wide)
    in 64-column blocks."""
    if k >= 2048:
        if n <= 256:
            return 32, 128, 3, 4, 8
        if n <= 2048:
            return (16 if n <= 1024 else 32), 128, 3, 4, 4
        if n >= 4096:
            return 64, 256, 3, 4, 1
    return (16 if n <= 2048 else 32), 256, 3, 4, 1


_arrivals: dict[tuple[torch.device, int], torch.Tensor] = {}
ARRIVAL_COUNTERS = 4096  # column blocks x row blocks of one split-depth launch
TAIL_COUNTER = ARRIVAL_COUNTERS - 1  # the one a `launch_rows_matmul` kernel's tail counts every program in
ARRIVAL_SETS = 96  # streams a device's sets in memory of their own serve (1.5 MiB): torch's stream pools hold 32 per
# priority, and the default stream is one more; further streams get tensors outside any capture
_arrival_sets = StreamCounterSets(ARRIVAL_COUNTERS, ARRIVAL_SETS, [0] * ARRIVAL_COUNTERS)


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters a split-depth `rows_matmul` counts its programs' arrivals in, one set per device and
    stream: every launch leaves them at zero, and launches on one stream run one after the other (a graph captured
    on its own stream keeps that stream's set). On a GPU they live in device memory of their own (`device_memory`):
    a tensor allocated inside a capture sits in the graphs' shared pool, where the replays of graphs captured before
    it write their intermediates (the persistent pass's barrier counters, once kept that way, were written over),
    and a set off zero leaves a column block's sums unadded in every later launch. A tensor on a CPU, or past
    ARRIVAL_SETS streams outside a capture; inside a capture with no set left, an error (the capture then fails and
    its step runs eagerly)."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _arrivals:
        own = _arrival_sets.for_current_stream(device) if device.type == "cuda" else None
        if own is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"no arrival counters for this stream of {device} inside a graph capture: more than "
                               f"{ARRIVAL_SETS} streams, or the first ask of the process is in a capture")
        _arrivals[key] = own if own is not None else torch.zeros(ARRIVAL_COUNTERS, dtype=torch.int32, device=device)
    return _arrivals[key]


def rows_matmul(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    gated: bool = False, residual: torch.Tensor | None = None, config: MatmulConfig | None = None,
    squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight.T, weight [N, K] (or [2N, K], gate rows then up rows, with `gated`) → [M, N] in x's dtype.
    `norm_weight`: RMSNorm x first (that scale, `eps`), reading each row's sum of squares from `squares` (partial
    sums [P, M], as `rows_matmul_keeping_squares` leaves them) when given; `gated`: SiLU(gate) * up; `residual`
    [M, N]: added to the result; `config`: another launch than `matmul_config`'s. One kernel."""
    return _rows_matmul(x, weight, norm_weight, eps, gated, residual, config, squares, keep_squares=False)[0]


def rows_matmul_keeping_squares(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, config: MatmulConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows_matmul` with a residual, also returning the partial sums of its output rows' squares [P, M] (one row
    per program: no atomics, so the sums are the same in every run), which the next norm-fused GEMM reads instead of
    a pass over the rows."""
    out, squares = _rows_matmul(x, weight, None, 0.0, False, residual, config, None, keep_squares=True)
    assert squares is not None
    return out, squares


def launch_rows_matmul(
    kernel: Any, tail_args: tuple[Any, ...], tail_constants: dict[str, Any], x: torch.Tensor, weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rows_matmul`'s launch (no residual, not gated) of another kernel: one that takes `_rows_matmul_kernel`'s
    arguments followed by `tail_args` (and its constants followed by `tail_constants`), calls `_rows_matmul_kernel`
    and then runs a tail of its own over the output, its last program to finish counted in
    `arrival_counters(x.device)[TAIL_COUNTER]`. Returns the GEMM's output."""
    return _rows_matmul(x, weight, norm_weight, eps, False, None, None, squares, False, (kernel, tail_args,
                                                                                         tail_constants))[0]


def _rows_matmul(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, gated: bool,
    residual: torch.Tensor | None, config: MatmulConfig | None, squares: torch.Tensor | None, keep_squares: bool,
    tail: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, stages, warps, split = config or matmul_config(n, k)
    block_m = min(ROW_TILE, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(n, block_n), triton.cdiv(rows, block_m), split)
    kept = torch.empty(grid[0], rows, dtype=torch.float32, device=x.device) if keep_squares else None
    partial, arrivals = out, out
    if split > 1:
        assert grid[0] * grid[1] <= (TAIL_COUNTER if tail else ARRIVAL_COUNTERS)
        partial = torch.empty(split, 2 if gated else 1, rows, n, dtype=torch.float32, device=x.device)
        arrivals = arrival_counters(x.device)
    res = residual if residual is not None else out
    if squares is not None:
        assert squares.shape[1] == rows and squares.is_contiguous() and squares.dtype == torch.float32
    kernel, tail_args, tail_constants = tail or (_rows_matmul_kernel, (), {})
    with _on_device(x):
        kernel[grid](
            x, x.stride(0), weight, weight.stride(0), out, out.stride(0),
            res, res.stride(0),
            norm_weight if norm_weight is not None else weight, eps, rows, n,
            squares if squares is not None else out, 0 if squares is None else squares.shape[0],
            kept if kept is not None else out, partial, arrivals, *tail_args,
            K=k, NORM=norm_weight is not None, GATED=gated, RESIDUAL=residual is not None,
            SQUARES_IN=0 if squares is None else triton.next_power_of_2(squares.shape[0]), SQUARES_OUT=keep_squares,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, FP32_DOT=interpreting(),
            PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
            WEIGHT_EVICTION="evict_first" if weights_evict_first and grid[1] == 1 else "", num_warps=warps,
            num_stages=stages, **tail_constants,
        )
    return out, kept


def small_attention(
    qkv: torch.Tensor, attn: "torch.nn.Module", cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, rows: int, warps: int = 2,
    query_heads: int | None = None,
) -> torch.Tensor:
    """`Attention.forward` after its q/k/v projection, for `rows` rows of `batch.num_tokens` tokens: qkv [rows*T,
    (H + 2G) * D] → attention output [rows*T, H * D], the new keys and values written into `kv_cache`. One kernel
    (`warps`: its launch's num_warps; two were the fastest of 1-8 at 1-64 rows on an H200), one program per row and
    `query_heads` query heads (default: one up to 16 rows, else a KV head's all). A program's work is one chain of
    dependent steps (about 1,700 instructions a warp with two query heads at one row on an H200, under Nsight
    Compute), so fewer heads a program shorten it: the code predictor's attention with one a program took 4.4 / 4.8
    / 5.9 us at 1 / 8 / 32 rows where two took 5.4 / 5.3 / 5.8."""
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    query_heads = query_heads or (1 if rows <= 16 else heads // kv_heads)
    assert (heads // kv_heads) % query_heads == 0
    k_cache, v_cache = kv_cache
    tokens = batch.num_tokens
    cos, sin = cos.reshape(rows * tokens, dim), sin.reshape(rows * tokens, dim)
    index = batch.write_index.reshape(-1)
    out = torch.empty(rows * tokens, heads * dim, dtype=qkv.dtype, device=qkv.device)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and cos.stride(-1) == 1
    with _on_device(qkv):
        _small_attention_kernel[(rows, heads // query_heads)](
            qkv, qkv.stride(0), attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon, cos, sin,
            cos.stride(0), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), batch.slots, index, out,
            out.stride(0), batch.kv_len, dim**-0.5, T=tokens, HEADS=heads, KV_HEADS=kv_heads, D=dim,
            KEYS=triton.next_power_of_2(batch.kv_len), QUERY_HEADS=query_heads,
            ROWS_ARE_SLOTS=batch.rows_are_slots, num_warps=warps,
        )
    return out


def takes_rows(x: torch.Tensor) -> bool:
    """Whether `rows_matmul` takes x [M, K]: Triton on a GPU (or its interpreter), at most `MAX_ROWS` rows."""
    return triton is not None and (x.is_cuda or interpreting()) and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1


def applies(layer: "torch.nn.Module", x: torch.Tensor, batch: AttentionBatch) -> bool:
    """Whether `decoder_layer` can run this layer's step: Triton on a GPU (or its interpreter), a dense layer with
    fused projections, few rows and few keys, a decode over the cache (not a from-zero prefill)."""
    mlp, attn = layer.mlp, layer.self_attn
    return (
        triton is not None and (x.is_cuda or interpreting()) and getattr(mlp, "gate_up", None) is not None
        and attn.qkv is not None and x.shape[0] * x.shape[1] <= MAX_ROWS and not batch.from_zero
        and batch.kv_len <= SMALL_KEY_ATTENTION_MAX_KEYS and attn.head_dim & (attn.head_dim - 1) == 0
    )


def decoder_layer(
    layer: "torch.nn.Module", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, squares: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DecoderLayer.forward` for a dense layer in five kernels (see the module's docstring). x [B, T, h]; `squares`:
    the partial sums of x's rows' squares when the previous layer's kernels left them. Returns the layer's output and
    the same sums of it, for the next layer's input norm."""
    rows, tokens, width = x.shape
    attn, mlp = layer.self_attn, layer.mlp
    flat = x.reshape(rows * tokens, width)
    norm = layer.input_layernorm
    qkv = rows_matmul(flat, attn.qkv, norm.weight, norm.variance_epsilon, squares=squares)
    attended = small_attention(qkv, attn, cos, sin, kv_cache, batch, rows)
    flat, squares = rows_matmul_keeping_squares(attended, attn.o_proj.weight, flat)
    norm = layer.post_attention_layernorm
    hidden = rows_matmul(flat, mlp.gate_up, norm.weight, norm.variance_epsilon, gated=True, squares=squares)
    flat, squares = rows_matmul_keeping_squares(hidden, mlp.down_proj.weight, flat)
    return flat.reshape(rows, tokens, width), squares
