"""Would one persistent kernel per code-predictor pass pay? A probe, not serving code: (1) what a grid barrier among
P resident programs costs on this GPU, and (2) the code predictor's four GEMMs of a layer (q/k/v, o, gate/up, down
at full size, plain products; attention and the epilogues left out) chained at 1 / 8 / 32 rows, as four kernels
replayed from one CUDA graph against one persistent kernel whose programs wait for each other between the GEMMs,
with and without loading the first depth block of their next weight tile before they wait, and with each GEMM's
work balanced over the programs (narrow GEMMs split in depth, `phase_plan`), and balanced with each program asking L2
for its weight lines ahead (all at the start, or the next GEMM's before each barrier). Weights cycle through
copies past L2's size, as a pass's five layers do. Also (3): whether a programmatic dependent launch starts before
the kernel ahead of it ends, eagerly and replayed from a graph. The persistent kernels need all their programs
resident at once (one per SM by default): on a GPU shared with other work they may wait long, and a step's time
limit ends them.

    python -m benchmarks.persistent_probe --out benchmarks/results
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.draw_bench import replay_ms
from omni_ray.bench import run_meta, write_results

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: nothing to probe
    triton = None

# (depth, width) of each GEMM of a code-predictor layer, each reading the previous one's output's first columns
CHAIN = ((1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024))
BLOCK_N, BLOCK_K = 32, 256


if triton is not None:

    @triton.jit
    def _wait_for_all(arrivals_ptr, target):
        """A grid barrier: this program arrives, then spins until `target` arrivals are counted (every program of
        the launch must be resident, or it never returns)."""
        tl.debug_barrier()  # the whole program's stores before the release
        seen = tl.atomic_add(arrivals_ptr, 1, sem="release") + 1
        while seen < target:
            seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire")
        tl.debug_barrier()

    @triton.jit
    def _gemm_phase(a_ptr, a_stride, w_ptr, out_ptr, out_stride, M, first_w, pid, PROGRAMS: tl.constexpr,
                    K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PREFETCHED: tl.constexpr):
        """out[:M, tiles] = a[:M, :K] @ w[tiles, :K].T for this program's column tiles (pid, pid + PROGRAMS, ...);
        PREFETCHED: `first_w` already holds its first tile's first depth block."""
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        for turn in range(0, (TILES + PROGRAMS - 1) // PROGRAMS):  # constant bounds: the interpreter needs them
            tile = pid + turn * PROGRAMS
            if tile < TILES:
                cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    a = tl.load(a_ptr + rows[:, None] * a_stride + (k0 + ks)[None, :], mask=(rows < M)[:, None],
                                other=0.0)
                    w = first_w
                    if PREFETCHED:
                        if (turn != 0) | (k0 != 0):
                            w = tl.load(w_ptr + cols[:, None] * K + (k0 + ks)[None, :])
                    else:
                        w = tl.load(w_ptr + cols[:, None] * K + (k0 + ks)[None, :])
                    acc = tl.dot(a, tl.trans(w), acc)
                tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=(rows < M)[:, None])

    @triton.jit
    def _first_block(w_ptr, pid, K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The first depth block of this program's first column tile of w [N, K] (zeros past N: no tile)."""
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        return tl.load(w_ptr + cols[:, None] * K + tl.arange(0, BLOCK_K)[None, :], mask=(cols < N)[:, None], other=0.0)

    @triton.jit
    def _chain_kernel(x_ptr, w0, w1, w2, w3, h0, h1, h2, out_ptr, arrivals_ptr, M,
                      K0: tl.constexpr, N0: tl.constexpr, K1: tl.constexpr, N1: tl.constexpr,
                      K2: tl.constexpr, N2: tl.constexpr, K3: tl.constexpr, N3: tl.constexpr,
                      PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH: tl.constexpr):
        """The four GEMMs one after the other, every program waiting for all between them; the last program to
        leave zeroes the two counters (arrivals_ptr[0]: the barriers', [1]: the leaving) for the next launch.
        PREFETCH: each program loads the first block of its next weight tile before it waits."""
        pid = tl.program_id(0)
        unused = tl.zeros([BLOCK_N, BLOCK_K], dtype=w0.dtype.element_ty)
        _gemm_phase(x_ptr, K0, w0, h0, N0, M, unused, pid, PROGRAMS, K0, N0, BLOCK_M, BLOCK_N, BLOCK_K, False)
        ahead = unused
        if PREFETCH:
            ahead = _first_block(w1, pid, K1, N1, BLOCK_N, BLOCK_K)
        _wait_for_all(arrivals_ptr, PROGRAMS)
        _gemm_phase(h0, N0, w1, h1, N1, M, ahead, pid, PROGRAMS, K1, N1, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH)
        ahead = unused
        if PREFETCH:
            ahead = _first_block(w2, pid, K2, N2, BLOCK_N, BLOCK_K)
        _wait_for_all(arrivals_ptr, 2 * PROGRAMS)
        _gemm_phase(h1, N1, w2, h2, N2, M, ahead, pid, PROGRAMS, K2, N2, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH)
        ahead = unused
        if PREFETCH:
            ahead = _first_block(w3, pid, K3, N3, BLOCK_N, BLOCK_K)
        _wait_for_all(arrivals_ptr, 3 * PROGRAMS)
        _gemm_phase(h2, N2, w3, out_ptr, N3, M, ahead, pid, PROGRAMS, K3, N3, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH)
        if tl.atomic_add(arrivals_ptr + 1, 1) == PROGRAMS - 1:  # everyone is past the last barrier
            tl.atomic_xchg(arrivals_ptr, 0)
            tl.atomic_xchg(arrivals_ptr + 1, 0)

    @triton.jit
    def _barriers_kernel(arrivals_ptr, ROUNDS: tl.constexpr, PROGRAMS: tl.constexpr):
        """ROUNDS grid barriers and nothing else (the counters zeroed by the last program to leave)."""
        for round in tl.static_range(ROUNDS):
            _wait_for_all(arrivals_ptr, (round + 1) * PROGRAMS)
        if tl.atomic_add(arrivals_ptr + 1, 1) == PROGRAMS - 1:
            tl.atomic_xchg(arrivals_ptr, 0)
            tl.atomic_xchg(arrivals_ptr + 1, 0)

    @triton.jit
    def _wait_for_all_bounded(arrivals_ptr, target, SPINS: tl.constexpr):
        """`_wait_for_all` that gives up after SPINS polls and then sets the flag at arrivals_ptr[2]: a launch whose
        programs were not all resident ends (with wrong sums, flagged) instead of hanging."""
        tl.debug_barrier()
        seen = tl.atomic_add(arrivals_ptr, 1, sem="release") + 1
        spins = tl.full([], 0, tl.int32)
        while (seen < target) & (spins < SPINS):
            seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire")
            spins += 1
        if seen < target:
            tl.atomic_xchg(arrivals_ptr + 2, 1)
        tl.debug_barrier()

    @triton.jit
    def _zero_share(ptr, pid, COUNT: tl.constexpr, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's share of zeroing ptr[:COUNT] (fp32)."""
        for turn in range(0, (COUNT + PROGRAMS * BLOCK - 1) // (PROGRAMS * BLOCK)):  # constant bounds, as above
            offsets = (pid + turn * PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
            tl.store(ptr + offsets, tl.zeros([BLOCK], dtype=tl.float32), mask=offsets < COUNT)

    @triton.jit
    def _split_gemm_phase(a_ptr, a_stride, w_ptr, out_ptr, M, pid, PROGRAMS: tl.constexpr, K: tl.constexpr,
                          N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT: tl.constexpr):
        """out[:M] (fp32, N wide) = a[:M, :K] @ w[:, :K].T, as TILES x SPLIT items (a column tile, a stretch of the
        depth) dealt round the programs; a split item adds its sums into out (zeroed before) atomically."""
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        ITEMS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N * SPLIT
        DEPTH: tl.constexpr = K // SPLIT
        for turn in range(0, (ITEMS + PROGRAMS - 1) // PROGRAMS):
            item = pid + turn * PROGRAMS
            if item < ITEMS:
                cols = (item // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)
                first = (item % SPLIT) * DEPTH
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, DEPTH, BLOCK_K):
                    depth = first + k0 + ks
                    a = tl.load(a_ptr + rows[:, None] * a_stride + depth[None, :], mask=(rows < M)[:, None],
                                other=0.0)
                    w = tl.load(w_ptr + cols[:, None] * K + depth[None, :])
                    acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
                targets = out_ptr + rows[:, None] * N + cols[None, :]
                if SPLIT == 1:
                    tl.store(targets, acc, mask=(rows < M)[:, None])
                else:
                    tl.atomic_add(targets, acc, mask=(rows < M)[:, None], sem="relaxed")

    @triton.jit
    def _prefetch_lines(ptrs):
        """Ask L2 for the 128-byte line at each of `ptrs`, kept there ahead of other lines; nothing waits for them."""
        return tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_share(w_ptr, pid, PROGRAMS: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        """Into L2: the weight lines of this program's items of one `_split_gemm_phase` (bf16, 64 to a line)."""
        ITEMS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N * SPLIT
        DEPTH: tl.constexpr = K // SPLIT
        LINES: tl.constexpr = DEPTH // 64
        for turn in range(0, (ITEMS + PROGRAMS - 1) // PROGRAMS):
            item = pid + turn * PROGRAMS
            if item < ITEMS:
                rows = w_ptr + ((item // SPLIT) * BLOCK_N + tl.arange(0, BLOCK_N)) * K + (item % SPLIT) * DEPTH
                for first in range(0, LINES, 16):  # past the last line: the last again
                    lines = tl.minimum(first + tl.arange(0, 16), LINES - 1) * 64
                    _prefetch_lines(rows[:, None] + lines[None, :])

    @triton.jit
    def _balanced_chain_kernel(x_ptr, w0, w1, w2, w3, h0, h1, h2, out_ptr, arrivals_ptr, M,
                               K0: tl.constexpr, N0: tl.constexpr, K1: tl.constexpr, N1: tl.constexpr,
                               K2: tl.constexpr, N2: tl.constexpr, K3: tl.constexpr, N3: tl.constexpr,
                               BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
                               S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, PROGRAMS: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPINS: tl.constexpr,
                               L2_AHEAD: tl.constexpr = 0):
        """`_chain_kernel` with each GEMM's work balanced over the programs (`phase_plan`): narrow GEMMs split their
        depth, their fp32 outputs zeroed first by every program's share, before the first barrier. L2_AHEAD 1: each
        program first asks L2 for all its weight lines of the four GEMMs; 2: for the next GEMM's before it waits."""
        pid = tl.program_id(0)
        if L2_AHEAD == 1:
            _prefetch_share(w0, pid, PROGRAMS, K0, N0, BN0, 1)
            _prefetch_share(w1, pid, PROGRAMS, K1, N1, BN1, S1)
            _prefetch_share(w2, pid, PROGRAMS, K2, N2, BN2, S2)
            _prefetch_share(w3, pid, PROGRAMS, K3, N3, BN3, S3)
        if S1 > 1:
            _zero_share(h1, pid, BLOCK_M * N1, PROGRAMS, 256)
        if S2 > 1:
            _zero_share(h2, pid, BLOCK_M * N2, PROGRAMS, 256)
        if S3 > 1:
            _zero_share(out_ptr, pid, BLOCK_M * N3, PROGRAMS, 256)
        _split_gemm_phase(x_ptr, K0, w0, h0, M, pid, PROGRAMS, K0, N0, BLOCK_M, BN0, BLOCK_K, 1)
        if L2_AHEAD == 2:
            _prefetch_share(w1, pid, PROGRAMS, K1, N1, BN1, S1)
        _wait_for_all_bounded(arrivals_ptr, PROGRAMS, SPINS)
        _split_gemm_phase(h0, N0, w1, h1, M, pid, PROGRAMS, K1, N1, BLOCK_M, BN1, BLOCK_K, S1)
        if L2_AHEAD == 2:
            _prefetch_share(w2, pid, PROGRAMS, K2, N2, BN2, S2)
        _wait_for_all_bounded(arrivals_ptr, 2 * PROGRAMS, SPINS)
        _split_gemm_phase(h1, N1, w2, h2, M, pid, PROGRAMS, K2, N2, BLOCK_M, BN2, BLOCK_K, S2)
        if L2_AHEAD == 2:
            _prefetch_share(w3, pid, PROGRAMS, K3, N3, BN3, S3)
        _wait_for_all_bounded(arrivals_ptr, 3 * PROGRAMS, SPINS)
        _split_gemm_phase(h2, N2, w3, out_ptr, M, pid, PROGRAMS, K3, N3, BLOCK_M, BN3, BLOCK_K, S3)
        if tl.atomic_add(arrivals_ptr + 1, 1) == PROGRAMS - 1:
            tl.atomic_xchg(arrivals_ptr, 0)
            tl.atomic_xchg(arrivals_ptr + 1, 0)

    @triton.jit
    def _global_ns():
        """The GPU's global nanosecond timer (the same clock on every SM)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _stamped_spin_kernel(times_ptr, spin_ns, WAIT: tl.constexpr):
        """Program 0 stamps when it started, when it was let through (WAIT: after `gdc_wait`, the end of the
        kernel before), and when it ended, after spinning `spin_ns`; it lets the next kernel start at once."""
        started = _global_ns()
        if WAIT:
            tl.extra.cuda.gdc_wait()
        through = _global_ns()
        tl.extra.cuda.gdc_launch_dependents()
        now = through
        while now - through < spin_ns:
            now = _global_ns()
        if tl.program_id(0) == 0:
            tl.store(times_ptr, started)
            tl.store(times_ptr + 1, through)
            tl.store(times_ptr + 2, now)


def pdl_overlap(spin_us: float = 20.0) -> dict[str, float]:
    """Does a programmatic dependent launch start before the kernel ahead of it ends, here (eagerly) and replayed from
    a CUDA graph? Two spinning kernels; the second launched with `launch_pdl`. Returns, per mode, us from the first
    kernel's end to the second's start (negative: it started early) and to its `gdc_wait` returning."""
    out = {}
    for mode in ("eager", "graph"):
        first, second = (torch.zeros(3, dtype=torch.int64, device="cuda") for _ in range(2))

        def pair() -> None:
            _stamped_spin_kernel[(4,)](first, int(spin_us * 1000), WAIT=False)
            _stamped_spin_kernel[(4,)](second, int(spin_us * 1000), WAIT=True, launch_pdl=True)

        pair()  # compiled outside any capture
        torch.cuda.synchronize()
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                pair()
            graph.replay()
        else:
            pair()
        torch.cuda.synchronize()
        out[f"{mode}: second started, us after the first ended"] = (second[0] - first[2]).item() / 1000
        out[f"{mode}: second let through, us after the first ended"] = (second[1] - first[2]).item() / 1000
    return out


def chain_persistent(x: torch.Tensor, weights: list[torch.Tensor], arrivals: torch.Tensor, programs: int,
                     prefetch: bool) -> torch.Tensor:
    """The four GEMMs of `CHAIN` in one persistent launch of `programs` programs (at most the resident ones)."""
    rows = x.shape[0]
    hidden = [torch.empty(rows, n, dtype=x.dtype, device=x.device) for _, n in CHAIN]
    dims = {f"{name}{i}": value for i, (k, n) in enumerate(CHAIN) for name, value in (("K", k), ("N", n))}
    _chain_kernel[(programs,)](x, *weights, *hidden[:3], hidden[3], arrivals, rows, **dims, PROGRAMS=programs,
                               BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                               PREFETCH=prefetch, num_warps=4, num_stages=2)
    return hidden[3]


def phase_plan(depth: int, width: int, programs: int, block_k: int, split: bool = True) -> tuple[int, int]:
    """(column tile width, depth splits) for one GEMM over `programs`: the fewest weight elements its busiest program
    reads, then the fewest items."""
    plans = []
    for block_n in (16, 32, 64):
        for parts in (1, 2, 3, 4, 6, 8, 12, 16) if split else (1,):
            if depth % (parts * block_k) == 0:
                items = -(-width // block_n) * parts
                plans.append(((-(-items // programs)) * block_n * depth // parts, items, block_n, parts))
    return min(plans)[2:]


def chain_balanced(x: torch.Tensor, weights: list[torch.Tensor], arrivals: torch.Tensor, programs: int,
                   block_k: int = 128, warps: int = 4, stages: int = 3,
                   plans: list[tuple[int, int]] | None = None, l2_ahead: int = 0) -> torch.Tensor:
    """The four GEMMs of `CHAIN` in one persistent launch, each GEMM's items balanced over `programs` (fp32 out).
    arrivals: three int32, the barrier counters and the flag a launch sets when its programs were not all resident.
    plans: each GEMM's (column tile, depth splits) instead of `phase_plan`'s (the first one's splits must be 1).
    l2_ahead: `_balanced_chain_kernel`'s L2_AHEAD (GPU only: the interpreter runs no inline assembly)."""
    rows = x.shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    plans = plans or [phase_plan(k, n, programs, block_k, split=i > 0) for i, (k, n) in enumerate(CHAIN)]
    assert plans[0][1] == 1, "the first GEMM's output is not zeroed: it cannot split its depth"
    hidden = [torch.empty(block_m, n, dtype=torch.float32, device=x.device) for _, n in CHAIN]
    dims = {f"{name}{i}": value for i, (k, n) in enumerate(CHAIN) for name, value in (("K", k), ("N", n))}
    tiles = {f"BN{i}": block_n for i, (block_n, _) in enumerate(plans)}
    splits = {f"S{i}": parts for i, (_, parts) in enumerate(plans) if i > 0}
    _balanced_chain_kernel[(programs,)](x, *weights, *hidden, arrivals, rows, **dims, **tiles, **splits,
                                        PROGRAMS=programs, BLOCK_M=block_m, BLOCK_K=block_k, SPINS=1 << 16,
                                        L2_AHEAD=l2_ahead, num_warps=warps, num_stages=stages)
    return hidden[3][:rows]


def chain_reference(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """The same chain in torch: each GEMM reads the previous output's first `depth` columns."""
    h = x
    for (k, _), w in zip(CHAIN, weights):
        h = h[:, :k] @ w.T
    return h


def probe(rows_list: list[int], programs: int) -> dict[str, Any]:
    """Barrier cost and the chain at each row count (us), on the current CUDA device."""
    arrivals = torch.zeros(3, dtype=torch.int32, device="cuda")
    barrier_us = {}
    for rounds in (1, 16):
        def barriers(rounds: int = rounds) -> torch.Tensor:
            _barriers_kernel[(programs,)](arrivals, ROUNDS=rounds, PROGRAMS=programs)
            return arrivals
        barrier_us[rounds] = 1000 * replay_ms(barriers)[0]
    per_barrier = (barrier_us[16] - barrier_us[1]) / 15
    layer_bytes = sum(2 * k * n for k, n in CHAIN)
    copies = max(2, (256 * 2**20) // layer_bytes)
    weight_sets = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03 for k, n in CHAIN]
                   for _ in range(copies)]
    out = []
    for rows in rows_list:
        x = torch.randn(rows, CHAIN[0][0], device="cuda", dtype=torch.bfloat16)
        expected = chain_reference(x.float(), [w.float() for w in weight_sets[0]])
        row: dict[str, Any] = {"rows": rows}
        runs = {
            "four kernels (cuBLAS)": lambda ws: chain_reference(x, ws),
            "persistent": lambda ws: chain_persistent(x, ws, arrivals, programs, False),
            "persistent, next block loaded before waiting": lambda ws: chain_persistent(x, ws, arrivals, programs, True),
            "balanced": lambda ws: chain_balanced(x, ws, arrivals, programs),
            "balanced, 2 programs per SM": lambda ws: chain_balanced(x, ws, arrivals, 2 * programs),
            "balanced, 2 per SM, depth blocks of 256": lambda ws: chain_balanced(x, ws, arrivals, 2 * programs, 256, 4, 2),
            "balanced, all weights asked of L2 first": lambda ws: chain_balanced(x, ws, arrivals, programs, l2_ahead=1),
            "balanced, 2 per SM, all asked of L2 first": lambda ws: chain_balanced(x, ws, arrivals, 2 * programs,
                                                                                     l2_ahead=1),
            "balanced, next GEMM's asked of L2 before waiting": lambda ws: chain_balanced(x, ws, arrivals, programs,
                                                                                           l2_ahead=2),
            "balanced, 2 per SM, next asked of L2 before waiting": lambda ws: chain_balanced(
                x, ws, arrivals, 2 * programs, l2_ahead=2),
        }
        for name, run in runs.items():
            arrivals[2] = 0
            got = run(weight_sets[0]).float()
            if arrivals[2].item():  # a barrier gave up: not all programs were resident; not timed
                row[name] = float("nan")
                continue
            ms, _ = replay_ms(lambda run=run: [run(ws) for ws in weight_sets][-1], 50)
            row[name] = 1000 * ms / copies
            if name != "four kernels (cuBLAS)":
                row[f"{name}: relative error"] = ((got - expected).norm() / expected.norm()).item()
        out.append(row)
    plans = {count: [phase_plan(k, n, count, 128, split=i > 0) for i, (k, n) in enumerate(CHAIN)]
             for count in (programs, 2 * programs)}
    return {"programs": programs, "barrier_us": per_barrier, "balanced_plans": plans,
            "launch_with_one_barrier_us": barrier_us[1], "chain": out, "layer_bytes": layer_bytes, "weight_copies": copies, "pdl_overlap": pdl_overlap()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--programs", type=int, default=0, help="resident programs (default: the GPU's SM count)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    programs = args.programs or torch.cuda.get_device_properties(0).multi_processor_count
    result = probe([int(r) for r in args.rows.split(",")], programs)
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.persistent_probe", argv, gpu=gpu)
    names = [name for name in result["chain"][0] if name != "rows" and "error" not in name]
    floor_us = result["layer_bytes"] / 4.3e12 * 1e6
    lines = [f"# A persistent kernel's grid barrier, and a code-predictor layer's four GEMMs chained: {gpu}, "
             f"{meta['date']}, commit {meta['commit']}", f"# command: {meta['command']}", "",
             f"{programs} programs: a grid barrier costs {result['barrier_us']:.2f} us; a launch of one barrier "
             f"{result['launch_with_one_barrier_us']:.2f} us (replayed from a graph).", "",
             "A programmatic dependent launch after a kernel that spins 20 us and lets it start at once (negative: "
             "before that kernel ended): " + "; ".join(f"{k} {v:.1f}" for k, v in result["pdl_overlap"].items()),
             "",
             f"The chain reads {result['layer_bytes'] / 2**20:.1f} MiB of weights ({floor_us:.1f} us at 4.3 TB/s), "
             f"from {result['weight_copies']} copies cycled past L2. Balanced (column tile, depth splits) per GEMM: "
             + "; ".join(f"{count} programs {plan}" for count, plan in result["balanced_plans"].items())
             + ". us per chain (nan: a barrier gave up, the programs were not all resident):", "",
             "| rows | " + " | ".join(names) + " | persistent kernels' relative error |",
             "|---|" + "---|" * (len(names) + 1)]
    for row in result["chain"]:
        errors = ", ".join(f"{row[key]:.1e}" for key in row if "error" in key)
        lines.append(f"| {row['rows']} | " + " | ".join(f"{row[n]:.1f}" for n in names) + f" | {errors} |")
    write_results(args.out, "persistent_probe", {"meta": meta, **result}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
