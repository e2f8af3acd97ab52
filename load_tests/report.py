"""Load-test output: the stdout table, summary.json, requests.jsonl and matplotlib (Agg) plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from load_tests.metrics import PERCENTILES, STAT_FIELDS, RequestRecord

STAT_LABELS: dict[str, tuple[str, bool]] = {  # field -> (label, is a time in seconds shown as ms)
    "ttft_s": ("TTFT (ms)", True),
    "ttfa_s": ("TTFA (ms)", True),
    "latency_s": ("latency (ms)", True),
    "rtf": ("RTF", False),
    "streaming_rtf": ("streaming RTF", False),
}


def _fmt(value: float | int | None, as_ms: bool) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f}" if as_ms else f"{value:.3f}"


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable report printed to stdout."""
    cols = [f"p{p}" for p in PERCENTILES] + ["mean", "max", "n"]
    rows = [["metric", *cols]]
    for name in STAT_FIELDS:
        label, as_ms = STAT_LABELS[name]
        st = summary["stats"][name]
        rows.append([label, *(_fmt(st[c], as_ms) for c in cols[:-1]), str(st["count"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(r))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    und = summary["underruns"]
    rate = "" if und.get("rate") is None else f" ({und['rate']:.1%} of streams)"
    cfg = summary.get("config", {})
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors_by_status"].items()) or "none"
    finish = ", ".join(f"{k}: {v}" for k, v in summary["finish_reasons"].items()) or "-"
    lines += [
        "",
        f"scenario {cfg.get('scenario', '?')}  model {summary.get('model', '?')}  "
        + (f"Poisson arrivals {cfg['rate']:g} req/s" if cfg.get("rate") else f"concurrency {cfg.get('concurrency', '?')}"),
        f"requests        {summary['ok']}/{summary['requests']} ok, {summary['errors']} errors ({errors})",
        f"finish reasons  {finish}",
        f"wall time       {summary['wall_s']:.2f} s",
        f"requests/s      {summary['requests_per_s']:.3f}",
        f"audio           {summary['audio_s_total']:.2f} s received, "
        f"throughput {summary['audio_throughput']:.3f} audio-s per s",
        f"tokens          {summary['completion_tokens_total']} completion, "
        f"{summary['completion_tokens_per_s']:.1f} tok/s",
        f"underruns       {und['events']} events in {und['requests_affected']} requests{rate}, "
        f"{und['stall_s_total']:.3f} s stalled",
    ]
    return "\n".join(lines)


def write_results(out_dir: Path, summary: dict[str, Any], records: Sequence[RequestRecord]) -> list[Path]:
    """Write summary.json and requests.jsonl (records sorted by index); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    jsonl_path = out_dir / "requests.jsonl"
    with jsonl_path.open("w", encoding="utf-8") as f:
        for rec in sorted(records, key=lambda r: r.index):
            f.write(json.dumps(rec.to_json()) + "\n")
    return [summary_path, jsonl_path]


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def write_plots(out_dir: Path, records: Sequence[RequestRecord], title: str = "") -> list[Path]:
    """latency_cdf.png, ttfa_over_time.png and rtf_hist.png, drawn with the Agg canvas (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    paths: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / name
        FigureCanvasAgg(fig).print_png(str(path))
        paths.append(path)

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    drawn = False
    for name, label in (("ttft_s", "TTFT"), ("ttfa_s", "TTFA"), ("latency_s", "total latency")):
        vals = [getattr(r, name) * 1000 for r in ok if getattr(r, name) is not None]
        if vals:
            xs, ys = _cdf(vals)
            ax.step(xs, ys, where="post", label=f"{label} (n={len(vals)})")
            drawn = True
    if drawn:
        ax.legend(loc="lower right")
    else:
        _no_data(ax)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of successful requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("latency CDFs")
    save(fig, "latency_cdf.png")

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    pts = [(r.start_s, r.ttfa_s * 1000) for r in ok if r.ttfa_s is not None]
    errs = [r.start_s for r in records if not r.ok]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label="TTFA")
    if errs:
        ax.scatter(errs, [0.0] * len(errs), marker="x", color="red", s=24, label="error (start time)")
    if pts or errs:
        ax.legend(loc="upper left")
    else:
        _no_data(ax)
    ax.set_xlabel("request start (s since run start)")
    ax.set_ylabel("TTFA (ms)")
    ax.grid(alpha=0.3)
    ax.set_title("time to first audio over the run")
    save(fig, "ttfa_over_time.png")

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    series = [(label, [getattr(r, name) for r in ok if getattr(r, name) is not None])
              for name, label in (("rtf", "RTF (latency / audio s)"), ("streaming_rtf", "streaming RTF"))]
    every = [v for _, vals in series for v in vals]
    if every:
        lo, hi = min(every + [1.0]), max(every + [1.0])  # shared bins, always spanning real time (1.0)
        hi = max(hi, lo + 1e-3)
        n_bins = min(40, max(10, len(every) // 2))
        edges = [lo + (hi - lo) * i / n_bins for i in range(n_bins + 1)]
        for label, vals in series:
            if vals:
                ax.hist(vals, bins=edges, alpha=0.6, label=label)
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="real time")
        ax.legend()
    else:
        _no_data(ax)
    ax.set_xlabel("real-time factor (< 1 is faster than real time)")
    ax.set_ylabel("requests")
    ax.set_title("RTF distribution")
    save(fig, "rtf_hist.png")
    return paths
