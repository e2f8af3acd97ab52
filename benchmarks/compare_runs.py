"""Several `benchmarks/e2e_serve.py` runs side by side at one concurrency: TTFA, RTF, the steps' tails and the
Talker's pace past the text, a column per run, the numbers an A/B reads first. Use it after running the same
layout with and without a change (ideally on one machine, in both orders). It reads results files only (no GPU).
`gpu_suite.sh` prints it at the end when a call ran two or more e2e steps.

    python -m benchmarks.compare_runs a1=DIR/e2e1_a1/e2e.json b1=DIR/e2e1_b1/e2e.json [--concurrency 32]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.e2e_serve import talker_pace_past_text

COLUMNS = (
    "run", "requests ok", "TTFA p50 (p90) ms", "RTF p50", "Talker step p50 / mean / p90 (ms)",
    "frames past the text, ms each", "Thinker step p50 (mean) (ms)", "vocoder busy, tail (ms)", "last chunk (ms)",
)


def level_row(result: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    """The run's measured level at `concurrency` (an `e2e.json`'s "measure" row, not its warm-up), or None."""
    for row in result["rows"]:
        if row["phase"] == "measure" and row["concurrency"] == concurrency:
            return row
    return None


def _ms(value: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def compare_line(label: str, row: dict[str, Any] | None) -> str:
    """One markdown row: the level's client times (p50 over its requests) and the server's step and reply means."""
    if row is None:
        return f"| {label} | " + " | ".join("–" for _ in COLUMNS[1:]) + " |"
    stats, server = row["stats"], row.get("server", {})
    ttfa, rtf = stats["ttfa_s"], stats["rtf"]
    last_frame, last_audio = server.get("mean_last_frame_ms"), server.get("mean_last_audio_ms")
    tail = None if last_frame is None or last_audio is None else last_audio - last_frame
    busy = server.get("vocoder_busy_s_per_s")
    cells = [
        label,
        f"{row['ok']}/{row['requests']}",
        f"{1000 * ttfa['p50']:.0f} ({1000 * ttfa['p90']:.0f})" if ttfa.get("p50") is not None else "–",
        _ms(rtf.get("p50"), "{:.3f}"),
        " / ".join(_ms(server.get(f"talker_step_ms_{key}")) for key in ("p50", "mean", "p90")),
        _ms(talker_pace_past_text(server, row.get("talker_frames_past_text")), "{:.2f}"),
        f"{_ms(server.get('thinker_step_ms_p50'))} ({_ms(server.get('thinker_step_ms_mean'))})",
        f"{_ms(None if busy is None else 100 * busy, '{:.0f}')}%, {_ms(tail, '{:.0f}')}",
        _ms(None if stats["latency_s"].get("mean") is None else 1000 * stats["latency_s"]["mean"], "{:.0f}"),
    ]
    return "| " + " | ".join(cells) + " |"


def compare_table(runs: list[tuple[str, dict[str, Any]]], concurrency: int) -> str:
    """The runs (label, parsed `e2e.json`) at one concurrency as a markdown table, in the order given."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [compare_line(label, level_row(result, concurrency)) for label, result in runs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", metavar="LABEL=E2E_JSON", help="e.g. a1=gpu_out/results/e2e1_a1/e2e.json")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            parser.error(f"{spec!r}: expected LABEL=PATH")
        runs.append((label, json.loads(Path(path).read_text())))
    print(compare_table(runs, args.concurrency))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
