"""Talker engine lanes at full size (random weights): N lanes of B/N rows stepping at once against one lane of B rows."""

from __future__ import annotations

import argparse
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import (DEFAULT_TALKER_SAMPLING, DTYPES, FULL_CONFIG, _talker_seqs, launched_ahead, run_meta,
                            write_results)
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.loop import lower_gil_switch_interval
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker

# What this measures: a Talker step at 8-32 rows is a latency-bound chain (the code predictor's 15 passes) after a
# bandwidth-bound one (20 MoE layers). Lanes (`talker.engine.lanes`) run their shares of the streams as separate
# engine loops, each in its own thread on its own CUDA stream, so one lane's code predictor may overlap the other's
# MoE layers. Each stream's frame period is then the time for every lane to finish its steps, against one lane's
# step at all B rows. As served: each lane a TalkerRunner of its own (KV slots, graphs) over one copy of the weights,
# graphs captured at warmup on the lane's stream, steps launched ahead, the service's GIL switch interval.


class Lane:
    """One lane: a runner over the shared weights, its stream (None: the default stream, as one lane is served) and
    a batch of requests."""

    def __init__(self, assets: Any, config: Any, rows: int, slot_len: int, device: str, dtype: torch.dtype,
                 stream: torch.cuda.Stream | None, compiled: bool) -> None:
        text = config.talker_config.text_config
        cache = SlotKVCache(text.num_hidden_layers, rows, slot_len, text.num_key_value_heads, text.head_dim, dtype,
                            device)
        on_gpu = device.startswith("cuda")
        self.runner = TalkerRunner(assets, config, cache, rows, cuda_graphs=on_gpu, compile_layers=compiled)
        self.rows, self.stream, self.on_gpu = rows, stream, on_gpu
        with self._on_stream():
            self.runner.warmup(rows)

    def _on_stream(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _wait(self) -> None:
        if self.on_gpu:
            torch.cuda.current_stream().synchronize()

    def run(self, seqs: list[TalkerSequence], steps: int, start: threading.Barrier | None, out: dict[str, float]) -> None:
        """Admit `seqs`, prefill and take one step, wait at `start` (with the other lanes), then `steps` steps
        launched ahead; `out` gets the timed stretch's start and end (perf_counter seconds)."""
        with self._on_stream():
            for seq in seqs:
                self.runner.admit(seq)
            self.runner.step(seqs)  # the prefill
            self.runner.step(seqs)
            self._wait()
            if start is not None:
                start.wait()
            out["start"] = time.perf_counter()
            launched_ahead(self.runner.launch, self.runner.collect, seqs, steps)
            self._wait()
            out["end"] = time.perf_counter()
            for seq in seqs:
                self.runner.release(seq)


def frame_period_ms(lanes: list[Lane], seq_sets: list[list[TalkerSequence]], steps: int) -> dict[str, Any]:
    """Every lane's `steps` steps at once, each in its own thread: ms per step from the first lane's start to the last
    lane's end (each stream's frame period), and each lane's own ms per step."""
    start = threading.Barrier(len(lanes)) if len(lanes) > 1 else None
    outs: list[dict[str, float]] = [{} for _ in lanes]
    threads = [threading.Thread(target=lane.run, args=(seqs, steps, start, out))
               for lane, seqs, out in zip(lanes, seq_sets, outs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if any("end" not in out for out in outs):
        raise RuntimeError("a lane's thread failed (see its traceback above)")
    period = (max(o["end"] for o in outs) - min(o["start"] for o in outs)) * 1000 / steps
    return {"frame_period_ms": period, "lane_step_ms": [(o["end"] - o["start"]) * 1000 / steps for o in outs]}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Talker engine lanes ({meta['gpu']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`", "",
             "Each stream's frame period: ms from the first lane's timed step to the last lane's end, per step, "
             "with every lane stepping at once (launched ahead, each lane in its own thread on its own CUDA stream, "
             "one copy of the weights). One lane runs on the default stream, as served. Rounds are timed one after the "
             "other, alternating the layouts.", "",
             "| streams | lanes x rows | frame period (ms), each round | best | each lane's step (ms), best round | vs one lane (best) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        best = min(r["frame_period_ms"])
        lane_steps = r["lane_step_ms"][r["frame_period_ms"].index(best)]
        lines.append(f"| {r['streams']} | {r['lanes']} x {r['rows_per_lane']} | "
                     f"{', '.join(f'{p:.2f}' for p in r['frame_period_ms'])} | {best:.2f} | "
                     f"{', '.join(f'{s:.2f}' for s in lane_steps)} | {best / r['one_lane_best_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.talker_lanes_bench", description=__doc__)
    parser.add_argument("--config", default=str(FULL_CONFIG))
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (eager, one stream: checks the benchmark only)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--streams", default="16,32", help="total rows (streams), split evenly over the lanes")
    parser.add_argument("--lanes", default="2", help="lane counts to set against one lane, e.g. 2,4")
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=2048, help="KV slot length (served: 2048)")
    parser.add_argument("--no-compile", action="store_true", help="the layers as eager code (served: compiled)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(args.config)
    dtype, device = DTYPES[args.dtype], args.device
    on_gpu = device.startswith("cuda")
    compiled = on_gpu and not args.no_compile
    streams = [int(s) for s in args.streams.split(",")]
    lane_counts = [int(n) for n in args.lanes.split(",")]
    if any(total % n for total in streams for n in lane_counts):
        raise SystemExit("every --streams count must split evenly over every --lanes count")
    lower_gil_switch_interval()
    slot_len = max(args.max_seq_len, args.prompt + 2 * args.steps + 32)
    assets = load_talker(None, config, device, dtype)
    rows = []
    for total in streams:
        layouts = {1: [Lane(assets, config, total, slot_len, device, dtype, None, compiled)]}
        for n in lane_counts:
            layouts[n] = [Lane(assets, config, total // n, slot_len, device, dtype,
                               torch.cuda.Stream(device) if on_gpu else None, compiled) for _ in range(n)]
        results: dict[int, list[dict[str, Any]]] = {n: [] for n in layouts}
        for round_ in range(args.rounds + 1):  # round 0 untimed: lazily built state, allocator growth
            for n, lanes in layouts.items():
                seq_sets = [_talker_seqs(config, lane.rows, args.prompt, args.steps, DEFAULT_TALKER_SAMPLING, device, dtype)
                            for lane in lanes]
                result = frame_period_ms(lanes, seq_sets, args.steps)
                if round_:
                    results[n].append(result)
        one_best = min(r["frame_period_ms"] for r in results[1])
        for n, runs in results.items():
            rows.append({"streams": total, "lanes": n, "rows_per_lane": total // n,
                         "frame_period_ms": [r["frame_period_ms"] for r in runs],
                         "lane_step_ms": [r["lane_step_ms"] for r in runs], "one_lane_best_ms": one_best})
        del layouts
        if on_gpu:
            torch.cuda.empty_cache()
    meta = run_meta("benchmarks.talker_lanes_bench", argv, gpu=torch.cuda.get_device_name() if on_gpu else "cpu",
                    dtype=args.dtype, sampling="served", compiled=compiled)
    write_results(args.out, "talker_lanes", {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
