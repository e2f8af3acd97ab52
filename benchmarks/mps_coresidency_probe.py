"""Does the persistent code-predictor pass finish while another process's kernels share its GPU (under MPS)?

The pass (`omni_ray/layers/persistent_pass.py`) waits at grid barriers for all of its 128 blocks, so it needs them all
resident at once. Alone on a GPU they are. Under the MPS daemon, another process's kernels run beside it and hold
multiprocessors too: the Thinker's, in the 1-GPU layout. This probe replays the pass (1 row, as that layout serves
it) in a loop while a neighbour process runs a mix of the kernels a Thinker's prefill and decode launch (cuBLAS GEMMs
of prefill and decode shapes, flash attention, sorts and scans), and records whether each batch of passes finished
within `--stall-seconds`. A pass stuck past that is a deadlock: its context cannot be recovered, so the probe writes
its results and ends both processes.

    python -m benchmarks.mps_coresidency_probe --launch cooperative --seconds 60 --out DIR   (MPS daemon on)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from benchmarks.small_batch_bench import code_predictor_with_head, decode_step_inputs
from omni_ray.bench import FULL_CONFIG, run_meta, write_results
from omni_ray.layers.persistent_pass import PersistentPass

PASSES_A_BATCH = 150  # ten frames' passes between checks


def neighbour(seconds: float, progress: Path) -> None:
    """Kernels like a Thinker's, back to back for `seconds`; the rounds done go to `progress` every round."""
    torch.manual_seed(1)
    dev = "cuda"
    prefill_x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    prefill_w = torch.randn(2048, 6144, device=dev, dtype=torch.bfloat16)
    decode_x = torch.randn(32, 16384, device=dev, dtype=torch.bfloat16)  # small M, long K: split-K / stream-K GEMMs
    decode_w = torch.randn(16384, 2048, device=dev, dtype=torch.bfloat16)
    q = torch.randn(4, 32, 1024, 128, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(32, 151936, device=dev)
    routes = torch.randint(0, 128, (2048 * 8,), device=dev)
    rounds, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            prefill_x @ prefill_w
            decode_x @ decode_w
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            torch.sort(logits, dim=-1, descending=True)
            torch.cumsum(torch.bincount(routes, minlength=128), 0)
            torch.sort(routes, stable=True)
        torch.cuda.synchronize()
        rounds += 1
        progress.write_text(str(rounds))


def probe(cooperative: bool, seconds: float, stall_seconds: float, out: Path) -> dict[str, Any]:
    cfg = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG).talker_config.code_predictor_config
    stack, head = code_predictor_with_head(cfg)
    kernel = PersistentPass(stack, max_rows=1, cooperative=cooperative)
    kernel.build(cfg.vocab_size)
    cache, batch, x, (cos, sin) = decode_step_inputs(cfg, stack, 1, len(stack.layers))
    kernel.logits(x, cache.layers, batch, cos, sin, head)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(PASSES_A_BATCH):
            kernel.logits(x, cache.layers, batch, cos, sin, head)
    progress = out / "neighbour_rounds.txt"
    progress.write_text("0")
    other = subprocess.Popen([sys.executable, "-m", "benchmarks.mps_coresidency_probe", "--neighbour",
                              "--seconds", str(seconds + 5), "--out", str(out)])
    time.sleep(3)  # the neighbour's kernels are running
    batches, slowest, stalled, end = 0, 0.0, False, time.monotonic() + seconds
    while time.monotonic() < end and not stalled:
        done = torch.cuda.Event()
        started = time.monotonic()
        graph.replay()
        done.record()
        while not done.query():
            if time.monotonic() - started > stall_seconds:
                stalled = True
                break
            time.sleep(0.001)
        slowest = max(slowest, time.monotonic() - started)
        batches += not stalled
    neighbour_rounds = int(progress.read_text() or 0)
    other.kill()
    return {"launch": "cooperative" if cooperative else "plain", "seconds": seconds, "passes_a_batch": PASSES_A_BATCH,
            "batches_done": batches, "slowest_batch_s": round(slowest, 3), "stalled": stalled,
            "stall_seconds": stall_seconds, "neighbour_rounds": neighbour_rounds,
            "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or Path("/tmp/nvidia-mps").exists()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", choices=["cooperative", "plain"], default="cooperative")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--stall-seconds", type=float, default=10.0)
    parser.add_argument("--neighbour", action="store_true", help="run the neighbour's kernels only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.neighbour:
        neighbour(args.seconds, out / "neighbour_rounds.txt")
        return 0
    result = probe(args.launch == "cooperative", args.seconds, args.stall_seconds, out)
    document = run_meta("benchmarks.mps_coresidency_probe", argv, device=torch.cuda.get_device_name(), **result)
    table = "\n".join(["# The persistent pass beside another process's kernels: " + json.dumps(result), ""])
    write_results(out, f"mps_coresidency_{result['launch']}", document, table)
    sys.stdout.flush()
    os._exit(3 if result["stalled"] else 0)  # a stalled pass's context cannot be torn down: leave at once


if __name__ == "__main__":
    raise SystemExit(main())
