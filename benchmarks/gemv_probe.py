"""Would another form pay for the code predictor's GEMMs at few rows? A probe, not serving code. `rows_matmul` puts
every product through tensor-core tiles of at least 16 rows and 16 columns (Ampere's mma, rows as the tiles' M): at
one row 15 of 16 rows are padding, the narrow deep projections (o, down) need a split-depth hand-off to spread over
the GPU, and under Nsight Compute each warp ran a chain of 550-1,800 dependent instructions (session 25). Two other
forms, plain products only (no norm, no epilogue), each against `rows_matmul`'s default launch, one call per copy of
the weight in a graph (copies past L2's size, as a pass's layers read theirs):

- GEMV (1-8 rows): each program multiplies BLOCK_N weight rows by the step's few input rows with plain FMAs and one
  sum per row (no shared memory, no tensor cores), so a block can be as narrow as 4 columns with no depth split.
- Swapped (any rows up to 32): out.T = w @ x.T, the weight's columns as the tiles' M (64 or 128) and the rows,
  padded to 16 or 32, as N: Triton then issues Hopper's warpgroup MMA (wgmma), whose operands stream from shared
  memory with no register staging. The narrow ones split their depth over SPLIT_K programs that add into a zeroed
  fp32 output with atomics (the zeroing is counted, the rounding to bf16 is not).

    python -m benchmarks.gemv_probe --rows 1,8,32 --out benchmarks/results
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.draw_bench import replay_ms
from benchmarks.moe_layer_bench import table
from benchmarks.small_batch_bench import WEIGHT_BYTES_IN_FLIGHT
from omni_ray.bench import run_meta, write_results
from omni_ray.layers import small_batch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: nothing to probe
    triton = None

# (output width, depth) of the code predictor's GEMMs at full size
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "code head": (2048, 1024)}
LAUNCHES = [(4, 256, 2), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (4, 1024, 4)]  # BLOCK_N, BLOCK_K, warps
MAX_ROWS = 8
# the swapped form's launches: BLOCK_N, BLOCK_K, num_stages, SPLIT_K (4 warps: one warpgroup)
SWAPPED_LAUNCHES = [(64, 128, 3, 1), (64, 256, 3, 1), (64, 128, 4, 1), (128, 128, 3, 1), (64, 128, 3, 2),
                    (64, 128, 3, 4), (128, 128, 3, 4), (64, 64, 4, 4)]
SWAPPED_MAX_ROWS = 32


if triton is not None:

    @triton.jit
    def _gemv_kernel(x_ptr, x_stride, w_ptr, w_stride, out_ptr, out_stride, M, N,
                     K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[:M, cols] = x[:M] @ w[cols].T for this program's BLOCK_N columns: each depth block's weight tile
        times every row (ROWS: a power of two >= M) as FMAs, summed along the depth in fp32."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        rows = tl.arange(0, ROWS)
        row_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            w = tl.load(w_ptr + cols[:, None] * w_stride + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _swapped_kernel(x_ptr, x_stride, w_ptr, w_stride, out_ptr, out_stride, M, N,
                        K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, FP32_DOT: tl.constexpr):
        """out[:M, cols] (+)= (w[cols] @ x[:M].T).T over this program's stretch of the depth (program_id(1) of
        SPLIT_K): the weight's BLOCK_N columns as the MMA's M, the rows (ROWS: a power of two >= 16 and >= M) as its
        N. SPLIT_K > 1: added into a zeroed fp32 out with atomics. (FP32_DOT: fp32 tiles, for the interpreter.)"""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        rows = tl.arange(0, ROWS)
        row_ok = rows < M
        ks = tl.arange(0, BLOCK_K)
        STRETCH: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
        k_start = tl.program_id(1) * STRETCH
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
        for k0 in range(0, STRETCH, BLOCK_K):
            kk = k_start + k0 + ks
            k_ok = (kk < K) & (k0 + ks < STRETCH)
            w = tl.load(w_ptr + cols[:, None] * w_stride + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x_t = tl.load(x_ptr + rows[None, :] * x_stride + kk[:, None], mask=k_ok[:, None] & row_ok[None, :],
                          other=0.0)
            if FP32_DOT:
                w, x_t = w.to(tl.float32), x_t.to(tl.float32)
            acc = tl.dot(w, x_t, acc)
        at = out_ptr + rows[None, :] * out_stride + cols[:, None]
        mask = col_ok[:, None] & row_ok[None, :]
        if SPLIT_K == 1:
            tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(at, acc, mask=mask, sem="relaxed")


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    """x [M, K] @ weight.T, weight [N, K], M <= MAX_ROWS, in x's dtype: one program per `block_n` columns."""
    rows, depth = x.shape
    n = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == depth and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    with small_batch._on_device(x):
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x, x.stride(0), weight, weight.stride(0), out, out.stride(0), rows, n,
            K=depth, ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        )
    return out


def swapped(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, stages: int,
            split: int) -> torch.Tensor:
    """x [M, K] @ weight.T, weight [N, K], M <= SWAPPED_MAX_ROWS, computed as (weight @ x.T).T: x's dtype, or fp32
    with `split` > 1 (added into zeros)."""
    rows, depth = x.shape
    n = weight.shape[0]
    assert rows <= SWAPPED_MAX_ROWS and weight.shape[1] == depth and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.zeros(rows, n, dtype=torch.float32, device=x.device)
    with small_batch._on_device(x):
        _swapped_kernel[(triton.cdiv(n, block_n), split)](
            x, x.stride(0), weight, weight.stride(0), out, out.stride(0), rows, n,
            K=depth, ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
            FP32_DOT=small_batch.interpreting(), num_warps=4, num_stages=stages,
        )
    return out


def timed_launch(row: dict[str, Any], launch: str, run: Any, weights: list[torch.Tensor], x: torch.Tensor,
                 expected: torch.Tensor) -> None:
    """row[launch] = µs per call of run(x, w) over the weight's copies, once its product matches `expected` (None,
    and why printed, when it fails or cannot launch)."""
    try:
        error = (run(x, weights[0]).float() - expected).abs().max().item()
        assert error <= 1e-2 * expected.abs().max().item(), error
        row[launch] = 1000 * replay_ms(lambda: [run(x, w) for w in weights][-1], 50)[0] / len(weights)
    except Exception as exc:  # e.g. more registers or shared memory than a launch can hold
        row[launch] = None
        print(f"{row['gemm']} rows={row['rows']} {launch}: {type(exc).__name__}: {exc}")


def shape_rows(name: str, n: int, k: int, rows: list[int]) -> list[dict[str, Any]]:
    """One GEMM shape at each row count: `rows_matmul`'s default launch, each GEMV launch (up to MAX_ROWS rows) and
    each swapped launch, µs per call, and the weight's bytes at 4.3 TB/s."""
    copies = max(2, WEIGHT_BYTES_IN_FLIGHT // (2 * n * k))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = []
    for count in rows:
        x = torch.randn(count, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ weights[0].float().T
        tiles_us = 1000 * replay_ms(lambda: [small_batch.rows_matmul(x, w) for w in weights][-1], 50)[0] / copies
        row: dict[str, Any] = {"gemm": name, "rows": count, "floor": 2 * n * k / 4.3e12 * 1e6, "rows_matmul": tiles_us}
        for block_n, block_k, warps in LAUNCHES if count <= MAX_ROWS else []:
            timed_launch(row, f"GEMV {block_n} x {block_k}, {warps} warps",
                         lambda x_, w_: gemv(x_, w_, block_n, block_k, warps), weights, x, expected)
        for block_n, block_k, stages, split in SWAPPED_LAUNCHES:
            if split > 2 and n > 2048:  # the wide ones have programs enough
                continue
            timed_launch(row, f"swapped {block_n} x {block_k}, {stages} stages, split {split}",
                         lambda x_, w_: swapped(x_, w_, block_n, block_k, stages, split), weights, x, expected)
        out.append(row)
    return out


def best(row: dict[str, Any], form: str) -> str | None:
    """The fastest launch of `form` (GEMV | swapped) in `row`, as "µs (launch)"."""
    timed = {key: value for key, value in row.items() if key.startswith(form) and value is not None}
    if not timed:
        return None
    launch = min(timed, key=timed.__getitem__)
    return f"{timed[launch]:.1f} ({launch.removeprefix(form).strip()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.gemv_probe", argv, gpu=gpu)
    found: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():  # results written after each shape: a run cut off keeps what it measured
        found += shape_rows(name, n, k, rows)
        summary = [{"gemm": row["gemm"], "rows": row["rows"], "floor": row["floor"], "rows_matmul": row["rows_matmul"],
                    "best GEMV": best(row, "GEMV"), "best swapped": best(row, "swapped")} for row in found]
        lines = [f"# The code predictor's GEMMs in other forms: {gpu}, {meta['date']}, commit {meta['commit']}",
                 f"# command: {meta['command']}"]
        lines += table("Each form's fastest launch against `rows_matmul`'s default, µs per call from a CUDA graph "
                       "(floor: the weight's bytes at 4.3 TB/s)", summary)
        lines += table("Every launch: GEMV [BLOCK_N x BLOCK_K, warps]; swapped [BLOCK_N x BLOCK_K, stages, SPLIT_K]",
                       found)
        write_results(args.out, "gemv_probe", {"meta": meta, "rows": found}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
