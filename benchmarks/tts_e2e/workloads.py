"""Qwen3-TTS over HTTP for `benchmarks.e2e_serve`: workload T (about 30 words, 75 frames, EOS ignored) in CustomVoice
and Base (a cached voice, a fresh reference), at Poisson arrival rates and closed-loop concurrencies."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp
import yaml

from load_tests.loadgen import LoadConfig, run_load
from load_tests.metrics import aggregate

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "tests" / "goldens" / "qwen3_tts" / "reference.wav"  # 2.6 s of eSpeak NG speech, 24 kHz
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
TEXT = ("The quiet harbour woke slowly as fishing boats returned with the tide, gulls circling above the nets while "
        "old sailors traded stories about storms, lost anchors and the long winter ahead.")  # 30 words
FRAMES = 75  # 6 s at 12.5 frames a second
FRAME_SECONDS = 0.08  # Qwen3-TTS's 12 Hz codec
CACHED_VOICE = "bench_voice"
SPEAKER = "vivian"
WORKLOADS = ("custom_voice", "base_cached", "base_fresh")


@dataclass
class Workload:
    """One kind of request against one served model: its name, the model id, the speech fields it sends (`voice`
    absent: none sent), the frames each reply runs to and the audio seconds a frame is."""

    name: str
    model: str
    variant: str
    fields: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    frames: int = FRAMES
    frame_seconds: float = FRAME_SECONDS


def served_variants(layout: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """The layout's Qwen3-TTS models: variant → (model id, its config.json as a dict, for the floors)."""
    from omni_ray.config import ModelSource
    from omni_ray.models.qwen3_tts.model_files import resolve_model

    args = yaml.safe_load(layout.read_text())["applications"][0]["args"]
    specs = args.get("models") or [{"model_name": args.get("model_name"), "pipeline": args["pipeline"]}]
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in specs:
        files = resolve_model(ModelSource.model_validate(spec["pipeline"]["model"]))
        raw = json.loads(Path(spec["pipeline"]["model"]["config"]).read_text()) if spec["pipeline"]["model"].get(
            "config") else json.loads((files.directory / "config.json").read_text())
        out[str(raw.get("tts_model_type"))] = (spec.get("model_name") or "qwen3-tts", raw)
    return out


def workloads(variants: dict[str, tuple[str, dict[str, Any]]], names: list[str]) -> list[Workload]:
    """The asked workloads the layout's variants can serve."""
    base = variants.get("base", ("", {}))[0]
    made = {
        "custom_voice": Workload("custom_voice", variants.get("custom_voice", ("", {}))[0], "custom_voice",
                                 {"voice": SPEAKER, "task_type": "CustomVoice", "language": "english"}),
        "base_cached": Workload("base_cached", base, "base", {"voice": CACHED_VOICE, "task_type": "Base",
                                                              "language": "english"}),
        "base_fresh": Workload("base_fresh", base, "base", {"task_type": "Base", "language": "english",
                                                            "ref_audio": str(REFERENCE), "ref_text": REFERENCE_TEXT}),
    }
    return [made[name] for name in names if made[name].model]


async def _upload_voice(url: str, model: str) -> int:
    """POST /v1/audio/voices: the reference and its transcript stored as CACHED_VOICE (an existing one deleted
    first); the reply's status."""
    async with aiohttp.ClientSession() as http:
        async with http.delete(f"{url}/v1/audio/voices/{CACHED_VOICE}", params={"model": model}):
            pass
        form = aiohttp.FormData()
        form.add_field("audio_sample", REFERENCE.read_bytes(), filename=REFERENCE.name, content_type="audio/wav")
        for name, value in (("name", CACHED_VOICE), ("ref_text", REFERENCE_TEXT), ("model", model)):
            form.add_field(name, value)
        async with http.post(f"{url}/v1/audio/voices", data=form, timeout=aiohttp.ClientTimeout(total=120)) as reply:
            await reply.read()
            return reply.status


def prepare(url: str, workload: Workload) -> Workload:
    """A cached-voice workload uploads its voice once; where the service has no voice upload, it sends the
    reference with every request instead, and says so."""
    if workload.name != "base_cached":
        return workload
    status = asyncio.run(_upload_voice(url, workload.model))
    if status == 200:
        return workload
    workload.fields = {"task_type": "Base", "language": "english", "ref_audio": str(REFERENCE),
                       "ref_text": REFERENCE_TEXT}
    workload.note = f"voice upload answered {status}: the reference went with every request (not cached)"
    return workload


def load_config(url: str, workload: Workload, text_file: Path, requests: int, timeout: float, out_dir: Path | None,
                concurrency: int = 1, rate: float | None = None, seed: int = 0) -> LoadConfig:
    fields = workload.fields
    return LoadConfig(url=url, scenario="speech", concurrency=concurrency, requests=requests, rate=rate,
                      prompt_file=str(text_file), model=workload.model, voice=fields.get("voice"),
                      task_type=fields.get("task_type"), language=fields.get("language"),
                      ref_audio=fields.get("ref_audio"), ref_text=fields.get("ref_text"),
                      max_new_tokens=workload.frames, ignore_eos=True, seed=seed, timeout=timeout, progress=False, plots=False,
                      out_dir=str(out_dir) if out_dir else None)


def measure(cfg: LoadConfig, frame_seconds: float = FRAME_SECONDS) -> dict[str, Any]:
    """One level's summary (`load_tests.metrics.aggregate`), where its requests went wrong, and the frame counts its
    replies' audio came to (`frame_seconds` a frame)."""
    _, records, wall = asyncio.run(run_load(cfg))
    summary = aggregate(records, wall)
    frames = sorted({round(r.audio_s / frame_seconds) for r in records if r.ok})
    return {"requests": summary["requests"], "ok": summary["ok"], "errors": summary["errors"],
            "error_samples": summary["error_samples"], "wall_s": wall, "stats": summary["stats"],
            "audio_s_total": summary["audio_s_total"], "audio_throughput": summary["audio_throughput"],
            "underruns": summary["underruns"], "finish_reasons": summary["finish_reasons"], "frames_seen": frames}


def run_workloads(url: str, chosen: list[Workload], rates: list[float], levels: list[int], rounds: int,
                  level_seconds: float, out: Path, timeout: float, warmup_timeout: float, scrape: Any,
                  prepare_workload: Callable[[str, Workload], Workload] = prepare) -> list[dict[str, Any]]:
    """Each workload: prepared (`prepare_workload`: a stored voice uploaded), warmed up (one request, then a round at
    the largest concurrency), then each Poisson rate (`rate × level_seconds` requests, at least 4) and each
    concurrency (`rounds` requests a stream). A warm-up that got no reply skips that workload's levels."""
    text_file = out / "workload_text.txt"
    text_file.write_text(TEXT + "\n")
    rows: list[dict[str, Any]] = []
    for workload in chosen:
        workload = prepare_workload(url, workload)
        per_frame = workload.frame_seconds
        base = {"workload": workload.name, "model": workload.model, "note": workload.note}
        warm = [measure(load_config(url, workload, text_file, c, warmup_timeout, None, concurrency=c), per_frame)
                for c in (1, max(levels))]
        rows.append({**base, "phase": "warmup", "ok": sum(w["ok"] for w in warm),
                     "error_samples": [e for w in warm for e in w["error_samples"]]})
        if not warm[0]["ok"]:
            continue
        plan = [("rate", rate) for rate in rates] + [("concurrency", c) for c in levels]
        for kind, value in plan:
            before = scrape()
            if kind == "rate":
                requests = max(4, math.ceil(value * level_seconds))
                cfg = load_config(url, workload, text_file, requests, timeout, out / f"{workload.name}_r{value:g}",
                                  rate=float(value))
            else:
                cfg = load_config(url, workload, text_file, int(value) * rounds, timeout,
                                  out / f"{workload.name}_c{value}", concurrency=int(value))
            row = {**base, "phase": "measure", kind: value, **measure(cfg, per_frame)}
            time.sleep(1.0)  # the ingress posts its replies' samples every 0.25 s
            row["server"] = server_view(before, scrape())
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("workload", "rate", "concurrency", "ok", "requests")}),
                  {k: row["stats"][k]["p95"] for k in ("ttfa_s", "rtf")}, flush=True)
    return rows


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The stages' step time, batch and launch gauges after a level, and the time-to and way-in histograms' means over
    it (ms)."""
    gauges = ("omni_stage_step_ms_p50", "omni_stage_step_ms_p90", "omni_stage_batch_mean", "omni_stage_launch_ms_p50",
              "omni_stage_outputs_ms_p50")
    view = {key: value for key, value in after.items() if key.split("{")[0] in gauges}
    for key, value in after.items():
        name, labels = key.split("{")[0], key[len(key.split("{")[0]):]
        if name.startswith(("omni_time_to_", "omni_request_path")) and name.endswith("_seconds_count"):
            stem = name.removesuffix("_count")
            count = value - before.get(key, 0.0)
            total = after.get(f"{stem}_sum{labels}", 0.0) - before.get(f"{stem}_sum{labels}", 0.0)
            if count:
                view[f"mean_{stem.removeprefix('omni_')}{labels}_ms"] = 1000 * total / count
    return view
