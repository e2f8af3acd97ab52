"""A decode step's picked-expert GEMMs and the weighted sum of their results (`small_batch_moe`'s kernels 6-8).

Each program takes one picked expert (the routing kernel's list of them) and one column block of its weights, and
finds its tokens among the picks itself: a decode batch's rows fit one tile per expert (an expert holds at most one
pair per token), so nothing sorts the pairs by expert and nothing gathers them back; a pair's result is stored at
its (token, pick) row. The combine sums each token's picks, weighted, and adds the residual: as a kernel of its own,
or inside the down projection's kernel, run by each column block's last program to finish.
"""

from __future__ import annotations

import torch

from omni_ray.layers import small_batch
from omni_ray.layers.moe_kernels import WIDE_CONFIG, ExpertMatmulConfig
from omni_ray.layers.small_batch import _on_device, interpreting

try:
    import triton
    import triton.language as tl

    from omni_ray.layers.moe_kernels import expert_tile
except ImportError:  # a CPU-only install: the layers run their own code
    triton = None

FEW_ROWS_GATE_UP_CONFIG: ExpertMatmulConfig = (32, 256, 3, 4)  # BLOCK_N, BLOCK_K, num_stages, num_warps
MANY_ROWS_GATE_UP_CONFIG: ExpertMatmulConfig = (64, 64, 4, 4)
COMBINE_BLOCK_N = 64


if triton is not None:

    @triton.jit
    def _picked_expert_kernel(
        x_ptr, x_stride, squares_ptr, squares_count, norm_ptr, eps, picks_ptr, hit_list_ptr, hits_ptr,
        w_ptr, w_expert_stride, w_row_stride, out_ptr, out_stride, M, N,
        pick_weights_ptr, res_ptr, res_stride, layer_out_ptr, layer_out_stride, squares_out_ptr, arrivals_ptr,
        K: tl.constexpr, WIDTH: tl.constexpr, PICKS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
        SQUARES_IN: tl.constexpr, PER_PICK: tl.constexpr, COMBINE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """For the program_id(0)-th picked expert e (hit_list) and its column block: the rows of the tokens that
        picked e, x[token] (or x[token * WIDTH + pick] with PER_PICK) RMS-normed with NORM (each row's sum of squares
        from SQUARES_IN partial sums [squares_count, M]) times w[e, cols].T, into out[token * WIDTH + pick]; GATED:
        w[e] holds gate rows then up rows (N each), and the result is SiLU(gate) * up. The hit count, the expert's
        id, the picks and the squares are asked for at once, so the weights' loads wait one round trip. COMBINE: the
        column block's last program to finish (counted in arrivals_ptr[program_id(1)], left at zero) also runs
        `_combine_block` over it: the layer's output columns, as the combine kernel would make them."""
        hits = tl.load(hits_ptr)
        expert = tl.load(hit_list_ptr + tl.program_id(0))  # the grid is no longer than the list: read before hits
        tokens = tl.arange(0, BLOCK_M)
        slots = tl.arange(0, PICKS)
        token_ok = tokens < M
        picks = tl.load(picks_ptr + tokens[:, None] * WIDTH + slots[None, :],
                        mask=token_ok[:, None] & (slots < WIDTH)[None, :], other=-1)
        squares = tl.zeros([1, BLOCK_M], dtype=tl.float32)
        if NORM:
            parts = tl.arange(0, SQUARES_IN)
            squares = tl.load(squares_ptr + parts[:, None] * M + tokens[None, :],
                              mask=(parts < squares_count)[:, None] & token_ok[None, :], other=0.0)
        if tl.program_id(0) < hits:
            match = picks == expert
            mine = tl.max(match.to(tl.int32), axis=1) > 0
            pair = tokens * WIDTH + tl.sum(tl.where(match, slots[None, :], 0), axis=1)
            rows = pair if PER_PICK else tokens
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = expert_tile(x_ptr, x_stride, rows, mine, w_ptr + expert * w_expert_stride, w_row_stride, cols,
                              cols < N, N, squares, eps, norm_ptr, K, NORM, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
                              FP32_DOT, PRECISION)
            tl.store(out_ptr + pair[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mine[:, None] & (cols < N)[None, :])
            if COMBINE:
                tl.debug_barrier()  # every thread's stores made before the release below
                if tl.atomic_add(arrivals_ptr + tl.program_id(1), 1) == hits - 1:  # acq_rel: the others' are visible
                    _combine_block(out_ptr, out_stride, pick_weights_ptr, res_ptr, res_stride, layer_out_ptr,
                                   layer_out_stride, squares_out_ptr, tokens, cols, tl.program_id(1), M, N, WIDTH,
                                   True)
                    tl.atomic_xchg(arrivals_ptr + tl.program_id(1), 0)  # zero again for the next launch

    @triton.jit
    def _combine_block(y_ptr, y_stride, weights_ptr, res_ptr, res_stride, out_ptr, out_stride, squares_out_ptr,
                       rows, cols, block, M, N, WIDTH: tl.constexpr, FROM_L2: tl.constexpr):
        """out[rows, cols] = residual + (each token's WIDTH pick results y[token * WIDTH + pick] weighted and summed
        in fp32, rounded), rounded; and the partial sums of the block's squares at row `block` of [column blocks, M].
        FROM_L2: y read past the L1 cache (written by other programs of the same launch), one pick at a time: inside
        the down projection's kernel, the picks' loads unrolled spilled about 60 registers (ptxas for sm_90a), one at
        a time none."""
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
        if FROM_L2:
            for pick in tl.range(0, WIDTH, loop_unroll_factor=1):
                pair = rows * WIDTH + pick
                weight = tl.load(weights_ptr + pair, mask=rows < M, other=0.0)
                y = tl.load(y_ptr + pair[:, None] * y_stride + cols[None, :], mask=ok, other=0.0,
                            cache_modifier=".cg")
                acc += y.to(tl.float32) * weight[:, None]
        else:
            for pick in tl.static_range(WIDTH):
                pair = rows * WIDTH + pick
                weight = tl.load(weights_ptr + pair, mask=rows < M, other=0.0)
                y = tl.load(y_ptr + pair[:, None] * y_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                acc += y * weight[:, None]
        dtype = out_ptr.dtype.element_ty
        residual = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        out = (residual + acc.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=ok)
        rounded = tl.where(ok, out.to(tl.float32), 0.0)
        tl.store(squares_out_ptr + block * M + rows, tl.sum(rounded * rounded, axis=1), mask=rows < M)

    @triton.jit
    def _combine_kernel(
        y_ptr, y_stride, weights_ptr, res_ptr, res_stride, out_ptr, out_stride, squares_out_ptr, M, N,
        WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """`_combine_block` over the program's block of rows and columns."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        _combine_block(y_ptr, y_stride, weights_ptr, res_ptr, res_stride, out_ptr, out_stride, squares_out_ptr, rows,
                       cols, tl.program_id(0), M, N, WIDTH, False)


def dot_precision(weight: torch.Tensor) -> str:
    """`tl.dot`'s input precision for tiles of `weight`'s dtype: "ieee" for fp32, which tensor cores would otherwise
    take as tf32."""
    return "ieee" if weight.dtype == torch.float32 else "tf32"


def picked_expert_config(gated: bool, tokens: int) -> ExpertMatmulConfig:
    """The expert GEMMs' launch config, the fastest measured on an H200 (`benchmarks/moe_layer_bench.py`) for the
    Thinker and the Talker alike: gate/up in 32 x 256 tiles at up to 8 rows (about 30% faster than 64 x 128 at one
    row) and in 64 x 64 tiles over 16 rows; down in 64 x 128, fastest or near it at every batch."""
    if gated and tokens <= 8:
        return FEW_ROWS_GATE_UP_CONFIG
    if gated and tokens > 16:
        return MANY_ROWS_GATE_UP_CONFIG
    return WIDE_CONFIG


def picked_expert_matmul(
    x: torch.Tensor, weight: torch.Tensor, picks: torch.Tensor, hit_list: torch.Tensor, hits: torch.Tensor,
    gated: bool, per_pick: bool, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
    squares: torch.Tensor | None = None, config: ExpertMatmulConfig | None = None,
) -> torch.Tensor:
    """Each picked expert's GEMM over its tokens' rows: x [M, K] (or [M * width, K] with `per_pick`: one row per
    pick) @ weight[e].T, weight [E, N, K] (or [E, 2N, K], `gated`: SiLU(gate) * up) → [M * width, N], row
    token * width + pick. `norm_weight` with `squares` [P, M]: each token's row RMS-normed first. One kernel; the
    grid covers as many experts as can be picked; `config`: BLOCK_N, BLOCK_K, stages, warps (default:
    `picked_expert_config`)."""
    out, _, _ = _picked_expert_launch(x, weight, picks, hit_list, hits, gated, per_pick, norm_weight, eps, squares,
                                      config)
    return out


def down_and_combine(
    hidden: torch.Tensor, down: torch.Tensor, picks: torch.Tensor, hit_list: torch.Tensor, hits: torch.Tensor,
    weights: torch.Tensor, residual: torch.Tensor, config: ExpertMatmulConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`picked_expert_matmul`'s down projection (one row of `hidden` per pick) and `combine` in one kernel: each
    column block's last program to finish combines that block. Returns what `combine` returns: the layer's output
    [M, N] and the partial sums of its rows' squares [column blocks, M], the same values."""
    _, out, squares = _picked_expert_launch(hidden, down, picks, hit_list, hits, False, True, None, 0.0, None, config,
                                            (weights, residual))
    assert out is not None and squares is not None
    return out, squares


def _picked_expert_launch(
    x: torch.Tensor, weight: torch.Tensor, picks: torch.Tensor, hit_list: torch.Tensor, hits: torch.Tensor,
    gated: bool, per_pick: bool, norm_weight: torch.Tensor | None, eps: float, squares: torch.Tensor | None,
    config: ExpertMatmulConfig | None, combine_with: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The expert kernel's launch; `combine_with` (the picks' weights, the residual): the combine inside it too.
    Returns the pairs' results and, when combined, the layer's output and its squares' partial sums."""
    tokens, width = picks.shape
    experts, out_width, depth = weight.shape
    n = out_width // 2 if gated else out_width
    assert x.stride(1) == 1 and weight.stride(2) == 1
    out = torch.empty(tokens * width, n, dtype=x.dtype, device=x.device)
    block_n, block_k, stages, warps = config or picked_expert_config(gated, tokens)
    grid = (min(tokens * width, experts), triton.cdiv(n, block_n))
    layer_out, squares_out, arrivals = out, out, out  # unused without the combine
    pick_weights, residual = combine_with if combine_with is not None else (out, out)
    if combine_with is not None:
        assert residual.shape == (tokens, n) and residual.stride(1) == 1 and grid[1] <= small_batch.ARRIVAL_COUNTERS
        layer_out = torch.empty_like(residual)
        squares_out = torch.empty(grid[1], tokens, dtype=torch.float32, device=x.device)
        arrivals = small_batch.arrival_counters(x.device)
    with _on_device(x):
        _picked_expert_kernel[grid](
            x, x.stride(0), squares if squares is not None else x, 0 if squares is None else squares.shape[0],
            norm_weight if norm_weight is not None else x, eps, picks, hit_list, hits,
            weight, weight.stride(0), weight.stride(1), out, out.stride(0), tokens, n,
            pick_weights, residual, residual.stride(0), layer_out, layer_out.stride(0), squares_out, arrivals,
            K=depth, WIDTH=width, PICKS=triton.next_power_of_2(width), GATED=gated, NORM=norm_weight is not None,
            SQUARES_IN=1 if squares is None else triton.next_power_of_2(squares.shape[0]), PER_PICK=per_pick,
            COMBINE=combine_with is not None, BLOCK_M=max(16, triton.next_power_of_2(tokens)), BLOCK_N=block_n,
            BLOCK_K=block_k, FP32_DOT=interpreting(), PRECISION=dot_precision(weight), num_warps=warps,
            num_stages=stages,
        )
    if combine_with is None:
        return out, None, None
    return out, layer_out, squares_out


def combine(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """residual [M, N] + each token's picks' results y [M * width, N] weighted by `weights` [M, width] → the layer's
    output [M, N] and the partial sums of its rows' squares [column blocks, M]. One kernel."""
    rows, n = residual.shape
    width = weights.shape[1]
    out = torch.empty_like(residual)
    block_m = min(small_batch.ROW_TILE, max(16, triton.next_power_of_2(rows)))
    grid = (triton.cdiv(n, COMBINE_BLOCK_N), triton.cdiv(rows, block_m))
    squares = torch.empty(grid[0], rows, dtype=torch.float32, device=residual.device)
    with _on_device(residual):
        _combine_kernel[grid](
            y, y.stride(0), weights, residual, residual.stride(0), out, out.stride(0), squares, rows, n,
            WIDTH=width, BLOCK_M=block_m, BLOCK_N=COMBINE_BLOCK_N, num_warps=4,
        )
    return out, squares
