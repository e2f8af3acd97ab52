"""Would a GEMV form pay for the code predictor's GEMMs at few rows? A probe, not serving code. `rows_matmul` puts
every product through tensor-core tiles of at least 16 rows and 16 columns: at one row 15 of 16 rows are padding, the
narrow deep projections (o, down) need a split-depth hand-off to spread over the GPU, and under Nsight Compute each
warp ran a chain of 550-1,800 dependent instructions (session 25). Here each program multiplies BLOCK_N weight rows
by the step's few input rows with plain FMAs and one sum per row (no shared memory, no tensor cores), so a block can
be as narrow as 4 columns with no depth split. Plain products only (no norm, no epilogue), each form against
`rows_matmul`'s default launch, one call per copy of the weight in a graph (copies past L2's size, as a pass's layers
read theirs).

    python -m benchmarks.gemv_probe --out benchmarks/results
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
LAUNCHES = [(4, 256, 2), (4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8),
            (4, 1024, 4)]  # BLOCK_N, BLOCK_K, num_warps
MAX_ROWS = 8


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


def shape_rows(name: str, n: int, k: int, rows: list[int]) -> list[dict[str, Any]]:
    """One GEMM shape at each row count: `rows_matmul`'s default launch and each GEMV launch, µs per call, and the
    weight's bytes at 4.3 TB/s."""
    copies = max(2, WEIGHT_BYTES_IN_FLIGHT // (2 * n * k))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    out = []
    for count in rows:
        x = torch.randn(count, k, device="cuda", dtype=torch.bfloat16)
        expected = x.float() @ weights[0].float().T
        tiles_us = 1000 * replay_ms(lambda: [small_batch.rows_matmul(x, w) for w in weights][-1], 50)[0] / copies
        row: dict[str, Any] = {"gemm": name, "rows": count, "floor": 2 * n * k / 4.3e12 * 1e6, "rows_matmul": tiles_us}
        for block_n, block_k, warps in LAUNCHES:
            launch = f"{block_n} x {block_k}, {warps} warps"
            try:
                error = (gemv(x, weights[0], block_n, block_k, warps).float() - expected).abs().max().item()
                assert error <= 1e-2 * expected.abs().max().item(), error
                row[launch] = 1000 * replay_ms(lambda: [gemv(x, w, block_n, block_k, warps) for w in weights][-1],
                                               50)[0] / copies
            except Exception as exc:  # e.g. more registers than a launch can hold
                row[launch] = None
                print(f"{name} rows={count} {launch}: {type(exc).__name__}: {exc}")
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    found = [row for name, (n, k) in SHAPES.items() for row in shape_rows(name, n, k, rows)]
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.gemv_probe", argv, gpu=gpu)
    lines = [f"# The code predictor's GEMMs as plain products at few rows: {gpu}, {meta['date']}, commit "
             f"{meta['commit']}", f"# command: {meta['command']}"]
    lines += table("`rows_matmul` (tensor-core tiles) against a GEMV form per launch [BLOCK_N x BLOCK_K, warps], µs "
                   "per call from a CUDA graph (floor: the weight's bytes at 4.3 TB/s)", found)
    write_results(args.out, "gemv_probe", {"meta": meta, "rows": found}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
