"""`benchmarks.e2e_serve` for a Qwen3-TTS layout: serve it, run the workloads, write `e2e_tts.{json,md}`, and
(`--tts-baseline`) the official package's generate() on the same GPU after the service."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.tts_e2e.report import markdown
from benchmarks.tts_e2e.workloads import FRAMES, REPO, TEXT, run_workloads, served_variants, workloads


def layout_family(layout: Path) -> str:
    """The model family of a layout's first application (its first model's, where it serves several)."""
    args = yaml.safe_load(layout.read_text())["applications"][0].get("args") or {}
    pipeline = (args.get("models") or [args])[0].get("pipeline") or {}
    return str((pipeline.get("model") or {}).get("family", "qwen3_omni"))


def with_absolute_configs(layout: Path, out: Path) -> Path:
    """The layout with its models' random-weight `config` paths made absolute (from the repository root), written
    beside the results: the stage replicas read them from their own working directories."""
    raw = yaml.safe_load(layout.read_text())
    args = raw["applications"][0]["args"]
    for spec in args.get("models") or [args]:
        model = spec["pipeline"]["model"]
        if model.get("config") and not Path(model["config"]).is_absolute():
            model["config"] = str(REPO / model["config"])
    used = out / f"layout_{layout.name}"
    used.write_text(yaml.safe_dump(raw, sort_keys=False))
    return used


def official_baseline(layout: Path, out: Path) -> list[dict[str, Any]]:
    """`benchmarks/hf_baseline.py --family qwen3_tts` for each of the layout's variants, in a fresh process whose
    PYTHONPATH starts with QWEN_TTS_PYTHONPATH (the official package and its transformers 4.57.3)."""
    env = dict(os.environ)
    if os.environ.get("QWEN_TTS_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["QWEN_TTS_PYTHONPATH"] + os.pathsep + env.get("PYTHONPATH", "")
    results = []
    for variant, (_, config) in served_variants(layout).items():
        target = out / f"official_{variant}.json"
        subprocess.run([sys.executable, "-m", "benchmarks.hf_baseline", "--family", "qwen3_tts", "--variant", variant,
                        "--size", str(config.get("tts_model_size", "1b7")), "--frames", str(FRAMES), "--text", TEXT,
                        "--out", str(target)], check=True, env=env)
        results.append(json.loads(target.read_text()))
    return results


def run_tts(args: argparse.Namespace, argv: list[str] | None, out: Path) -> int:
    """The Qwen3-TTS run of `benchmarks.e2e_serve`: exit 1 when a request failed or a workload got no reply."""
    import torch
    from ray import serve

    import ray
    from benchmarks.e2e_serve import URL, mps_running, scrape, start_service, with_overrides
    from omni_ray.bench import run_meta, write_results

    layout = with_overrides(Path(args.serve_config), args.set, out) if args.set else Path(args.serve_config)
    layout = with_absolute_configs(layout, out)
    variants = served_variants(layout)  # before serving: a layout it cannot read fails before the GPU time is spent
    rows: list[dict[str, Any]] = [start_service(str(layout))]
    try:
        rows += run_workloads(URL, workloads(variants, args.tts_workloads.split(",")),
                              [float(r) for r in args.tts_rates.split(",") if r],
                              [int(c) for c in (args.concurrency or "1,8,32,64").split(",")], args.rounds,
                              args.tts_level_seconds, out, args.request_timeout, args.warmup_timeout, scrape)
    finally:
        serve.shutdown()
        ray.shutdown()
    baseline = official_baseline(layout, out) if args.tts_baseline else None
    gpu = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
    meta = run_meta("benchmarks.e2e_serve", argv, serve_config=Path(args.serve_config).name, overrides=args.set,
                    mps=mps_running(), gpu=gpu, frames=FRAMES, text=TEXT)
    configs = {variant: config for variant, (_, config) in variants.items()}
    write_results(out, "e2e_tts", {"meta": meta, "rows": rows, "official": baseline},
                  markdown(meta, rows, configs, baseline))
    failed = sum(int(r.get("errors") or 0) for r in rows if r["phase"] == "measure")
    unwarmed = [r["workload"] for r in rows if r["phase"] == "warmup" and not r["ok"]]
    if failed or unwarmed:
        print(f"{failed} requests failed; no reply in the warm-up of {unwarmed}", file=sys.stderr)
    return 1 if failed or unwarmed else 0
