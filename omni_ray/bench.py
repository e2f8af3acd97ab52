"""Engine-only speed of full-size Qwen3-Omni (random weights): Thinker and Talker(+MTP) steps per batch size."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.config import DEFAULT_PERSISTENT_L2_KEEP_PERCENT, DEFAULT_PREFILL_GRAPH_TOKENS
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.floors import floor_ms
from omni_ray.layers import small_batch
from omni_ray.models.qwen3_omni.orchestrator import DEFAULT_TALKER_SAMPLING
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker
from omni_ray.relay.transports import IPC_FROM_BYTES

FULL_CONFIG = Path(__file__).parent / "assets" / "qwen3_omni_30b_a3b_config.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)
SERVED_THINKER = SamplingParams(temperature=0.7)  # what the load tests ask for (request i: seed i)


def source_commit(root: Path = Path(__file__).resolve().parent.parent) -> str:
    """The commit of the code that ran: $OMNI_RAY_COMMIT when set, else the HEAD of `root`'s git repository, marked
    `+changes` when tracked files differ from it. (A work tree copied to another machine may carry a stale .git, whose
    HEAD then names an older commit: on the GPU machine pass the commit in $OMNI_RAY_COMMIT.)"""
    if os.environ.get("OMNI_RAY_COMMIT"):
        return os.environ["OMNI_RAY_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    found = git("rev-parse", "--short", "HEAD")
    if not found:
        return "unknown"
    return f"{found}+changes" if git("status", "--porcelain", "--untracked-files=no") else found


def benchmark_prompt_ids(config: Any, length: int, variant: int = 0) -> list[int]:
    """A `length`-token user turn ending in `<|im_start|>assistant\\n`. Each `variant` has another body, so that the
    rows of a batch decode different tokens and route to different experts, as a service's streams do (rows with one
    prompt under greedy decoding share every expert, and a batch's step then reads no more weights than one row's)."""
    body = [10 + (i + 131 * variant) % 900 for i in range(length - 6)]
    return [config.im_start_token_id, config.user_token_id, *body, config.im_end_token_id,
            config.im_start_token_id, config.assistant_token_id, 198]


def run_meta(module: str, argv: list[str] | None, **fields: Any) -> dict[str, Any]:
    """What every results file records: date, commit and the command that made it (plus `fields`)."""
    args = argv if argv is not None else sys.argv[1:]
    return {"date": datetime.date.today().isoformat(), "commit": source_commit(),
            "command": f"python -m {module} " + " ".join(args), **fields}


def write_results(out_dir: str | Path, stem: str, document: dict[str, Any], table: str) -> None:
    """`<stem>.json` (the document) and `<stem>.md` (the table) in out_dir; the table is printed too."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(document, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)
    print(table)


def _timed(fn: Callable[[], Any], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


class _LaunchClock:
    """Host time spent in a runner's `launch` calls; with `count_syncs` on CUDA, also the host syncs torch saw in
    them (`torch.cuda.set_sync_debug_mode`): a launch that waits for the GPU cannot run ahead of it."""

    def __init__(self, runner: Any, count_syncs: bool = False) -> None:
        self.runner = runner
        self.count_syncs = count_syncs and torch.cuda.is_available()
        self.launches = 0
        self.seconds = 0.0
        self.syncs = 0
        self.sync_sites: Counter[str] = Counter()  # where in omni_ray each sync was asked for

    def launch(self, seqs: list[Any]) -> Any:
        if not self.count_syncs:  # timed: nothing around the launch but the clock
            start = time.perf_counter()
            handle = self.runner.launch(seqs)
            self.seconds += time.perf_counter() - start
            self.launches += 1
            return handle
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self._record_sync  # called while the syncing op runs: its stack is the caller's
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return self.runner.launch(seqs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                self.launches += 1

    def _record_sync(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                     file: Any = None, line: str | None = None) -> None:
        if "synchroniz" not in str(message):
            return
        self.syncs += 1
        ours = [frame for frame in traceback.extract_stack() if "/omni_ray/" in frame.filename and frame.filename != __file__]
        site = ours[-1] if ours else None
        self.sync_sites[f"{site.filename.rsplit('/omni_ray/', 1)[-1]}:{site.lineno} `{site.line}`" if site
                        else f"{filename}:{lineno}"] += 1


def launched_ahead(launch: Callable[[list[Any]], Any], collect: Callable[[Any], Any], seqs: list[Any],
                   steps: int) -> None:
    """`steps` steps as the engine loop runs a runner with launch/collect: step N+1 is queued before step N is read."""
    pending = launch(seqs)
    for _ in range(steps - 1):
        launched = launch(seqs)
        collect(pending)
        pending = launched
    collect(pending)


def _run_batch(runner: Any, make_seqs: Callable[[], list[Any]], steps: int, device: str, stage: str) -> dict[str, Any]:
    """One untimed pass (captures this batch's CUDA graphs), then a timed one: the prefill step and `steps` decode
    steps of the same batch, one at a time; then, for a runner with launch/collect, `steps` more launched ahead (the
    mean step time of the engine loop's pipelining), with the host's time per launch (a step launched ahead cannot be
    shorter) and, counted in the untimed pass, the host syncs inside the launches."""
    pipelined = hasattr(runner, "launch")
    for timed in (False, True):
        seqs = make_seqs()
        for seq in seqs:
            runner.admit(seq)
        prefill_ms = _timed(lambda: runner.step(seqs), device)
        times = [_timed(lambda: runner.step(seqs), device) for _ in range(steps)]
        clock = _LaunchClock(runner, count_syncs=not timed and device.startswith("cuda"))
        ahead_ms = (_timed(lambda: launched_ahead(clock.launch, runner.collect, seqs, steps), device) / steps
                    if pipelined else None)
        if not timed:
            syncs, sync_sites = clock.syncs, dict(clock.sync_sites)
        for seq in seqs:
            runner.release(seq)
    return {"stage": stage, "batch": len(seqs), "prefill_ms_total": prefill_ms,
            "step_ms_p50": statistics.median(times[2:]), "step_ms_min": min(times[2:]), "step_ms_launched_ahead": ahead_ms,
            "host_ms_per_launch": 1000 * clock.seconds / clock.launches if pipelined else None,
            "host_syncs_per_launch": syncs / steps if pipelined else None,
            "host_sync_sites": sync_sites if pipelined else None,
            "graphs": len(runner.graphs), "capture_ms_total": round(runner.graphs.capture_ms)}


def bench_thinker(
    config: Any, device: str, dtype: torch.dtype, batches: list[int], prompt: int, steps: int, graphs: bool,
    compiled: bool = False, max_seq_len: int = 0, sampling: SamplingParams = SamplingParams(temperature=0.0),
    moe_kernels: bool = True, prefill_graph_tokens: int | None = None, moe_layer_kernels: bool = True,
    moe_layer_folds: bool = False,
) -> list[dict[str, Any]]:
    text = config.thinker_config.text_config
    slot_len = max(prompt + 2 * steps + 8, max_seq_len)
    runner = ThinkerRunner(
        load_thinker(None, config, device, dtype), config,
        SlotKVCache(text.num_hidden_layers, max(batches), slot_len, text.num_key_value_heads, text.head_dim, dtype, device),
        cuda_graphs=graphs, compile_layers=compiled, moe_kernels=moe_kernels, prefill_graph_tokens=prefill_graph_tokens,
        moe_layer_kernels=moe_layer_kernels, moe_layer_folds=moe_layer_folds,
    )
    rows = []
    for batch in batches:
        def make_seqs(batch: int = batch) -> list[ThinkerSequence]:
            return [ThinkerSequence(f"t{i}", benchmark_prompt_ids(config, prompt, i),
                                    sampling if sampling.greedy else sampling.model_copy(update={"seed": i}),
                                    2 * steps + 4, frozenset(), for_talker=True)
                    for i in range(batch)]

        rows.append(_run_batch(runner, make_seqs, steps, device, "thinker"))
    return rows


def bench_talker(
    config: Any, device: str, dtype: torch.dtype, batches: list[int], prompt: int, steps: int, graphs: bool,
    compiled: bool = False, sampling: SamplingParams = GREEDY_TALKER, max_seq_len: int = 0,
    sampling_kernel: bool = True, code_predictor_kernels: bool = True, moe_kernels: bool = True,
    prefill_graph_tokens: int | None = None, moe_layer_kernels: bool = True, persistent_code_predictor: bool = False,
    moe_layer_folds: bool = False, persistent_l2_keep_percent: int = DEFAULT_PERSISTENT_L2_KEEP_PERCENT,
    persistent_draws: bool = False,
) -> list[dict[str, Any]]:
    text = config.talker_config.text_config
    slot_len = max(prompt + 2 * steps + 16, max_seq_len)
    runner = TalkerRunner(
        load_talker(None, config, device, dtype), config,
        SlotKVCache(text.num_hidden_layers, max(batches), slot_len, text.num_key_value_heads, text.head_dim, dtype, device),
        max(batches), cuda_graphs=graphs, compile_layers=compiled,
        sampling_kernel=sampling_kernel, code_predictor_kernels=code_predictor_kernels, moe_kernels=moe_kernels,
        prefill_graph_tokens=prefill_graph_tokens, moe_layer_kernels=moe_layer_kernels,
        persistent_code_predictor=persistent_code_predictor, moe_layer_folds=moe_layer_folds,
        persistent_code_predictor_l2_keep_percent=persistent_l2_keep_percent,
        persistent_code_predictor_draws=persistent_draws,
    )
    rows = []
    for batch in batches:
        rows.append(_run_batch(runner, lambda batch=batch: _talker_seqs(config, batch, prompt, steps, sampling, device, dtype),
                               steps, device, "talker"))
    return rows


def _talker_seqs(
    config: Any, batch: int, prompt: int, steps: int, sampling: SamplingParams = GREEDY_TALKER,
    device: str = "cpu", dtype: torch.dtype = torch.float32,
) -> list[TalkerSequence]:
    """Talker requests fed with random Thinker states (a `prompt`-token prompt and enough reply text for every step),
    in `dtype` and where the 1-GPU layout's relay hands them over: a burst's prefix states (one message) on `device`
    when they reach CUDA IPC's size, else on the host, as the reply tokens' embeddings (small messages) always are."""
    hidden = config.talker_config.thinker_hidden_size
    prefix_bytes = batch * (prompt + 3) * hidden * torch.finfo(dtype).bits // 8
    where = device if prefix_bytes >= IPC_FROM_BYTES else "cpu"
    seqs = []
    for i in range(batch):
        seq = TalkerSequence(f"k{i}", sampling, 2302, max_frames=2 * steps + 4, ignore_eos=True)
        seq.prefix = {"user_states": (torch.randn(prompt, hidden) * 0.02).to(where, dtype),
                      "user_multimodal": torch.zeros(prompt, dtype=torch.bool, device=where),
                      "assistant_prefix": (torch.randn(3, hidden) * 0.02).to(where, dtype)}
        seq.text_embeds = [(torch.randn(hidden) * 0.02).to(dtype) for _ in range(2 * steps + 8)]
        seqs.append(seq)
    return seqs


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Engine step times ({meta['gpu']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, dtype {meta['dtype']}, {meta['mode']}", "",
             "Each row of a batch has its own prompt, so rows route to different experts, as a service's streams do. "
             "Launched ahead: the mean step when each step is queued before the previous one is read back, as the "
             "engine loop runs them; per request and the ratio to the floor use it where measured. Floor: the weight "
             "bytes a step reads at that batch (experts any row picks; `omni_ray/floors.py`) at 4.3 TB/s. Host per "
             "launch: the host's time inside each launched-ahead step's `launch` (a step launched ahead takes at least "
             "that), and how many host syncs torch saw in it (CUDA only).", "",
             "| stage | batch | step p50 (ms) | launched ahead (ms) | host per launch (ms), syncs | per request (ms) | floor at this batch (ms) | ratio to floor | prefill, all requests (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        floor = r["floor_ms"]
        ahead = "–" if r.get("step_ms_launched_ahead") is None else f"{r['step_ms_launched_ahead']:.1f}"
        host = "–" if r.get("host_ms_per_launch") is None else f"{r['host_ms_per_launch']:.2f}, {r['host_syncs_per_launch']:g}"
        best = r.get("step_ms_launched_ahead") or r["step_ms_p50"]
        lines.append(f"| {r['stage']}{' + MTP' if r['stage'] == 'talker' else ''} | {r['batch']} | {r['step_ms_p50']:.1f} | "
                     f"{ahead} | {host} | {best / r['batch']:.2f} | {floor:.2f} | {best / floor:.1f}x | {r['prefill_ms_total']:.0f} |")
    sites = [(r, site, count) for r in rows for site, count in (r.get("host_sync_sites") or {}).items()]
    if sites:
        lines += ["", "Where the launches' host syncs were asked for (count over the launched-ahead steps):", ""]
        lines += [f"- {r['stage']} batch {r['batch']}: {site} x{count}" for r, site, count in sites]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_ray.bench", description=__doc__)
    parser.add_argument("--config", default=str(FULL_CONFIG))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--compile", action="store_true", help="fuse each decoder layer with torch.compile")
    parser.add_argument("--thinker-sampling", choices=["greedy", "served"], default="greedy",
                        help="served: temperature 0.7, as the load tests ask")
    parser.add_argument("--talker-sampling", choices=["greedy", "served"], default="greedy",
                        help="served: the service's default Talker sampling (top-k 50; the MTP's top-k 50 / top-p 0.8)")
    parser.add_argument("--max-seq-len", type=int, default=2048,
                        help="KV slot length, as in the benchmark layouts (a step that touched the whole cache would "
                        "show it here)")
    parser.add_argument("--no-sampling-kernel", action="store_true",
                        help="compiled: the Talker draws with inductor's fused sample instead of the Triton kernel")
    parser.add_argument("--no-code-predictor-kernels", action="store_true",
                        help="compiled: the code predictor's layers compiled by inductor instead of its Triton kernels")
    parser.add_argument("--persistent-code-predictor", action="store_true",
                        help="compiled: each code-predictor pass as one persistent CUDA kernel "
                        "(`engine.persistent_code_predictor`)")
    parser.add_argument("--persistent-l2-keep-percent", type=int, default=DEFAULT_PERSISTENT_L2_KEEP_PERCENT,
                        help="with --persistent-code-predictor: the share of its weights L2 is asked to keep from pass "
                        "to pass (`engine.persistent_code_predictor_l2_keep_percent`; 0: plain reads)")
    parser.add_argument("--persistent-draws", action="store_true",
                        help="with --persistent-code-predictor: each pass's launch also draws its codes, instead of the "
                        "Triton draw kernel after it (`engine.persistent_code_predictor_draws`)")
    parser.add_argument("--weights-evict-first", action="store_true",
                        help="the Triton GEMMs that read each weight once mark its lines first to go from L2 "
                        "(`small_batch.weights_evict_first`)")
    parser.add_argument("--no-moe-kernels", action="store_true",
                        help="decode batches' MoE expert GEMMs as grouped GEMMs instead of the Triton expert kernels")
    parser.add_argument("--no-moe-layer-kernels", action="store_true",
                        help="MoE layers' decode steps as the layers' own code instead of eight Triton kernels each "
                        "(`engine.moe_layer_kernels: false`)")
    parser.add_argument("--moe-layer-folds", action="store_true",
                        help="MoE layers' decode steps in six kernels: the routing inside the router GEMM's kernel, "
                        "the combine inside the down GEMM's (`engine.moe_layer_folds`)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=DEFAULT_PREFILL_GRAPH_TOKENS,
                        help="prefill batches whose bucket holds more padded tokens run without a graph, unbucketed "
                        "(`engine.prefill_graph_tokens`, the service's default; -1: every prefill from a graph)")
    parser.add_argument("--stages", default="thinker,talker")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.prefill_graph_tokens = None if args.prefill_graph_tokens < 0 else args.prefill_graph_tokens
    small_batch.set_weights_evict_first(args.weights_evict_first)
    config = Qwen3OmniMoeConfig.from_json_file(args.config)
    batches = [int(b) for b in args.batches.split(",")]
    dtype = DTYPES[args.dtype]
    stages = args.stages.split(",")
    floors = {(stage, batch): floor_ms(config, stage, batch) for stage in stages for batch in batches}  # before the GPU work
    rows = []
    if "thinker" in stages:
        rows += bench_thinker(config, args.device, dtype, batches, args.prompt, args.steps, not args.eager, args.compile,
                              args.max_seq_len, SERVED_THINKER if args.thinker_sampling == "served" else SamplingParams(temperature=0.0),
                              not args.no_moe_kernels, args.prefill_graph_tokens, not args.no_moe_layer_kernels,
                              args.moe_layer_folds)
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None
    if "talker" in stages:
        sampling = GREEDY_TALKER if args.talker_sampling == "greedy" else DEFAULT_TALKER_SAMPLING
        rows += bench_talker(config, args.device, dtype, batches, args.prompt, args.steps, not args.eager, args.compile,
                             sampling, args.max_seq_len, not args.no_sampling_kernel,
                             not args.no_code_predictor_kernels, not args.no_moe_kernels, args.prefill_graph_tokens,
                             not args.no_moe_layer_kernels, args.persistent_code_predictor, args.moe_layer_folds,
                             args.persistent_l2_keep_percent, args.persistent_draws)
    for row in rows:
        row["floor_ms"] = floors[row["stage"], row["batch"]]
    meta = run_meta("omni_ray.bench", argv, dtype=args.dtype, mode=("eager (no CUDA graphs)" if args.eager else "CUDA graphs")
                    + (", layers compiled" if args.compile else "")
                    + f", Thinker sampling {args.thinker_sampling}, Talker sampling {args.talker_sampling}"
                    + (" (inductor's fused draw)" if args.compile and args.no_sampling_kernel else "")
                    + (", code predictor compiled by inductor" if args.compile and args.no_code_predictor_kernels else "")
                    + (", code-predictor passes as one persistent kernel" if args.persistent_code_predictor else "")
                    + ((f" (L2 asked to keep {args.persistent_l2_keep_percent}% of its weights)"
                        if args.persistent_l2_keep_percent else " (plain reads: no L2 hints)")
                       if args.persistent_code_predictor else "")
                    + (", each pass's codes drawn in its launch" if args.persistent_code_predictor
                       and args.persistent_draws and not args.no_sampling_kernel else "")
                    + (", one-tile GEMMs' weights evict_first from L2" if args.weights_evict_first else "")
                    + (", MoE experts as grouped GEMMs" if args.no_moe_kernels else "")
                    + (", MoE layers' decode steps as the layers' own code" if args.no_moe_layer_kernels else "")
                    + (", MoE layers in six kernels (routing and combine folded)" if args.moe_layer_folds else "")
                    + (f", prefills over {args.prefill_graph_tokens} padded tokens without a graph"
                       if args.prefill_graph_tokens is not None else ", every prefill from a graph")
                    + f", KV slots of {args.max_seq_len} positions",
                    gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")
    write_results(args.out, "engine_steps", {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
