"""A decode batch's MoE expert GEMMs as two Triton kernels, one program per (picked expert, column block).

`torch._grouped_mm` (cutlass) took 10 us per GEMM for the Talker's 6 picked experts at batch 1 on an H200, where
their weights take 1-2 us to read, and 52 us at batch 32. Here a decode batch's rows fit one tile per expert (an
expert holds at most one pair per token), so a program reads its expert's column block once for all the expert's
rows. The grid covers only as many experts as can be picked (min(pairs, experts)); each program finds its expert
and its pairs in the per-expert counts itself (a prefix sum over the 128 experts in registers), so nothing waits for
the host, CUDA graphs can capture it, and no kernel runs before the GEMMs to list the picked experts or their
offsets (as eight small ones per MoE layer once did).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from omni_ray.layers.small_batch import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the experts run their other code
    triton = None

MAX_TOKENS = 64  # a decode batch's tokens: every expert's rows in one tile
ExpertMatmulConfig = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_stages, num_warps
DEFAULT_CONFIG: ExpertMatmulConfig = (32, 128, 3, 4)
WIDE_CONFIG: ExpertMatmulConfig = (64, 128, 3, 4)


def launch_config(gated: bool, tokens: int) -> ExpertMatmulConfig:
    """The launch of an expert GEMM for a batch of `tokens`, as measured on an H200 over ten configs
    (`benchmarks/small_batch_bench.py`): 64-column blocks, except gate/up for fewer than 8 tokens (whose few picked
    experts fill the GPU only with 32-column blocks)."""
    return DEFAULT_CONFIG if gated and tokens < 8 else WIDE_CONFIG


if triton is not None:

    @triton.jit
    def expert_tile(  # no annotations in jit functions: Triton reads them as its own types
        x_ptr, x_stride, rows, row_ok, w_base, w_row_stride, cols, col_ok, N, squares, eps, norm_ptr,
        K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """x[rows] (RMS-normed with NORM: norm_ptr's weights, each row's sum of squares the column sums of
        `squares` [P, BLOCK_M]) @ w_base[cols].T in fp32 [BLOCK_M, BLOCK_N]; GATED: w_base holds gate rows then up
        rows (N each), and the tile is SiLU(gate) * up. Rows not row_ok are zeros. The rows' inverse RMS scales the
        products after the loop ((x * r * scale) @ w.T = r * ((x * scale) @ w.T)), so summing `squares` (loaded by
        the caller, across warps) does not hold the weights' loads back."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if NORM:
                scale = tl.load(norm_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                x = (x.to(tl.float32) * scale[None, :]).to(w_base.dtype.element_ty)
            w = tl.load(w_base + cols[:, None] * w_row_stride + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if FP32_DOT:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GATED:
                up = tl.load(w_base + (cols + N)[:, None] * w_row_stride + kk[None, :],
                             mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                if FP32_DOT:
                    up = up.to(tl.float32)
                acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision=PRECISION)
        if NORM:
            inverse_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
            acc *= inverse_rms[:, None]
            acc_up *= inverse_rms[:, None]
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        return acc

    @triton.jit
    def _expert_matmul_kernel(  # no annotations in jit functions: Triton reads them as its own types
        x_ptr, x_stride, token_ptr, w_ptr, w_expert_stride, w_row_stride, counts_ptr, out_ptr, out_stride, N,
        num_experts,
        K: tl.constexpr, GATED: tl.constexpr, GATHER: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """out[p, cols] for the pairs p of the program's expert e, the program_id(0)-th expert with pairs (pairs are
        sorted by expert: e's are those after the pairs of experts < e): x[token[p]] (GATHER) or x[p] times
        w[e, cols].T; GATED: w[e] holds gate rows then up rows (N each), and the result is SiLU(gate) * up. The
        program finds e and its pairs in the per-expert counts (EXPERTS: a power of two >= num_experts); a program
        past the last expert with pairs does nothing."""
        e = tl.arange(0, EXPERTS)
        counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
        hit = counts > 0
        mine = hit & (tl.cumsum(hit.to(tl.int32), axis=0) == tl.program_id(0) + 1)
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            expert = tl.sum(tl.where(mine, e, 0), axis=0)
            start = tl.sum(tl.where(e < expert, counts, 0), axis=0)
            end = start + tl.sum(tl.where(mine, counts, 0), axis=0)
            pairs = start + tl.arange(0, BLOCK_M)
            pair_ok = pairs < end
            rows = tl.load(token_ptr + pairs, mask=pair_ok, other=0) if GATHER else pairs
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            acc = expert_tile(x_ptr, x_stride, rows, pair_ok, w_ptr + expert * w_expert_stride, w_row_stride, cols,
                              col_ok, N, tl.zeros([1, BLOCK_M], dtype=tl.float32), 0.0, x_ptr, K, False, GATED,
                              BLOCK_M, BLOCK_N, BLOCK_K, FP32_DOT, PRECISION)
            tl.store(out_ptr + pairs[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=pair_ok[:, None] & col_ok[None, :])


def applies(x: torch.Tensor) -> bool:
    """Triton on a GPU (or its interpreter) and a decode batch's few tokens."""
    return triton is not None and (x.is_cuda or interpreting()) and x.shape[0] <= MAX_TOKENS


def expert_matmul(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, token: torch.Tensor | None, gated: bool,
    block_m: int, config: ExpertMatmulConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """For the pairs sorted by expert (counts[e] pairs each, in expert order): x[token[p]] (or x[p] when token is
    None) @ weight[e].T, weight [E, N, K] (or [E, 2N, K] with `gated`: SiLU(gate) * up). → [pairs, N]. `config`:
    the launch (column block, depth block, pipeline stages, warps). One program per expert that can have pairs
    (at most one per pair) and column block: nothing waits for the host, so CUDA graphs capture it."""
    pairs = token.shape[0] if token is not None else x.shape[0]
    experts, width, depth = weight.shape
    n = width // 2 if gated else width
    assert x.stride(1) == 1 and weight.stride(2) == 1
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    block_n, block_k, stages, warps = config
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _expert_matmul_kernel[(min(pairs, experts), triton.cdiv(n, block_n))](
            x, x.stride(0), token if token is not None else counts, weight, weight.stride(0), weight.stride(1),
            counts, out, out.stride(0), n, experts,
            K=depth, GATED=gated, GATHER=token is not None, EXPERTS=triton.next_power_of_2(experts),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            FP32_DOT=interpreting(), PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=stages,
        )
    return out


def expert_gemms(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, token_of: torch.Tensor, counts: torch.Tensor,
) -> torch.Tensor:
    """Every pair's expert output [pairs, H] for pairs sorted by expert (`Experts._sort_by_expert`): SiLU(gate) * up,
    then down, as two kernels over the picked experts only."""
    tokens = x.shape[0]
    block_m = max(16, triton.next_power_of_2(tokens))  # an expert has at most one pair per token
    hidden = expert_matmul(x, gate_up, counts, token_of, True, block_m, launch_config(True, tokens))
    return expert_matmul(hidden, down, counts, None, False, block_m, launch_config(False, tokens))
