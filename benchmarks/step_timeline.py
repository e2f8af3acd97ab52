"""What each engine did while a burst of requests came in: the stage processes' step traces on one clock. Use it
to see why a burst's first audio came late: which stage's rounds the requests waited behind, and how the Thinker's
prefill waves went.

A served run with `OMNI_RAY_STEP_TRACE_DIR` set writes one `<name>-<pid>.jsonl` per engine loop and per vocoder
decode thread. An engine loop's line is a round: its step's launch, the previous step's collect and hand-on. A
vocoder line is a batched decode call. A burst starts at a Thinker round that prefills after a quiet spell (no
Thinker round with a batch for `--idle-ms`). Its first `--window-ms` print as one table, every stage's rounds in
order, after a summary of the prefill waves and the Talker's rounds. It reads files only (no GPU). `gpu_suite.sh`
runs it after an e2e step with `STEP_TRACE=1`.

    OMNI_RAY_STEP_TRACE_DIR=DIR/steps python -m benchmarks.e2e_serve --concurrency 32 --out DIR   # on the GPU machine
    python -m benchmarks.step_timeline DIR/steps [--window-ms 400] [--idle-ms 300] [--bursts N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Round:
    """One traced round of a stage: its start on the wall clock (epoch s) and its fields."""

    t: float
    stage: str
    fields: dict[str, Any]

    def get(self, key: str) -> float:
        return float(self.fields.get(key, 0))


def load_rounds(directory: Path) -> list[Round]:
    """Every traced round in `directory`, in start order; the stage is the file's name before its pid."""
    rounds = []
    for path in sorted(directory.glob("*.jsonl")):
        stage = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            if line.strip():
                fields = json.loads(line)
                rounds.append(Round(float(fields.pop("t")), stage, fields))
    return sorted(rounds, key=lambda r: r.t)


def burst_starts(rounds: list[Round], idle_s: float) -> list[float]:
    """The start of each Thinker round that prefills after `idle_s` with no Thinker round holding a batch."""
    starts, last_busy = [], None
    for r in rounds:
        if r.stage != "thinker" or r.get("batch") == 0:
            continue
        if r.get("prefilled") > 0 and (last_busy is None or r.t - last_busy >= idle_s):
            starts.append(r.t)
        last_busy = r.t + r.get("round_ms") / 1000
    return starts


def _waves(rounds: list[Round], stage: str, t0: float) -> str:
    waves = [f"{int(r.get('prefilled'))} at {1000 * (r.t - t0):.0f}" for r in rounds
             if r.stage == stage and r.get("prefilled") > 0]
    return ", ".join(waves) or "none"


def _round_ms(rounds: list[Round], stage: str) -> str:
    values = [r.get("round_ms") for r in rounds if r.stage.startswith(stage) and r.get("batch") > 0]
    if not values:
        return "none"
    return f"{len(values)} rounds, p50 {statistics.median(values):.1f}, max {max(values):.1f} ms"


def burst_table(rounds: list[Round], t0: float, window_s: float) -> list[str]:
    """A burst's summary and its rounds from just before `t0` to `window_s` after it, as markdown lines."""
    inside = [r for r in rounds if t0 - 0.02 <= r.t <= t0 + window_s]
    stages = sorted({r.stage for r in rounds})
    lines = [f"- Thinker prefill waves (requests at ms): {_waves(inside, 'thinker', t0)}",
             f"- Talker prefill waves (requests at ms): "
             + "; ".join(f"{s}: {_waves(inside, s, t0)}" for s in stages if s.startswith("talker")),
             f"- Thinker: {_round_ms(inside, 'thinker')}; Talker: {_round_ms(inside, 'talker')}",
             "", "| ms | stage | batch | prefilled | launch (its CPU) | collect | outputs | round (ms) "
             "| allocator retries |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in inside:
        if r.stage == "vocoder":
            lines.append(f"| {1000 * (r.t - t0):.1f} | vocoder | {int(r.get('calls'))} calls, {int(r.get('frames'))} "
                         f"frames | | | | | {r.get('round_ms'):.1f} |  |")
        else:
            lines.append(f"| {1000 * (r.t - t0):.1f} | {r.stage} | {int(r.get('batch'))} | "
                         f"{int(r.get('prefilled')) or ''} | {r.get('launch_ms'):.1f} ({r.get('launch_cpu_ms'):.1f}) | "
                         f"{r.get('collect_ms'):.1f} | "
                         f"{r.get('outputs_ms'):.1f} | {r.get('round_ms'):.1f} | {int(r.get('alloc_retries')) or ''} |")
    return lines


def timeline(directory: Path, window_s: float, idle_s: float, bursts: int | None) -> str:
    rounds = load_rounds(directory)
    starts = burst_starts(rounds, idle_s)
    lines = [f"# Step timeline: {directory}", "",
             f"{len(rounds)} rounds traced; {len(starts)} bursts (a Thinker prefill after {1000 * idle_s:.0f} ms "
             f"without a Thinker batch). Times in ms from the burst's first Thinker prefill round; a round is its "
             "step's launch (in brackets: the engine thread's own CPU time in it; the rest it waited, for the GIL or "
             "inside CUDA calls), then the previous step's collect (the wait for the device and the read-back) and the "
             "hand-on of its outputs; allocator retries: the CUDA allocations the round retried after freeing the "
             "allocator's cache, each a device sync inside the round (blank: none, or not recorded)."]
    for index, t0 in enumerate(starts[:bursts]):
        lines += ["", f"## Burst {index + 1} of {len(starts)}", ""] + burst_table(rounds, t0, window_s)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--window-ms", type=float, default=400.0)
    parser.add_argument("--idle-ms", type=float, default=300.0)
    parser.add_argument("--bursts", type=int, default=None, help="print the first N bursts (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here instead of printing it")
    args = parser.parse_args(argv)
    text = timeline(args.directory, args.window_ms / 1000, args.idle_ms / 1000, args.bursts)
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
