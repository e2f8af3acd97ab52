"""Does PyTorch's caching allocator hand out memory that a live tensor still holds, under `expandable_segments:True`?

Session 52 found an int64 0x71 written over the persistent pass's barrier counters in the 1-GPU service on an H100:
a small tensor allocated inside a CUDA graph capture (the runner's shared private pool) and kept alive, in a process
whose allocator ran with expandable segments near a full GPU. 113 is about a first request's Talker prompt length, and
the write sat at the counters' first bytes, as the first element of a fresh upload of the step's host inputs would.
This probe replays that pattern alone and checks each fresh allocation's address against every live tensor kept:
- `GraphCache` (the runners' class) captures step functions of a few buckets; each capture allocates a small
  persistent tensor the first time its stream asks (as the counters were), plus intermediates and outputs;
- then rounds of: `upload`s of small host inputs (as a step's launch), eager temporaries on the default stream and
  on side streams, replays, lazy captures of new buckets, and (`--pressure`) allocations up to an out-of-memory error,
  which makes the allocator release its cached blocks, freed again.
Any fresh tensor whose bytes overlap a live kept tensor's is an alias: the probe counts them and writes the first few.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.allocator_alias_probe --out DIR
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path
from typing import Any

import torch

from omni_ray.bench import run_meta, write_results
from omni_ray.engine.cuda_graphs import GraphCache
from omni_ray.engine.host_inputs import upload

_kept: dict[int, torch.Tensor] = {}  # stream id -> the small tensor its first capture or launch allocated


def _kept_for_stream(device: torch.device) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).stream_id
    if stream not in _kept:
        _kept[stream] = torch.zeros(8, dtype=torch.int32, device=device)
    return _kept[stream]


def _step(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    kept = _kept_for_stream(x.device)
    kept.add_(0)  # read and written by the step, as the counters were
    h = torch.relu(x @ w)
    return {"out": (h @ w.T).sum(-1), "norm": h.float().pow(2).mean(-1)}


def _ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors if t.numel()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--pressure", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rng = random.Random(0)
    w = torch.randn(args.width, args.width, device=device, dtype=torch.bfloat16)
    graphs = GraphCache(device, enabled=True)
    inputs = {rows: {"x": torch.randn(rows, args.width, device=device, dtype=torch.bfloat16), "w": w}
              for rows in (1, 2, 4, 8, 16, 32, 64)}
    outputs = {rows: graphs.run(("step", rows), _step, inputs[rows]) for rows in (1, 2, 4, 8)}
    side = [torch.cuda.Stream(device) for _ in range(3)]
    aliases: list[dict[str, Any]] = []
    checked = pressure_rounds = 0
    for round_index in range(args.rounds):
        live = list(_kept.values()) + [t for out in outputs.values() for t in out.values()]
        live_ranges = _ranges(live)
        fresh: list[tuple[str, torch.Tensor]] = []
        host = {f"h{i}": torch.randint(0, 1000, (rng.choice([1, 2, 4, 8, 32]),)) for i in range(rng.randint(1, 6))}
        fresh += [("upload", t) for t in upload(host, device).values()]
        fresh.append(("temporary", torch.empty(rng.choice([8, 64, 512, 4096, 1 << 16]), device=device)))
        with torch.cuda.stream(rng.choice(side)):
            fresh.append(("side stream", torch.empty(rng.choice([16, 256, 2048]), device=device)))
        rows = rng.choice([1, 2, 4, 8, 16, 32, 64])
        outputs[rows] = graphs.run(("step", rows), _step, inputs[rows])  # replays, or a lazy capture of a new bucket
        if args.pressure and round_index % 500 == 250:
            hogs = []
            try:
                while True:
                    hogs.append(torch.empty(1 << 30, dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError:  # the allocator released its cached blocks before giving up
                pass
            hogs.clear()
            pressure_rounds += 1
        for kind, tensor in fresh:
            start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.untyped_storage().nbytes()
            checked += 1
            for live_start, live_end in live_ranges:
                if start < live_end and live_start < end and len(aliases) < 20:
                    aliases.append({"round": round_index, "kind": kind, "fresh": [start, end],
                                    "live": [live_start, live_end]})
        torch.cuda.synchronize()
    results = {**run_meta("benchmarks.allocator_alias_probe", None, gpu=torch.cuda.get_device_name()), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "rounds": args.rounds,
               "fresh_tensors_checked": checked, "kept_tensors": len(_kept), "graphs": len(graphs),
               "pressure_rounds": pressure_rounds, "aliases": aliases,
               "verdict": "a fresh tensor overlapped a live one" if aliases else "no overlap"}
    table = (f"# allocator alias probe\n\n{results['alloc_conf'] or 'default allocator'}: {checked} fresh tensors "
             f"checked over {args.rounds} rounds ({pressure_rounds} out-of-memory releases), {len(_kept)} kept "
             f"tensors, {len(graphs)} graphs: {results['verdict']}\n")
    write_results(args.out, "allocator_alias", results, table)


if __name__ == "__main__":
    main()
