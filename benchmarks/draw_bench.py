"""A Talker frame's 16 draws (group 0 over 3,072 logits with its penalty and banned ids, then 15 code-predictor draws
over 2,048) replayed from one CUDA graph: eager aten ops, inductor's fused `sample`, and the Triton `top_k_draw`
kernel (as served, and with other num_warps), at 1, 8 and 32 rows; plus how many draws the kernel and eager `sample`
agree on."""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from omni_ray.bench import run_meta, write_results
from omni_ray.engine.sampler import CounterNoise, SamplingBatch, fused_sample, sample
from omni_ray.engine.top_k_draw import KernelDraw, top_k_draw
from omni_ray.models.qwen3_omni.orchestrator import DEFAULT_TALKER_SAMPLING
from omni_ray.models.qwen3_omni.talker import MTP_SAMPLING

GROUP0_VOCAB, MTP_VOCAB, MTP_DRAWS, CAP = 3072, 2048, 15, 64
WARPS = (1, 2, 8, 16)  # the kernel's other launches (its default: `top_k_draw.draw_warps`)


def frame_draws(draw: Callable[..., torch.Tensor], rows: int, device: str) -> Callable[[], torch.Tensor]:
    """A function making one frame's 16 draws with `draw` on fixed random inputs."""
    generator = torch.Generator(device=device).manual_seed(rows)
    group0_logits = (4 * torch.randn(rows, GROUP0_VOCAB, device=device, generator=generator)).to(torch.bfloat16)
    mtp_logits = (4 * torch.randn(MTP_DRAWS, rows, MTP_VOCAB, device=device, generator=generator)).to(torch.bfloat16)
    seen = torch.rand(rows, GROUP0_VOCAB, device=device, generator=generator) < 0.05
    banned = torch.zeros(rows, GROUP0_VOCAB, dtype=torch.bool, device=device)
    banned[:, GROUP0_VOCAB - 1024:] = True
    group0 = SamplingBatch.of([DEFAULT_TALKER_SAMPLING] * rows, device)
    mtp = SamplingBatch.of([MTP_SAMPLING] * rows, device)
    keys = torch.randint(0, 1 << 32, (rows, 2), device=device, generator=generator)

    def run() -> torch.Tensor:
        codes = [draw(group0_logits, group0, CounterNoise(keys), seen, banned, True, CAP)]
        for k in range(MTP_DRAWS):
            codes.append(draw(mtp_logits[k], mtp, CounterNoise(keys, (k + 1) * MTP_VOCAB), None, None, True, CAP))
        return torch.stack(codes, dim=1)

    return run


def replay_ms(run: Callable[[], torch.Tensor], replays: int = 200) -> tuple[float, torch.Tensor]:
    """The mean time of one replay of `run` captured as a CUDA graph, and its output."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, autotune and allocate outside the capture
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, out.clone()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    device = "cuda"
    draws: dict[str, Callable[..., torch.Tensor]] = {
        "eager aten ops": sample, "inductor (fused_sample)": fused_sample, "Triton top_k_draw": KernelDraw(fused_sample)}
    for warps in WARPS:
        draws[f"Triton, {warps} warps"] = lambda logits, params, noise, seen, banned, _, cap, warps=warps: top_k_draw(
            logits, params, noise, cap, seen, banned, warps)
    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        row: dict[str, float | int] = {"rows": rows}
        outputs = {}
        for name, draw in draws.items():
            row[name], outputs[name] = replay_ms(frame_draws(draw, rows, device))
        eager, kernel = outputs["eager aten ops"], outputs["Triton top_k_draw"]
        row["draws"], row["kernel equals eager"] = eager.numel(), int((eager == kernel).sum())
        row["other warps equal the kernel"] = all(torch.equal(outputs[f"Triton, {w} warps"], kernel) for w in WARPS)
        rows_out.append(row)
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.draw_bench", argv, gpu=gpu)
    names = list(draws)
    lines = [f"# A Talker frame's 16 draws from one CUDA graph, ms per frame: {gpu}, {meta['date']}, commit {meta['commit']}",
             f"# command: {meta['command']}", "",
             "| rows | " + " | ".join(names) + " | kernel's draws equal to eager's | other warps' draws equal |",
             "|---|" + "---|" * (len(names) + 2)]
    for row in rows_out:
        times = " | ".join(f"{row[name]:.3f}" for name in names)
        lines.append(f"| {row['rows']} | {times} | {row['kernel equals eager']} of {row['draws']} | "
                     f"{'yes' if row['other warps equal the kernel'] else 'no'} |")
    write_results(args.out, "frame_draws", {"meta": meta, "rows": rows_out}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
