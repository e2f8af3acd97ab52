"""Fish Audio S2 Pro over HTTP for `benchmarks.e2e_serve`: workload S (workload T's 30 words, 130 frames, EOS ignored)
in the model's own voice and in a stored reference voice, at closed-loop concurrencies (and Poisson rates if asked),
on workload T's machinery (`benchmarks/tts_e2e/workloads.py`); `e2e_s2_pro.{json,md}`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.tts_e2e.workloads import REFERENCE, REFERENCE_TEXT, TEXT, Workload, run_workloads

S2_FRAMES = 130  # 6.0 s at 21.5 frames a second (2048 samples a frame at 44.1 kHz)
S2_FRAME_SECONDS = 2048 / 44100
STORED_VOICE = "bench_voice"
S2_WORKLOADS = ("plain", "stored_reference")


def served_model(layout: Path) -> tuple[str, Any, float]:
    """The layout's S2 Pro model: (its model id, its files (`S2ProModelFiles`), the seconds making them took). Full-size
    random weights are written here, before the service starts (on the GPU when there is one), so the stage replicas
    find them complete and the service's startup is its own."""
    import torch

    from omni_ray.config import ModelSource
    from omni_ray.models.s2_pro.model_files import resolve_model

    args = yaml.safe_load(layout.read_text())["applications"][0]["args"]
    spec = (args.get("models") or [args])[0]
    started = time.time()
    files = resolve_model(ModelSource.model_validate(spec["pipeline"]["model"]))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the writer's blocks, before the stages take the GPU
    return str(spec.get("model_name") or "s2-pro"), files, time.time() - started


def s2_workloads(model: str, names: list[str]) -> list[Workload]:
    """The asked workloads: plain (no voice: the model's own) and stored_reference (`voice` names a reference
    stored once, `prepare_s2`)."""
    made = {"plain": Workload("plain", model, "s2_pro", {}, frames=S2_FRAMES, frame_seconds=S2_FRAME_SECONDS),
            "stored_reference": Workload("stored_reference", model, "s2_pro", {"voice": STORED_VOICE},
                                         frames=S2_FRAMES, frame_seconds=S2_FRAME_SECONDS)}
    unknown = [name for name in names if name not in made]
    if unknown:
        raise ValueError(f"unknown S2 Pro workloads {unknown}; expected some of {S2_WORKLOADS}")
    return [made[name] for name in names]


async def _add_reference(url: str, model: str) -> int:
    """fish-speech's POST /v1/references/add: the reference and its transcript stored as STORED_VOICE (an existing
    one deleted first); the reply's status."""
    async with aiohttp.ClientSession() as http:
        async with http.delete(f"{url}/v1/references/delete", json={"reference_id": STORED_VOICE, "model": model}):
            pass
        form = aiohttp.FormData()
        form.add_field("audio", REFERENCE.read_bytes(), filename=REFERENCE.name, content_type="audio/wav")
        for name, value in (("id", STORED_VOICE), ("text", REFERENCE_TEXT), ("model", model)):
            form.add_field(name, value)
        async with http.post(f"{url}/v1/references/add", data=form, timeout=aiohttp.ClientTimeout(total=120)) as reply:
            await reply.read()
            return reply.status


def prepare_s2(url: str, workload: Workload) -> Workload:
    """The stored-reference workload stores its voice once (/v1/references/add); where that fails, it sends the
    reference with every request instead, and says so."""
    if workload.name != "stored_reference":
        return workload
    status = asyncio.run(_add_reference(url, workload.model))
    if status == 200:
        return workload
    workload.fields = {"ref_audio": str(REFERENCE), "ref_text": REFERENCE_TEXT}
    workload.note = f"/v1/references/add answered {status}: the reference went with every request (not stored)"
    return workload


def run_s2_pro(args: argparse.Namespace, argv: list[str] | None, out: Path) -> int:
    """The S2 Pro run of `benchmarks.e2e_serve`: exit 1 when a request failed or a workload got no reply."""
    import ray
    import torch
    from ray import serve

    from benchmarks.e2e_serve import URL, mps_running, scrape, start_service, with_overrides
    from benchmarks.tts_e2e.s2_pro_report import markdown
    from benchmarks.tts_e2e.run import with_absolute_configs
    from omni_ray.bench import run_meta, write_results

    layout = with_overrides(Path(args.serve_config), args.set, out) if args.set else Path(args.serve_config)
    layout = with_absolute_configs(layout, out)
    model, files, made_s = served_model(layout)
    rows: list[dict[str, Any]] = [{"phase": "checkpoint", "seconds": made_s, "directory": str(files.directory)},
                                  start_service(str(layout))]
    try:
        rows += run_workloads(URL, s2_workloads(model, args.s2_workloads.split(",")),
                              [float(r) for r in args.s2_rates.split(",") if r],
                              [int(c) for c in (args.concurrency or "1,8,32").split(",")], args.rounds,
                              args.tts_level_seconds, out, args.request_timeout, args.warmup_timeout, scrape,
                              prepare_workload=prepare_s2)
    finally:
        serve.shutdown()
        ray.shutdown()
    gpu = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
    meta = run_meta("benchmarks.e2e_serve", argv, serve_config=Path(args.serve_config).name, overrides=args.set,
                    mps=mps_running(), gpu=gpu, frames=S2_FRAMES, text=TEXT)
    write_results(out, "e2e_s2_pro", {"meta": meta, "rows": rows},
                  markdown(meta, rows, files.directory))
    failed = sum(int(r.get("errors") or 0) for r in rows if r["phase"] == "measure")
    unwarmed = [r["workload"] for r in rows if r["phase"] == "warmup" and not r["ok"]]
    if failed or unwarmed:
        print(f"{failed} requests failed; no reply in the warm-up of {unwarmed}", file=sys.stderr)
    return 1 if failed or unwarmed else 0
