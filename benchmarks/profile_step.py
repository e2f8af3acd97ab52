"""GPU kernels by time in graph-replayed Thinker and Talker(+MTP) prefill and decode steps of full-size Qwen3-Omni
(random weights), per step. Also reports the GPU's idle time between kernels, split into launch gaps inside a
replay and the host's gaps. The prefill step is profiled with host events too: each named stretch's CPU time and
device span. Use it to see where a step's GPU time goes, before and after a kernel or graph change.

    python -m benchmarks.profile_step --compile --served [--thinker-only | --talker-only] [--prefill-graph-tokens N]
        [--wave K]      (K: also a burst's later wave, K prompts prefilled while 32 - K decode, against their decode alone)
        [--persistent-code-predictor]   (the Talker's code-predictor passes as the persistent kernel, as served)
        [--batches 1,32]                (the batches profiled, each stage)

One H100 or H200 (the Thinker and the Talker are built one after the other on the same GPU)."""

from __future__ import annotations

import bisect
import sys
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DEFAULT_TALKER_SAMPLING, FULL_CONFIG, GREEDY_TALKER, _talker_seqs, benchmark_prompt_ids
from omni_ray.config import DEFAULT_PREFILL_GRAPH_TOKENS
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.profiling import RANGE_PREFIX, is_kernel
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.talker import TalkerRunner
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker


def _report(title: str, prof: Any, steps: int) -> None:
    averages = prof.key_averages()
    events = [e for e in averages if is_kernel(e)]
    kernels = sum(e.count for e in events) / steps
    gpu_ms = sum(e.self_device_time_total for e in events) / steps / 1000
    print(f"## {title}: {gpu_ms:.2f} ms GPU time and {kernels:.0f} kernels per step")
    print(averages.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
    spans = [e for e in averages if e.device_type.name == "CUDA" and e.key.startswith(RANGE_PREFIX)]
    if spans:  # profiled with host events: what each named stretch's kernels took on the device, first to last
        print("named host stretches: CPU time including what they call / their kernels' span on the device (ms per step)")
        for e in sorted(spans, key=lambda e: -e.device_time_total):
            cpu = sum(h.cpu_time_total for h in averages if h.key == e.key and h.device_type.name == "CPU")
            print(f"  {cpu / steps / 1000:7.2f} / {e.device_time_total / steps / 1000:7.2f}  {e.key[len(RANGE_PREFIX):]}")
    print(_idle_report(prof, steps))
    sys.stdout.flush()


def _idle_report(prof: Any, steps: int, host_gap_us: float = 50.0) -> str:
    """Where the GPU sat idle between the step's kernels: gaps under `host_gap_us` are the launch gaps inside a graph
    replay (charged to the kernel that ends them), longer ones the host's between launches (with host events
    profiled: what the host ran during them)."""
    kernels = sorted((e for e in prof.events() if is_kernel(e)), key=lambda e: e.time_range.start)
    if not kernels:
        return "no device events"
    launch_idle, host_idle, gaps = 0.0, 0.0, 0
    by_next: dict[str, float] = {}
    long_gaps: list[tuple[float, float]] = []
    end = kernels[0].time_range.end
    for event in kernels[1:]:
        gap = event.time_range.start - end
        if 0 < gap < host_gap_us:
            launch_idle, gaps = launch_idle + gap, gaps + 1
            by_next[event.name[:60]] = by_next.get(event.name[:60], 0.0) + gap
        elif gap >= host_gap_us:
            host_idle += gap
            long_gaps.append((end, event.time_range.start))
        end = max(end, event.time_range.end)
    span = end - kernels[0].time_range.start
    lines = [f"idle: first kernel's start to last kernel's end {span / steps / 1000:.2f} ms per step; idle in gaps under "
             f"{host_gap_us:.0f} us {launch_idle / steps / 1000:.2f} ms per step ({gaps / steps:.0f} gaps, mean "
             f"{launch_idle / max(gaps, 1):.2f} us); in longer gaps {host_idle / steps / 1000:.2f} ms per step "
             f"({len(long_gaps) / steps:.0f} gaps, the longest {max((b - a for a, b in long_gaps), default=0) / 1000:.2f} ms)",
             "idle before these kernels (ms per step):"]
    for name, idle in sorted(by_next.items(), key=lambda item: -item[1])[:8]:
        lines.append(f"  {idle / steps / 1000:6.3f}  {name}")
    during = _host_ops_during(prof, long_gaps)
    if during:
        lines.append("host ops during the longer gaps (ms per step of overlap; nested ops count in their callers too):")
        for name, overlap in sorted(during.items(), key=lambda item: -item[1])[:20]:
            lines.append(f"  {overlap / steps / 1000:6.3f}  {name}")
    return "\n".join(lines)


def _host_ops_during(prof: Any, gaps: list[tuple[float, float]]) -> dict[str, float]:
    """Each host event's overlap (us) with the GPU's idle `gaps` (sorted, disjoint), summed by name."""
    starts = [start for start, _ in gaps]
    during: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name != "CPU":
            continue
        begin, finish = event.time_range.start, event.time_range.end
        i = max(bisect.bisect_right(starts, begin) - 1, 0)
        overlap = 0.0
        while i < len(gaps) and gaps[i][0] < finish:
            overlap += max(0.0, min(finish, gaps[i][1]) - max(begin, gaps[i][0]))
            i += 1
        if overlap > 0:
            during[event.name[:70]] = during.get(event.name[:70], 0.0) + overlap
    return during


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiled(run: Callable[[], Any], host: bool = False) -> Any:
    """`run` under the profiler: its kernels, and with `host` its host ops too (slower: for steps not timed alone)."""
    _synchronize()
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    if host or not activities:  # without CUDA (a CPU check of this script): the host's ops
        activities.append(ProfilerActivity.CPU)
    with profile(activities=activities) as prof:
        run()
        _synchronize()
    return prof


def _profile(name: str, runner: Any, make_seqs: Callable[[], list[Any]]) -> None:
    """The batch's prefill step (the Talker's includes its first frame), then three of its decode steps, each replayed
    from graphs captured by an untimed pass of the same batch (a prefill past the graph budget runs at its own shape,
    compiled by that pass)."""
    warm = make_seqs()
    for seq in warm:
        runner.admit(seq)
    for _ in range(6):
        runner.step(warm)
    for seq in warm:
        runner.release(seq)
    seqs = make_seqs()
    for seq in seqs:
        runner.admit(seq)
    prefill = _profiled(lambda: runner.step(seqs), host=True)
    for _ in range(4):
        runner.step(seqs)
    decode = _profiled(lambda: [runner.step(seqs) for _ in range(3)])
    for seq in seqs:
        runner.release(seq)
    _report(f"{name} prefill step, batch {len(seqs)}, graphs", prefill, 1)
    _report(f"{name} decode, batch {len(seqs)}, graphs", decode, 3)


def profile_wave(runner: Any, make_seq: Callable[[int], Any], running: int, wave: int) -> None:
    """A burst's later wave as the service meets it: `running` requests decoding when `wave` new ones arrive. The
    decode step alone, then the step that prefills the wave and decodes the others (two passes, each reading the
    experts their tokens pick), both after an untimed step of the same shapes."""
    decoding = [make_seq(i) for i in range(running)]
    for seq in decoding:
        runner.admit(seq)
    for _ in range(3):
        runner.step(decoding)
    decode = _profiled(lambda: runner.step(decoding))

    def wave_step(run: Callable[[Callable[[], Any]], Any]) -> Any:
        """A fresh wave admitted, its step run by `run`, the wave released."""
        new = [make_seq(running + i) for i in range(wave)]
        for seq in new:
            runner.admit(seq)
        result = run(lambda: runner.step(decoding + new))
        for seq in new:
            runner.release(seq)
        return result

    wave_step(lambda step: step())  # untimed: the wave's shapes compiled and captured
    stepped = wave_step(lambda step: _profiled(step, host=True))
    for seq in decoding:
        runner.release(seq)
    _report(f"thinker decode alone, batch {running}", decode, 1)
    _report(f"thinker wave step: prefill {wave} + decode {running}", stepped, 1)


def main() -> None:
    compiled = "--compile" in sys.argv[1:]  # fuse each decoder layer with torch.compile
    served = "--served" in sys.argv[1:]  # the Talker samples as the service does (top-k 50; MTP top-k 50 / top-p 0.8)
    talker_only = "--talker-only" in sys.argv[1:]
    thinker_only = "--thinker-only" in sys.argv[1:]
    # as the service runs them: a prefill batch whose bucket holds more padded tokens runs without a graph, at its own
    # shape (`engine.prefill_graph_tokens`); --prefill-graph-tokens -1: every prefill from a graph
    graph_tokens: int | None = DEFAULT_PREFILL_GRAPH_TOKENS
    if "--prefill-graph-tokens" in sys.argv[1:]:
        graph_tokens = int(sys.argv[sys.argv.index("--prefill-graph-tokens") + 1])
        graph_tokens = None if graph_tokens < 0 else graph_tokens
    print(f"prefills over {graph_tokens} padded tokens without a graph" if graph_tokens is not None
          else "every prefill from a graph")
    persistent = "--persistent-code-predictor" in sys.argv[1:]
    batches = (1, 32)
    if "--batches" in sys.argv[1:]:
        batches = tuple(int(b) for b in sys.argv[sys.argv.index("--batches") + 1].split(","))
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    text = config.thinker_config.text_config
    if not talker_only:
        thinker = ThinkerRunner(load_thinker(None, config, "cuda", torch.bfloat16), config,
                                SlotKVCache(text.num_hidden_layers, 32, 2048, text.num_key_value_heads, text.head_dim,
                                            torch.bfloat16, "cuda"),
                                compile_layers=compiled, prefill_graph_tokens=graph_tokens)
        def prompt(i: int) -> ThinkerSequence:  # a prompt per row: rows route to different experts, as streams do
            return ThinkerSequence(f"p{i}", benchmark_prompt_ids(config, 100, i), SamplingParams(temperature=0.0), 64,
                                   frozenset(), for_talker=True)

        for batch in batches:
            _profile("thinker", thinker, lambda batch=batch: [prompt(i) for i in range(batch)])
        if "--wave" in sys.argv[1:]:  # --wave K: K prompts arriving while 32 - K decode (a burst's later wave)
            wave = int(sys.argv[sys.argv.index("--wave") + 1])
            profile_wave(thinker, prompt, 32 - wave, wave)
        del thinker
        torch.cuda.empty_cache()
    if thinker_only:
        return
    talker_text = config.talker_config.text_config
    talker = TalkerRunner(load_talker(None, config, "cuda", torch.bfloat16), config,
                          SlotKVCache(talker_text.num_hidden_layers, 32, 2048, talker_text.num_key_value_heads, talker_text.head_dim,
                                      torch.bfloat16, "cuda"), 32, compile_layers=compiled,
                          prefill_graph_tokens=graph_tokens, persistent_code_predictor=persistent)
    sampling = DEFAULT_TALKER_SAMPLING if served else GREEDY_TALKER
    for batch in batches:
        _profile(f"talker + frame ({'served' if served else 'greedy'} sampling)", talker,
                 lambda batch=batch: _talker_seqs(config, batch, 100, 20, sampling, "cuda", torch.bfloat16))


if __name__ == "__main__":
    main()
