"""Benchmark layouts stay valid configs, `e2e_serve --set` overrides land where the pipeline reads them, and the 2-GPU
layouts' GPU fractions leave Ray one packing."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import yaml

from benchmarks import e2e_serve
from benchmarks.expert_reads import LATEST as EXPERT_READS, measured_shares
from benchmarks.e2e_serve import (
    breakdown, frames_past_text, level_rtf_floors, markdown, process_cpu_seconds, serve_process_label,
    service_cpu_seconds, startup_phases, with_overrides,
)
from omni_ray.config import PipelineConfig

LAYOUTS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("serve_30b_*.yaml"))  # Qwen3-Omni's
TTS_LAYOUTS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("serve_tts_*.yaml"))


@pytest.mark.parametrize("layout", TTS_LAYOUTS, ids=[p.name for p in TTS_LAYOUTS])
def test_tts_layouts_serve_qwen3_tts_models_that_build(layout: Path) -> None:
    from omni_ray.serve.app import app_from_serve_config, model_specs

    args = yaml.safe_load(layout.read_text())["applications"][0]["args"]
    families = {PipelineConfig.model_validate(spec["pipeline"]).model.family for spec in model_specs(args)}
    assert families == {"qwen3_tts"}
    built, _ = app_from_serve_config(layout)
    assert built is not None


@pytest.mark.parametrize("layout", LAYOUTS, ids=[p.name for p in LAYOUTS])
def test_overrides_reach_the_pipeline_config(layout: Path, tmp_path: Path) -> None:
    used = with_overrides(layout, ["pipeline.stages.vocoder.streaming.stateful=true", "pipeline.stages.thinker.relay=ipc",
                                   "limits.max_completion_tokens=512"], tmp_path)
    args = yaml.safe_load(used.read_text())["applications"][0]["args"]
    config = PipelineConfig.model_validate(args["pipeline"])
    assert config.stages.vocoder.streaming.stateful is True and config.stages.thinker.relay == "ipc"
    assert config.stages.thinker.engine.compile_layers is True  # the layout's own settings are kept
    assert args["limits"]["max_completion_tokens"] == 512


def test_an_override_reaches_one_model_of_several(tmp_path: Path) -> None:
    """`models.N....` sets that model's pipeline alone, though the layout's models share their stages by a YAML
    alias."""
    layout = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_tts_1.7b_random_1gpu.yaml"
    used = with_overrides(layout, ["models.1.pipeline.stages.vocoder.streaming.reference_cache_mb=0"], tmp_path)
    models = yaml.safe_load(used.read_text())["applications"][0]["args"]["models"]
    caches = [PipelineConfig.model_validate(m["pipeline"]).stages.vocoder.streaming.reference_cache_mb for m in models]
    assert caches == [64.0, 0]


def test_deployment_overrides_reach_serves_options(tmp_path: Path) -> None:
    from omni_ray.serve.app import app_from_serve_config

    layout = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_30b_random_2gpu.yaml"
    used = with_overrides(layout, ["deployments.talker.num_replicas=2", "deployments.thinker.max_ongoing_requests=32",
                                   "pipeline.stages.talker.resources.num_gpus=0.5"], tmp_path)
    app = yaml.safe_load(used.read_text())["applications"][0]
    options = {d["name"]: d for d in app["deployments"]}
    assert options["talker"]["num_replicas"] == 2 and options["talker"]["max_queued_requests"] == 256  # others kept
    assert options["thinker"]["max_ongoing_requests"] == 32 and options["ingress"]["num_replicas"] == 4
    assert app["args"]["pipeline"]["stages"]["talker"]["resources"]["num_gpus"] == 0.5
    _, spec = app_from_serve_config(used)  # the whole file still builds an application
    assert spec["name"] == "omni"


def _placements(fractions: dict[str, float], gpus: int) -> list[tuple[frozenset[str], ...]]:
    """Where one replica per stage lands on `gpus` GPUs of a node, for every order the replicas may arrive in, as Ray
    2.60's raylet places a fractional GPU demand: on the GPU that fits it with the least left over, the first such
    on a tie (`NodeResourceInstanceSet::TryAllocate`); a whole GPU takes the first free one. Raises if some order
    leaves a replica no room."""
    outcomes: set[tuple[frozenset[str], ...]] = set()
    for order in itertools.permutations(fractions):
        free, on = [1.0] * gpus, [frozenset[str]() for _ in range(gpus)]
        for stage in order:
            demand = fractions[stage]
            fits = [g for g in range(gpus) if (free[g] >= demand - 1e-9 if demand < 1 else free[g] >= 1 - 1e-9)]
            assert fits, f"placed in the order {order}, {stage} finds no GPU with {demand} free: {on}"
            gpu = min(fits, key=lambda g: (free[g] - demand, g)) if demand < 1 else fits[0]
            free[gpu] -= demand
            on[gpu] |= {stage}
        outcomes.add(tuple(sorted(on, key=sorted)))
    return sorted(outcomes, key=str)


@pytest.mark.parametrize("layout, apart", [
    ("deployments/qwen3_omni_30b_2gpu.yaml", {"talker": {"thinker", "encoder", "vocoder"}}),
    ("benchmarks/serve_30b_random_2gpu.yaml", {"talker": {"thinker", "encoder", "vocoder"}}),
    ("benchmarks/serve_30b_random_2gpu_vocoder_with_talker.yaml", {"thinker": {"talker", "vocoder"}}),
])
def test_two_gpu_layouts_admit_only_their_packing(layout: str, apart: dict[str, set[str]]) -> None:
    """The 2-GPU layouts' GPU fractions leave Ray one packing whatever order it places the replicas in: the Talker
    alone on a GPU, or the Thinker apart from the Talker and the vocoder (the variant that tells the vocoder's time
    slices on the Thinker's GPU apart)."""
    path = Path(__file__).resolve().parent.parent / layout
    stages = yaml.safe_load(path.read_text())["applications"][0]["args"]["pipeline"]["stages"]
    fractions = {name: float(stage["resources"]["num_gpus"]) for name, stage in stages.items()}
    outcomes = _placements(fractions, 2)
    assert outcomes
    for gpus in outcomes:
        for stage, others in apart.items():
            together = next(gpu for gpu in gpus if stage in gpu)
            assert not together & others, f"{layout}: {stage} shares a GPU with {together - {stage}}"


def test_the_placement_check_sees_a_layout_that_can_get_stuck() -> None:
    """Fractions that fit in some orders and not in others fail the check: 0.4 and 0.4 first share a GPU (best fit),
    and then one of the two 0.6 finds no room."""
    assert _placements({"a": 0.6, "c": 0.4}, 2) == [(frozenset(), frozenset({"a", "c"}))]  # best fit: together
    with pytest.raises(AssertionError, match="finds no GPU"):
        _placements({"a": 0.6, "b": 0.6, "c": 0.4, "d": 0.4}, 2)


def test_service_processes_are_told_apart_and_their_cpu_time_grows() -> None:
    """The e2e benchmark's CPU columns: Ray process titles map to the proxy and to deployments, and a busy process's
    CPU time grows (read from /proc)."""
    import time

    assert serve_process_label("ray::ProxyActor") == "proxy"
    assert serve_process_label("ray::ServeReplica:omni:ingress") == "ingress"
    assert serve_process_label("ray::ServeReplica:omni:talker.handle_request_streaming") == "talker"  # as Ray 2.60 titles it
    assert serve_process_label("ray::ServeController") is None and serve_process_label("ray::IDLE") is None
    before = process_cpu_seconds("self")
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    assert process_cpu_seconds("self") - before >= 0.2
    assert service_cpu_seconds()["load generator"] > 0


def test_each_level_gets_the_rtf_floor_of_its_streams_and_the_table_its_startup(tiny_checkpoint: Path) -> None:
    """The speech workload on the 2-GPU layout: a 100-token prompt, 128 text tokens, 400 Talker frames. With both
    stages at their floors and rows routed independently, 32 streams still need RTF 0.064 (the Thinker reads most
    experts, and the Talker's first 128 frames wait on its tokens); with the experts random weights' steps did read,
    0.038. Levels `expert_reads` did not measure print none."""
    layout = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_30b_random_2gpu.yaml"
    floors = level_rtf_floors(layout, [1, 8, 32], text_tokens=128)
    assert [floors[c] for c in (1, 8, 32)] == pytest.approx([0.0116, 0.0332, 0.0642], abs=5e-4)
    # with the experts measured steps read (`expert_reads.LATEST`, 32 distinct prompts: 51 of the Thinker's 128 at 32
    # rows); 4 unmeasured
    measured = level_rtf_floors(layout, [1, 4, 8, 32], 128, measured_shares(EXPERT_READS, "a prompt per row"))
    assert measured[1] == pytest.approx(floors[1]) and measured[4] is None
    assert [measured[c] for c in (8, 32)] == pytest.approx([0.0239, 0.0383], abs=5e-4)
    stats = {key: {"p50": 0.1, "p90": 0.2, "mean": 0.15} for key in ("ttfa_s", "ttft_s", "rtf", "streaming_rtf")}
    served = {"thinker_step_ms_p50": 14.0, "thinker_step_ms_mean": 15.5, "thinker_launch_ms_p50": 5.0,
              "thinker_launch_cpu_ms_p50": 1.2, "thinker_outputs_ms_p50": 7.2,
              "thinker_outputs_cpu_ms_p50": 2.1, "thinker_prefill_batches": 3,
              "thinker_prefill_sequences_per_batch": 10.7,  # the Talker's gauges missing
              "thinker_step_ms_p90": 19.0, "thinker_launch_ms_mean": 5.5, "thinker_collect_ms_mean": 1.5,
              "thinker_outputs_ms_mean": 8.0, "thinker_gc_pause_ms_per_s": 2.5, "thinker_gc_full_collections": 1.0,
              "vocoder_gc_pause_ms_per_s": 0.0, "vocoder_gc_full_collections": 0.0,
              "thinker_cuda_alloc_retries": 2.0, "talker_cuda_alloc_retries": 0.0, "vocoder_cuda_alloc_retries": None,
              "mean_last_token_ms": 1100.0, "mean_talker_text_end_ms": 1104.0, "mean_text_read_ms": 1109.0,
              "mean_last_frame_ms": 2400.0, "mean_last_audio_ms": 2700.0}
    startup = startup_phases({'omni_stage_startup_process_s{stage="thinker",replica="t1"}': 9.2,
                              'omni_stage_startup_load_s{stage="thinker",replica="t1"}': 20.4,
                              'omni_stage_startup_warmup_s{stage="thinker",replica="t1"}': 61.0,
                              'omni_stage_startup_compile_s{stage="thinker",replica="t1"}': 44.6,
                              'omni_stage_startup_warmup_s{stage="talker",replica="k1"}': 30.0,
                              'omni_stage_startup_warmup_s{stage="talker",replica="k2"}': 41.0,
                              'omni_stage_graph_pool_kept_blocks{stage="talker",replica="k1"}': 0.0,
                              'omni_stage_graph_pool_kept_blocks{stage="talker",replica="k2"}': 2.0,
                              'omni_stage_step_ms_p50{stage="talker",replica="k1"}': 5.0})
    assert startup == {"thinker": {"process": 9.2, "load": 20.4, "warmup": 61.0, "compile": 44.6},
                       "talker": {"warmup": 41.0, "graph_pool_kept": 2.0}}
    past_text = frames_past_text(layout, 128)
    assert past_text == 400 - 128  # the speech workload: the frames after the reply's 128 tokens
    rows = [{"phase": "startup", "seconds": 102.4, "stages": startup}, {"phase": "warmup", "concurrency": 32}] + [
        {"phase": "measure", "concurrency": c, "ok": c, "requests": c, "server": served if c == 32 else {},
         "stats": {**stats, "latency_s": {"mean": 2.8}} if c == 32 else stats, "rtf_floor": floors[c],
         "rtf_floor_measured_routing": measured[c], "talker_frames_past_text": past_text}
        for c in (1, 8, 32)]
    rows[-1].update(ok=30, errors=2, error_samples=["500: relay failed", "timeout:"])
    rows.append({"phase": "end", "graph_pool_kept": {"thinker": 0.0, "talker": 1.0}})
    meta = {"gpu": "cpu", "date": "2026-11-30", "commit": "x", "command": "y", "serve_config": layout.name, "max_tokens": 128}
    table = markdown(meta, rows, None)
    assert "| RTF floor | RTF floor, measured routing |" in table and "| 0.100 | 0.064 | 0.038 |" in table
    assert "| host per step thinker / talker: launch (CPU) + outputs (CPU) (ms) |" in table
    assert "| – (–) + – (–) / – (–) + – (–) |" in table  # levels without gauges
    assert "| 14.0 (15.5) / – (–) | 4.75 | 5.0 (1.2) + 7.2 (2.1) / – (–) + – (–) |" in table
    assert "| 32 | 30/32 | 100 (150) | 200 |" in table  # TTFA p50 (mean), p90
    assert "| 3 (10.7) / – (–) |" in table  # prefill batches (requests each) thinker / talker
    # a step's tail: its p90, and its mean as its parts' means; each stage process's GC pauses and CUDA allocator
    # retries over the level (–: no such series, a stage not on a GPU)
    assert "| step p90; mean = launch + collect + outputs, thinker / talker (ms) |" in table
    assert "| 19.0; 15.5 = 5.5 + 1.5 + 8.0 / –; – = – + – + – | 2.5 (1) / – (–) / 0.0 (0); 2 / 0 / – |" \
        in table
    # where the rest of a reply went: the server's points past the first audio, then the client's last chunk
    assert ("| the rest of a reply, server: last token / talker text end / text read / last frame / last audio; "
            "client: its last chunk, mean (ms) |") in table
    assert "| 1100 / 1104 / 1109 / 2400 / 2700; 2800 |" in table
    # the Talker's pace past the text: (2400 - 1109) ms over 272 frames
    assert "| – (–) / – (–) | – |" in table  # none where the level has no server means
    assert "| – / – / – / – / –; – |" in table  # a level without them (and a summary without latencies)
    header, rule, *body = [line for line in table.splitlines() if line.startswith("|")]
    assert all(line.count(" | ") == header.count(" | ") for line in body) and rule.count("---") == header.count(" | ") + 1
    assert "| 32 | 30/32 |" in table and "Failed requests at c=32: 2 (500: relay failed; timeout:)" in table
    assert "Failed requests at c=8" not in table
    assert ("service ready 102 s after `serve.run` (thinker: process 9, load 20, warm-up 61 (compiling 45) s; "
            "talker: warm-up 41 s, 2 blocks kept in its graphs' pool); after the run, blocks kept in the graphs' pools: "
            "thinker 0, talker 1") in table
    assert "the ~100-token prompt of `benchmarks/prompt_100_tokens.txt` for every request" in table  # no prompt file named
    distinct = markdown({**meta, "prompt_file": "prompts_100_tokens_distinct.txt", "prompts": 32}, rows, None)
    assert "32 prompts of about 100 tokens from `benchmarks/prompts_100_tokens_distinct.txt`" in distinct


@pytest.mark.parametrize("replies_until", [0, 2, 99])  # calls of the load that get replies: none, the warm-ups, all
def test_a_run_stops_at_the_first_warm_up_or_level_without_a_reply(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                    replies_until: int) -> None:
    """A hung service (every request waits until the step is killed) ends the run at the first warm-up or level in
    which no request got a reply within its timeout: the rows measured so far, a "stopped" row, and the table says
    so. Only the load and the metrics scrape are stood in."""
    calls: list[tuple[int, int, float]] = []

    def load(concurrency: int, requests: int, max_tokens: int, out_dir: Path | None, prompt_file: Path,
             timeout: float) -> tuple[dict, float]:
        calls.append((concurrency, requests, timeout))
        ok = requests if len(calls) <= replies_until else 0
        stats = {key: {"p50": 0.1 if ok else None, "p90": None, "mean": None}
                 for key in ("ttfa_s", "ttft_s", "rtf", "streaming_rtf")}
        samples = [] if ok else [f"timeout: no complete reply within {timeout:g} s"]
        return {"requests": requests, "ok": ok, "errors": requests - ok, "errors_by_status": {}, "error_samples": samples,
                "audio_s_total": 0.0, "stats": stats, "finish_reasons": {}}, 1.0

    monkeypatch.setattr(e2e_serve, "load", load)
    monkeypatch.setattr(e2e_serve, "scrape", lambda: {})
    monkeypatch.setattr(e2e_serve, "service_cpu_seconds", lambda: {})
    monkeypatch.setattr(e2e_serve.time, "sleep", lambda seconds: None)
    rows = e2e_serve.warm_and_measure([1, 8], 2, 16, tmp_path, tmp_path / "prompts.txt", request_timeout=60.0,
                                      warmup_timeout=300.0)
    phases = [(row["phase"], row.get("concurrency")) for row in rows]
    table = markdown({"gpu": "cpu", "date": "d", "commit": "x", "command": "y", "serve_config": "s", "max_tokens": 16},
                     rows, None)
    if replies_until == 0:  # the first warm-up request got nothing: no level runs
        assert calls == [(1, 1, 300.0)] and phases == [("warmup", 1), ("stopped", None)]
        assert "Failed requests at c=1 (warm-up): 1 (timeout: no complete reply within 300 s)" in table
        assert "Stopped: the warm-up at c=1 got no reply" in table
    elif replies_until == 2:  # the warm-ups answered, the first level did not: the second is not run
        assert calls == [(1, 1, 300.0), (8, 8, 300.0), (1, 2, 60.0)]
        assert phases == [("warmup", 1), ("warmup", 8), ("measure", 1), ("stopped", None)]
        assert "| 1 | 0/2 |" in table and "Stopped: c=1 got no reply" in table
    else:
        assert phases == [("warmup", 1), ("warmup", 8), ("measure", 1), ("measure", 8)] and "Stopped" not in table


def test_the_distinct_prompts_are_32_different_prompts_of_about_100_tokens(tiny_checkpoint: Path) -> None:
    """What `e2e_serve --prompt-file` sends so that concurrent streams differ: as long as the one prompt of
    `prompt_100_tokens.txt`, in the service's tokenizer (the tiny model's)."""
    from transformers import AutoTokenizer

    from benchmarks.e2e_serve import DISTINCT_PROMPTS_FILE, PROMPT_FILE
    from load_tests.client import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompts = load_prompts(str(DISTINCT_PROMPTS_FILE))
    assert len(set(prompts)) == len(prompts) == 32
    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    assert all(90 <= n <= 120 for n in lengths), lengths
    assert len(tokenizer(load_prompts(str(PROMPT_FILE))[0]).input_ids) in range(min(lengths), max(lengths) + 1)


def test_a_levels_breakdown_reads_gauges_at_its_end_and_counters_over_it() -> None:
    vocoder = '{stage="vocoder",replica="v1"}'
    before = {f"omni_stage_decode_{name}{vocoder}": value
              for name, value in (("busy_s", 10.0), ("frames", 1000.0), ("calls", 50.0), ("windows", 400.0))}
    after = {f"omni_stage_decode_{name}{vocoder}": value
             for name, value in (("busy_s", 13.0), ("frames", 5000.0), ("calls", 150.0), ("windows", 1200.0))}
    after['omni_stage_launch_cpu_ms_p50{stage="thinker",replica="t1"}'] = 1.5
    for replica, (batches, sequences) in (("t1", (4, 40)), ("t2", (6, 50))):  # two Thinker replicas: summed
        before[f'omni_stage_prefill_batches{{stage="thinker",replica="{replica}"}}'] = batches
        before[f'omni_stage_prefilled_sequences{{stage="thinker",replica="{replica}"}}'] = sequences
    after['omni_stage_prefill_batches{stage="thinker",replica="t1"}'] = 6
    after['omni_stage_prefilled_sequences{stage="thinker",replica="t1"}'] = 72
    after['omni_stage_prefill_batches{stage="thinker",replica="t2"}'] = 8
    after['omni_stage_prefilled_sequences{stage="thinker",replica="t2"}'] = 82
    before['omni_stage_gc_pause_s{stage="talker",replica="k1"}'] = 0.5
    after['omni_stage_gc_pause_s{stage="talker",replica="k1"}'] = 0.52
    after['omni_stage_gc_full_collections{stage="talker",replica="k1"}'] = 1.0
    before['omni_stage_cuda_alloc_retries{stage="thinker",replica="t1"}'] = 3.0
    after['omni_stage_cuda_alloc_retries{stage="thinker",replica="t1"}'] = 5.0
    after['omni_stage_cuda_alloc_retries{stage="talker",replica="k1"}'] = 0.0
    out = breakdown(before, after, seconds=4.0)
    assert out["talker_gc_pause_ms_per_s"] == pytest.approx(5.0) and out["talker_gc_full_collections"] == 1.0
    assert (out["thinker_cuda_alloc_retries"], out["talker_cuda_alloc_retries"], out["vocoder_cuda_alloc_retries"]) \
        == (2.0, 0.0, None)  # the vocoder's process reported none: not on a GPU
    assert out["thinker_gc_pause_ms_per_s"] == 0.0  # no series: nothing grew
    assert out["thinker_prefill_batches"] == 4 and out["thinker_prefill_sequences_per_batch"] == 16  # 64 in 4
    assert out["talker_prefill_batches"] == 0 and out["talker_prefill_sequences_per_batch"] is None
    assert out["vocoder_busy_s_per_s"] == pytest.approx(0.75) and out["vocoder_frames_per_s"] == pytest.approx(1000)
    assert out["vocoder_windows_per_call"] == pytest.approx(8.0)  # 800 chunks in 100 calls
    assert out["thinker_launch_cpu_ms_p50"] == 1.5
    assert breakdown(before, before, seconds=4.0)["vocoder_windows_per_call"] is None  # no call in the level

