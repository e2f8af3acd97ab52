"""End-to-end service benchmark: full-size random-weight Qwen3-Omni served by Ray Serve, driven through HTTP by
`load_tests` with the speech workload (a 100-token prompt, 128 text tokens, 400 Talker frames) at several
concurrencies: client TTFA/TTFT/RTF, per-stage timings from `/metrics`, RTF floors, and (`--baseline`) transformers'
generate() in the same run. A layout of `family: qwen3_tts` runs Qwen3-TTS's workload T instead (CustomVoice, Base
with a cached voice and with a fresh reference; Poisson rates and closed-loop levels; `benchmarks/tts_e2e/`), and one of
`family: s2_pro` Fish Audio S2 Pro's workload S (the model's own voice and a stored reference; closed-loop levels;
`benchmarks/tts_e2e/s2_pro.py`). Use it for any change meant to show end to end (a layout, `--set` a stage setting, the
relay, the engines); `benchmarks/compare_runs.py` sets runs side by side.

    python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_2gpu.yaml --baseline --out DIR  # 2 H200s
    nvidia-cuda-mps-control -d; python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_1gpu.yaml \
        --out DIR  # one H200 under MPS (one H100: docs/gpu.md has the overrides)
    python -m benchmarks.e2e_serve --serve-config benchmarks/serve_tts_1.7b_random_1gpu.yaml --out DIR  # Qwen3-TTS
    python -m benchmarks.e2e_serve --serve-config benchmarks/serve_s2_pro_random_1gpu.yaml --out DIR  # S2 Pro

`OMNI_RAY_STEP_TRACE_DIR=DIR` also traces every engine step, for `benchmarks/step_timeline.py`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from benchmarks.expert_reads import LATEST as EXPERT_READS, measured_shares
from load_tests.client import load_prompts
from load_tests.loadgen import LoadConfig, run_load
from omni_ray.bench import run_meta, write_results
from omni_ray.config import PipelineConfig
from omni_ray.floors import rtf_floor
from omni_ray.models.qwen3_omni.model_files import resolve_model
from omni_ray.serve.metrics import FIRST_AUDIO_WAY, REPLY_END, TIME_TO
from load_tests.metrics import aggregate

HERE = Path(__file__).resolve().parent
PROMPT_FILE = HERE / "prompt_100_tokens.txt"
DISTINCT_PROMPTS_FILE = HERE / "prompts_100_tokens_distinct.txt"
PORT_ENV = "OMNI_RAY_E2E_PORT"  # `--port`, for this module's copy that `benchmarks.tts_e2e` imports under `-m`
URL = f"http://127.0.0.1:{os.environ.get(PORT_ENV, '8000')}"
# time-to-X histograms (seconds) and stage gauges read from /metrics
HISTOGRAMS = {**{key: f"omni_time_to_{name}_seconds" for key, (name, _) in TIME_TO.items()},
              "request_path": "omni_request_path_seconds"}
GAUGES = ("omni_stage_step_ms_p50", "omni_stage_step_ms_mean", "omni_stage_step_ms_p90", "omni_stage_batch_mean",
          "omni_stage_launch_ms_p50", "omni_stage_launch_cpu_ms_p50", "omni_stage_outputs_ms_p50",
          "omni_stage_outputs_cpu_ms_p50", "omni_stage_launch_ms_mean", "omni_stage_collect_ms_mean",
          "omni_stage_outputs_ms_mean")
GC_COUNTERS = ("omni_stage_gc_pause_s", "omni_stage_gc_full_collections")  # cumulative, per stage process
GC_STAGES = ("thinker", "talker", "vocoder")
ALLOC_RETRIES = "omni_stage_cuda_alloc_retries"  # cumulative, per stage process on a GPU
COUNTERS = ("omni_stage_decode_busy_s", "omni_stage_decode_frames", "omni_stage_decode_calls",
            "omni_stage_decode_windows")  # cumulative: per level as a rate
PREFILL_COUNTERS = ("omni_stage_prefill_batches", "omni_stage_prefilled_sequences")  # cumulative, per engine stage


def scrape() -> dict[str, float]:
    """Histogram sums/counts and stage gauges from GET /metrics."""
    text = urllib.request.urlopen(f"{URL}/metrics", timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values


def startup_phases(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each stage replica's startup phases from /metrics (`omni_stage_startup_<phase>_s`): stage → phase → seconds,
    the slowest replica's where a stage has several; and as "graph_pool_kept", the most blocks a replica's graph pools
    hold that no graph's outputs do (`omni_stage_graph_pool_kept_blocks`)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        match = re.match(r'omni_stage_(?:startup_(\w+?)_s|(graph_pool_kept)_blocks)\{.*stage="(\w+)"', key)
        if match:
            phase = match.group(1) or match.group(2)
            phases = out.setdefault(match.group(3), {})
            phases[phase] = max(value, phases.get(phase, 0.0))
    return out


def startup_text(row: dict[str, Any]) -> str:
    """"service ready N s after `serve.run` (thinker: process 9, load 20, warm-up 80 (compiling 50) s; ...)"."""
    def phases_text(phases: dict[str, float]) -> str:
        compiling = f" (compiling {phases['compile']:.0f})" if "compile" in phases else ""
        kept = (f", {phases['graph_pool_kept']:.0f} blocks kept in its graphs' pool"
                if "graph_pool_kept" in phases else "")
        return ", ".join(f"{phase.replace('warmup', 'warm-up')} {seconds:.0f}" + (compiling if phase == "warmup" else "")
                         for phase, seconds in phases.items() if phase not in ("compile", "graph_pool_kept")) + " s" + kept

    stages = "; ".join(f"{stage}: {phases_text(phases)}" for stage, phases in row.get("stages", {}).items())
    return f"service ready {row['seconds']:.0f} s after `serve.run`" + (f" ({stages})" if stages else "")


def histogram_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Each of HISTOGRAMS' mean (ms) over what it observed between two scrapes (None: nothing)."""
    means: dict[str, float | None] = {}
    for key, name in HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
        total = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
        means[key] = 1000 * total / count if count else None
    return means


def _growth(before: dict[str, float], after: dict[str, float], counter: str, stage: str | None = None) -> float:
    """How much a cumulative stage counter grew between two scrapes, summed over its replicas (of `stage` alone)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k.startswith(counter + "{") and (stage is None or f'stage="{stage}"' in k))


def breakdown(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, Any]:
    """Mean submit→first token / first Talker frame / first audio (server side) over the level, each stage's
    median step time and mean batch at the end of the level, the vocoder's busy fraction, frame rate and streams'
    chunks per decode call over the level's `seconds` (summed over its replicas), each stage's garbage-collector
    pauses and CUDA allocator retries over the level, and the Thinker's and the Talker's prefill batches in the level
    with the requests each held on average."""
    out: dict[str, Any] = {f"mean_{key}_ms": mean for key, mean in histogram_means(before, after).items()}
    for gauge in GAUGES:
        for key, value in after.items():
            if key.startswith(gauge + "{"):
                stage = re.search(r'stage="(\w+)"', key)
                out[f"{stage.group(1) if stage else '?'}_{gauge.removeprefix('omni_stage_')}"] = value
    for counter in COUNTERS:
        grown = _growth(before, after, counter)
        out[f"vocoder_{counter.removeprefix('omni_stage_decode_')}_per_s"] = grown / seconds if seconds > 0 else None
    calls, windows = out["vocoder_calls_per_s"], out["vocoder_windows_per_s"]
    out["vocoder_windows_per_call"] = windows / calls if calls else None
    for stage in GC_STAGES:  # the garbage collector's pauses in each stage's processes over the level
        pause_s, full = (_growth(before, after, counter, stage) for counter in GC_COUNTERS)
        out[f"{stage}_gc_pause_ms_per_s"] = 1000 * pause_s / seconds if seconds > 0 else None
        out[f"{stage}_gc_full_collections"] = full
        on_gpu = any(k.startswith(ALLOC_RETRIES + "{") and f'stage="{stage}"' in k for k in after)
        out[f"{stage}_cuda_alloc_retries"] = _growth(before, after, ALLOC_RETRIES, stage) if on_gpu else None
    for stage in ("thinker", "talker"):  # how the level's requests were taken in: prefill batches, requests in each
        batches, sequences = (_growth(before, after, counter, stage) for counter in PREFILL_COUNTERS)
        out[f"{stage}_prefill_batches"] = batches
        out[f"{stage}_prefill_sequences_per_batch"] = sequences / batches if batches else None
    return out


def serve_process_label(title: str) -> str | None:
    """Which part of the service a Ray process is, from its process title (`ray::ServeReplica:APP:DEPLOYMENT`, then
    `.METHOD` while it runs one): `proxy`, a deployment's name (its replicas), or None (the controller, idle workers,
    anything else)."""
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    if title.startswith("ray::ServeReplica:") and title.count(":") >= 4:
        return title.split(":", 4)[4].split(".")[0] or None
    return None


def process_cpu_seconds(pid: int | str) -> float:
    """User + system CPU time a process has used so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by this process (the load generator) and by each part of the service on this node,
    summed over its processes: over a level, their growth per second says which one, if any, runs out of CPU."""
    used = {"load generator": process_cpu_seconds(os.getpid())}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            label = serve_process_label((entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"))
            if label is not None:
                used[label] = used.get(label, 0.0) + process_cpu_seconds(entry.name)
        except OSError:  # the process ended meanwhile
            continue
    return used


def mps_running() -> bool:
    """Is an MPS control daemon up (the stage processes then share each GPU's time instead of taking turns)?"""
    return subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-control"], capture_output=True).returncode == 0


def wait_ready(timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{URL}/ready", timeout=5).status == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError("the service did not become ready")


def load(concurrency: int, requests: int, max_tokens: int, out_dir: Path | None,
         prompt_file: Path = DISTINCT_PROMPTS_FILE, timeout: float = 600.0) -> tuple[dict[str, Any], float]:
    cfg = LoadConfig(url=URL, scenario="chat", concurrency=concurrency, requests=requests, max_tokens=max_tokens,
                     prompt_file=str(prompt_file), ignore_eos=True, progress=False, plots=False, timeout=timeout,
                     out_dir=str(out_dir) if out_dir else None)
    _, records, wall = asyncio.run(run_load(cfg))
    return aggregate(records, wall), wall


def with_overrides(layout: Path, settings: list[str], out: Path) -> Path:
    """The layout with `a.b.c=value` settings applied to its first application's args (a number picks a list's
    item: `models.1.pipeline...`), or with `deployments.NAME.key=value` to that deployment's options (values read as
    YAML), written next to the results. A YAML alias's copies are set one by one."""
    raw = json.loads(json.dumps(yaml.safe_load(layout.read_text())))  # each alias its own copy
    app = raw["applications"][0]
    for setting in settings:
        key, _, value = setting.partition("=")
        node = app.setdefault("args", {})
        if key.startswith("deployments."):
            _, name, key = key.split(".", 2)
            deployments = app.setdefault("deployments", [])
            node = next((d for d in deployments if d.get("name") == name), None)
            if node is None:
                node = {"name": name}
                deployments.append(node)
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[int(name)] if isinstance(node, list) else node.setdefault(name, {})
        node[leaf] = yaml.safe_load(value)
    used = out / f"layout_{layout.name}"
    used.write_text(yaml.safe_dump(raw, sort_keys=False))
    return used


def start_service(serve_config: str) -> dict[str, Any]:
    """Ray, then the layout's first application on Serve at URL; its startup row once it is ready."""
    import ray
    from ray import serve

    from omni_ray.serve.app import app_from_serve_config, start_serve

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    app, spec = app_from_serve_config(serve_config)
    start_serve(spec, {"host": "127.0.0.1", "port": int(URL.rsplit(":", 1)[1])})
    started = time.time()
    serve.run(app, name=spec["name"], route_prefix=spec["route_prefix"], blocking=False)
    wait_ready(900)
    return {"phase": "startup", "seconds": time.time() - started, "stages": startup_phases(scrape())}


def serve_and_measure(
    serve_config: str, levels: list[int], rounds: int, max_tokens: int, out: Path, prompt_file: Path = DISTINCT_PROMPTS_FILE,
    request_timeout: float = 60.0, warmup_timeout: float = 120.0,
) -> list[dict[str, Any]]:
    """Serve the layout, then `warm_and_measure` it. A run that stopped leaves Serve up: a hung replica may never
    finish its step, and the process's exit takes the Ray cluster it started down."""
    import ray
    from ray import serve

    rows = [start_service(serve_config)]
    rows += warm_and_measure(levels, rounds, max_tokens, out, prompt_file, request_timeout, warmup_timeout)
    if rows[-1]["phase"] != "stopped":
        # graphs captured lazily while serving (new batch or length buckets) are checked too
        kept = {stage: phases["graph_pool_kept"] for stage, phases in startup_phases(scrape()).items()
                if "graph_pool_kept" in phases}
        rows.append({"phase": "end", "graph_pool_kept": kept})
        serve.shutdown()
        ray.shutdown()
    return rows


def warm_and_measure(
    levels: list[int], rounds: int, max_tokens: int, out: Path, prompt_file: Path, request_timeout: float,
    warmup_timeout: float,
) -> list[dict[str, Any]]:
    """The running service's warm-up (one request alone, then the largest level once: the CUDA graphs those batches
    use) and each level's measurement. A warm-up or level that got no reply at all within its timeout (a hung
    service) ends the run there with a "stopped" row, so that what was measured is still written."""
    rows: list[dict[str, Any]] = []
    for concurrency in (1, max(levels)):
        summary, wall = load(concurrency, concurrency, max_tokens, None, prompt_file, warmup_timeout)
        rows.append({"phase": "warmup", "concurrency": concurrency, "requests": summary["requests"], "ok": summary["ok"],
                     "errors": summary["errors"], "error_samples": summary["error_samples"], "wall_s": wall})
        if not summary["ok"]:
            return stop(rows, f"the warm-up at c={concurrency} got no reply")
    time.sleep(1.0)  # the warm-up's samples are posted before the first level's baseline is scraped
    for concurrency in levels:
        before, cpu_before = scrape(), service_cpu_seconds()
        summary, wall = load(concurrency, concurrency * rounds, max_tokens, out / f"c{concurrency}", prompt_file,
                             request_timeout)
        cpu = {name: (used - cpu_before.get(name, 0.0)) / wall for name, used in service_cpu_seconds().items()}
        time.sleep(1.0)  # every ingress replica has posted its last replies' samples (each posts every 0.25 s)
        rows.append({"phase": "measure", "concurrency": concurrency, "requests": summary["requests"], "ok": summary["ok"],
                     "errors": summary["errors"], "errors_by_status": summary["errors_by_status"],
                     "error_samples": summary["error_samples"], "wall_s": wall,
                     "audio_s_total": summary["audio_s_total"],
                     "stats": summary["stats"], "finish_reasons": summary["finish_reasons"],
                     "server": breakdown(before, scrape(), wall), "cpu_cores": cpu})
        print(json.dumps(rows[-1]["server"]), {k: rows[-1]["stats"][k]["p50"] for k in ("ttfa_s", "rtf")}, flush=True)
        if not summary["ok"]:
            return stop(rows, f"c={concurrency} got no reply")
    return rows


def stop(rows: list[dict[str, Any]], reason: str) -> list[dict[str, Any]]:
    """End a run whose service answered nothing: the rows so far and why."""
    print(f"stopped: {reason}", file=sys.stderr, flush=True)
    return rows + [{"phase": "stopped", "reason": reason}]


def level_rtf_floors(
    layout: Path, levels: list[int], text_tokens: int, shares: dict[int, dict[str, float]] | None = None,
) -> dict[int, float | None]:
    """Each level's RTF floor: its streams' replies (`text_tokens` tokens, the layout's frame cap) with the Thinker and
    the Talker stepping at their bandwidth floors (`omni_ray.floors.rtf_floor`), their rows routed independently, or
    with `shares`: reading the experts `benchmarks/expert_reads.py` measured at that batch (None where it measured
    none). Computed before serving, so that a layout it cannot read fails before the GPU time is spent."""
    pipeline = PipelineConfig.from_yaml(layout)
    config = resolve_model(pipeline.model).config
    frames = pipeline.stages.talker.engine.max_frames
    if shares is None:
        return {level: rtf_floor(config, level, text_tokens, frames) for level in levels}
    return {level: rtf_floor(config, level, text_tokens, frames, expert_shares=shares[level]) if level in shares
            else None for level in levels}


def frames_past_text(layout: Path, text_tokens: int) -> int | None:
    """How many of a reply's frames the Talker makes after it has read the reply's last token, when every reply has
    `text_tokens` tokens and the layout's frame cap (EOS ignored): the frames that only the Talker's own steps pace.
    None without a cap."""
    frames = PipelineConfig.from_yaml(layout).stages.talker.engine.max_frames
    return None if frames is None else max(0, frames - text_tokens)


def talker_pace_past_text(server: dict[str, Any], frames: int | None) -> float | None:
    """The Talker's ms per frame past the reply's text: from its first step past the text to its last frame (the
    server's means), over those frames. Against its step time it shows what the service adds to the engine's steps."""
    read, last = server.get("mean_text_read_ms"), server.get("mean_last_frame_ms")
    if not frames or read is None or last is None:
        return None
    return (last - read) / frames


def way_out(stats: dict[str, Any], server: dict[str, Any]) -> float | None:
    """The client's mean TTFA less its way in (X-Request-Start → ingress) and the server's time until it handed the
    first audio on: what the reply's first audio spent between the ingress and the client (ms; it also holds the
    ingress reading and parsing the request before it submits it)."""
    ttfa, way_in, sent = stats["ttfa_s"].get("mean"), server.get("mean_request_path_ms"), server.get("mean_first_audio_sent_ms")
    return None if ttfa is None or way_in is None or sent is None else 1000 * ttfa - way_in - sent


def prompts_text(meta: dict[str, Any]) -> str:
    """The workload's prompts, as the table's header says them (results without a `prompt_file`: the one prompt)."""
    name, count = meta.get("prompt_file", PROMPT_FILE.name), meta.get("prompts", 1)
    if count == 1:
        return f"the ~100-token prompt of `benchmarks/{name}` for every request"
    return f"{count} prompts of about 100 tokens from `benchmarks/{name}`, so that concurrent streams differ"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], baseline: dict[str, Any] | None) -> str:
    lines = [f"# End to end through HTTP ({meta['gpu']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, layout `{meta['serve_config']}`"
             + (f", overrides `{' '.join(meta['overrides'])}`" if meta.get("overrides") else "")
             + (", under the MPS daemon" if meta.get("mps") else ", no MPS")
             + "".join(f"; {startup_text(r)}" for r in rows if r["phase"] == "startup")
             + "".join(f"; after the run, blocks kept in the graphs' pools: "
                       + ", ".join(f"{stage} {kept:.0f}" for stage, kept in r["graph_pool_kept"].items())
                       for r in rows if r["phase"] == "end" and r["graph_pool_kept"]),
             "",
             f"Workload: {prompts_text(meta)}, {meta['max_tokens']} Thinker tokens, "
             "Talker frames up to the layout's `max_frames` (400 = 32 s of audio in the benchmark layouts: the speech workload), "
             "EOS ignored, streamed chat completions with text + audio (`load_tests`). Client-side times are p50 over "
             "the level's requests (TTFA: and their mean, in brackets); server-side ones are means from `/metrics`, from the ingress submitting the request; "
             "the client's way in is from its X-Request-Start header to the ingress handler, and its way out what "
             "its mean TTFA spent after the ingress handed the first audio on. The client's TTFT is its first "
             "printable text: random weights may emit none for a long while (–: none at all), so the server's first "
             "token is the one to read. CPU cores used: CPU seconds per second of the level, summed over each part's "
             "processes (1.00 = one core busy all the time; the load generator is the benchmark's own process). Host "
             "per step: the engine thread's time queueing a step's device work (in brackets: its own CPU time in it; the "
             "rest it waited, for the GIL or inside CUDA calls) + handing its outputs on (its CPU time in brackets too), "
             "p50; the rest of a step is its wait for the device. A step's tail: its p90, and its mean as the means of "
             "its parts: the launch, the runner's collect (the wait for the device, then reading the step back) and "
             "the hand-on. GC: the milliseconds per second each stage's process spent in Python's garbage collector "
             "over the level, and its full collections then; CUDA allocator retries: allocations each stage's process "
             "retried over the level after freeing the allocator's cache, each a device sync inside the call that "
             "allocated (–: a process not on a GPU). Prefill batches: how many prefills the level's "
             "requests took (each reads the weights again), and the requests in each on average. The rest of a reply: "
             "the Thinker's last token; its end reaching the Talker; the launch of the Talker's first step past the "
             "reply's tokens (the frames before it wait on the Thinker's steps, the ones after only on the Talker's); "
             "the last frame; the vocoder's last chunk; the client's last chunk (its RTF's numerator). The Talker past "
             "the text: from its first step past the reply's tokens to its last frame, over the frames between (the "
             "layout's frame cap less the reply's tokens), ms a frame: its pace where only its own steps pace it, to "
             "read against its step time. RTF floor: the "
             "level's replies with the Thinker and the Talker each on a GPU of its own, stepping at their bandwidth "
             "floors (`omni_ray.floors.rtf_floor`), the rows routed to experts independently; measured routing: "
             "reading the experts random weights' steps did read at that batch in this workload "
             f"(`benchmarks/expert_reads.py`{', `' + meta['expert_reads'] + '`' if meta.get('expert_reads') else ''}; "
             "–: not measured).", "",
             "| concurrency | requests ok | TTFA p50 (mean) (ms) | TTFA p90 (ms) | TTFT p50 (ms) | RTF p50 | RTF floor | "
             "RTF floor, measured routing | streaming RTF p50 | "
             f"server: {' / '.join(point.replace('_', ' ') for point in FIRST_AUDIO_WAY)}, mean (ms) | "
             f"the rest of a reply, server: {' / '.join(point.replace('_', ' ') for point in REPLY_END)}; client: "
             "its last chunk, mean (ms) | "
             "client's way in / out, mean (ms) | step p50 (mean) thinker / talker (ms) | "
             "Talker past the text, ms a frame | "
             "host per step thinker / talker: launch (CPU) + outputs (CPU) (ms) | "
             "step p90; mean = launch + collect + outputs, thinker / talker (ms) | "
             "GC ms per s (full collections); CUDA allocator retries, thinker / talker / vocoder | "
             "mean batch thinker / talker | "
             "prefill batches (requests each) thinker / talker | "
             "vocoder busy, frames decoded per s, chunks per decode call | CPU cores used: load generator / proxy / ingress / thinker / talker / "
             "vocoder |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] != "measure":
            continue
        s, srv = r["stats"], r["server"]

        def ms(v: float | None) -> str:
            return "–" if v is None else f"{v * 1000:.0f}"

        def num(v: float | None, fmt: str = "{:.0f}") -> str:
            return "–" if v is None else fmt.format(v)

        lines.append(
            f"| {r['concurrency']} | {r['ok']}/{r['requests']} | {ms(s['ttfa_s']['p50'])} ({ms(s['ttfa_s'].get('mean'))}) | "
            f"{ms(s['ttfa_s']['p90'])} | "
            f"{ms(s['ttft_s']['p50'])} | {num(s['rtf']['p50'], '{:.3f}')} | {num(r.get('rtf_floor'), '{:.3f}')} | "
            f"{num(r.get('rtf_floor_measured_routing'), '{:.3f}')} | "
            f"{num(s['streaming_rtf']['p50'], '{:.3f}')} | "
            + " / ".join(num(srv.get(f"mean_{point}_ms")) for point in FIRST_AUDIO_WAY) + " | "
            + " / ".join(num(srv.get(f"mean_{point}_ms")) for point in REPLY_END)
            + f"; {ms(s.get('latency_s', {}).get('mean'))} | "
            f"{num(srv.get('mean_request_path_ms'))} / {num(way_out(s, srv))} | "
            + " / ".join(f"{num(srv.get(f'{stage}_step_ms_p50'), '{:.1f}')} ({num(srv.get(f'{stage}_step_ms_mean'), '{:.1f}')})"
                         for stage in ("thinker", "talker")) + " | "
            f"{num(talker_pace_past_text(srv, r.get('talker_frames_past_text')), '{:.2f}')} | "
            + " / ".join(f"{num(srv.get(f'{stage}_launch_ms_p50'), '{:.1f}')} ({num(srv.get(f'{stage}_launch_cpu_ms_p50'), '{:.1f}')})"
                         f" + {num(srv.get(f'{stage}_outputs_ms_p50'), '{:.1f}')} ({num(srv.get(f'{stage}_outputs_cpu_ms_p50'), '{:.1f}')})"
                         for stage in ("thinker", "talker")) + " | "
            + " / ".join(f"{num(srv.get(f'{stage}_step_ms_p90'), '{:.1f}')}; {num(srv.get(f'{stage}_step_ms_mean'), '{:.1f}')}"
                         f" = {num(srv.get(f'{stage}_launch_ms_mean'), '{:.1f}')}"
                         f" + {num(srv.get(f'{stage}_collect_ms_mean'), '{:.1f}')}"
                         f" + {num(srv.get(f'{stage}_outputs_ms_mean'), '{:.1f}')}"
                         for stage in ("thinker", "talker")) + " | "
            + " / ".join(f"{num(srv.get(f'{stage}_gc_pause_ms_per_s'), '{:.1f}')} ({num(srv.get(f'{stage}_gc_full_collections'))})"
                         for stage in GC_STAGES) + "; "
            + " / ".join(num(srv.get(f"{stage}_cuda_alloc_retries")) for stage in GC_STAGES) + " | "
            f"{num(srv.get('thinker_batch_mean'), '{:.1f}')} / {num(srv.get('talker_batch_mean'), '{:.1f}')} | "
            + " / ".join(f"{num(srv.get(f'{stage}_prefill_batches'))} ({num(srv.get(f'{stage}_prefill_sequences_per_batch'), '{:.1f}')})"
                         for stage in ("thinker", "talker")) + " | "
            f"{num(srv.get('vocoder_busy_s_per_s'), '{:.0%}')}, {num(srv.get('vocoder_frames_per_s'))}, "
            f"{num(srv.get('vocoder_windows_per_call'), '{:.1f}')} | "
            + " / ".join(num(r.get("cpu_cores", {}).get(part), "{:.2f}")
                         for part in ("load generator", "proxy", "ingress", "thinker", "talker", "vocoder")) + " |")
    failed = [r for r in rows if r["phase"] in ("warmup", "measure") and r.get("error_samples")]
    if failed:
        lines += [""] + [f"Failed requests at c={r['concurrency']}{' (warm-up)' if r['phase'] == 'warmup' else ''}: "
                         f"{r['errors']} (" + "; ".join(r["error_samples"]) + ")" for r in failed]
    lines += [f"Stopped: {r['reason']} (the service answered nothing within the timeout)"
              for r in rows if r["phase"] == "stopped"]
    if baseline:
        lines += ["", f"transformers `generate()` on the same GPU in the same run (batch 1, not streaming): "
                      f"{baseline['total_s']:.1f} s for {baseline['audio_s']:.1f} s of audio, RTF {baseline['rtf']:.2f}; "
                      "time to first audio = the whole run."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e_serve", description=__doc__)
    parser.add_argument("--serve-config", default=str(HERE / "serve_30b_random_2gpu.yaml"))
    parser.add_argument("--concurrency", help="closed-loop levels (default: 1,8,32; Qwen3-TTS: 1,8,32,64)")
    parser.add_argument("--s2-workloads", default="plain,stored_reference", help="S2 Pro's to run")
    parser.add_argument("--s2-rates", default="", help="S2 Pro: Poisson arrival rates (requests/s) before the "
                        "closed-loop levels (default: none)")
    parser.add_argument("--tts-rates", default="1,10,20", help="Qwen3-TTS: Poisson arrival rates (requests/s)")
    parser.add_argument("--tts-level-seconds", type=float, default=10.0, help="Qwen3-TTS, S2 Pro: requests a "
                        "Poisson level sends = rate x this (at least 4)")
    parser.add_argument("--tts-workloads", default="custom_voice,base_cached,base_fresh", help="Qwen3-TTS's to run")
    parser.add_argument("--tts-baseline", action="store_true", help="Qwen3-TTS: then the official qwen-tts generate() "
                        "(benchmarks/hf_baseline.py --family qwen3_tts, under QWEN_TTS_PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = concurrency x rounds")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--baseline", action="store_true", help="also run transformers' generate() (batch 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the layout's application args, e.g. pipeline.stages.vocoder.streaming.stateful=true, or a "
                        "deployment's options, e.g. deployments.talker.num_replicas=2")
    parser.add_argument("--prompt-file", default=str(DISTINCT_PROMPTS_FILE),
                        help="one prompt per line, request i takes them in a seed-shuffled cycle (default: 32 prompts of "
                        f"91-115 tokens, so that concurrent streams differ; {PROMPT_FILE.name}: one prompt for every "
                        "request, whose streams with random weights decode nearly the same tokens and share most "
                        "experts)")
    parser.add_argument("--expert-reads", default=str(EXPERT_READS),
                        help="`benchmarks/expert_reads.py`'s results: the experts a step read at each batch, for the "
                        "table's floor with measured routing (default: the latest measured, on an H200)")
    parser.add_argument("--request-timeout", type=float, default=60.0,
                        help="seconds a measured request may take (a 32-stream reply of the speech workload takes about 3.5)")
    parser.add_argument("--warmup-timeout", type=float, default=120.0,
                        help="seconds a warm-up request may take (the first batches may still compile or capture)")
    parser.add_argument("--haproxy", action="store_true",
                        help="HTTP through Serve's HAProxy front instead of its Python proxy (omni-ray serve --haproxy)")
    parser.add_argument("--port", type=int, default=8000, help="the service's HTTP port on 127.0.0.1")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    global URL
    os.environ[PORT_ENV] = str(args.port)
    URL = f"http://127.0.0.1:{args.port}"
    import torch

    if args.haproxy:  # before Ray starts: every Ray process reads it
        from omni_ray.serve.app import use_haproxy_front

        use_haproxy_front()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.tts_e2e.run import layout_family, run_tts

    family = layout_family(Path(args.serve_config))
    if family == "qwen3_tts":
        return run_tts(args, argv, out)
    if family == "s2_pro":
        from benchmarks.tts_e2e.s2_pro import run_s2_pro

        return run_s2_pro(args, argv, out)
    levels = [int(c) for c in (args.concurrency or "1,8,32").split(",")]
    layout = with_overrides(Path(args.serve_config), args.set, out) if args.set else Path(args.serve_config)
    floors = level_rtf_floors(layout, levels, args.max_tokens)
    prompts = len(load_prompts(args.prompt_file))
    workload = "a prompt per row" if prompts > 1 else "one prompt, a seed per row"
    measured = level_rtf_floors(layout, levels, args.max_tokens, measured_shares(Path(args.expert_reads), workload))
    rows = serve_and_measure(str(layout), levels, args.rounds, args.max_tokens, out, Path(args.prompt_file),
                             args.request_timeout, args.warmup_timeout)
    past_text = frames_past_text(layout, args.max_tokens)
    for row in rows:
        if row["phase"] == "measure":
            row["rtf_floor"] = floors[row["concurrency"]]
            row["rtf_floor_measured_routing"] = measured[row["concurrency"]]
            row["talker_frames_past_text"] = past_text
    baseline = None
    if args.baseline:  # a fresh process, after Serve released the GPUs
        subprocess.run([sys.executable, "-m", "benchmarks.hf_baseline", "--out", str(out / "hf_baseline.json")], check=True)
        baseline = json.loads((out / "hf_baseline.json").read_text())
    meta = run_meta("benchmarks.e2e_serve", argv, serve_config=Path(args.serve_config).name, overrides=args.set,
                    max_tokens=args.max_tokens, mps=mps_running(), prompt_file=Path(args.prompt_file).name,
                    prompts=prompts, expert_reads=Path(args.expert_reads).name,
                    gpu=f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu")
    write_results(out, "e2e", {"meta": meta, "rows": rows, "hf_baseline": baseline}, markdown(meta, rows, baseline))
    failed = sum(int(row.get("errors") or 0) for row in rows if row["phase"] in ("warmup", "measure"))
    stopped = any(row["phase"] == "stopped" for row in rows)
    if failed or stopped:  # the results are written; the exit status says a request failed (a suite step fails)
        print(f"{failed} requests failed (see the e2e table's failed requests)", file=sys.stderr)
    return 1 if failed or stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
