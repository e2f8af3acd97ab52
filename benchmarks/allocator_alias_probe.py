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

A second check replays the service's capture order: a second `GraphCache` (one shared pool, as a runner's) first
captures "prefill" step functions whose freed intermediates are small int64 tensors holding the prompt length (113),
then "decode" ones that allocate their stream's kept tensor inside the capture (the capture stream's first ask, as
the counters were). It reports whether a kept tensor sits on an earlier graph's freed intermediate, and whether
replaying the prefill graphs writes over a kept tensor set to a sentinel.

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
_kept_in_capture: set[int] = set()  # the streams whose kept tensor a capture allocated


def _kept_for_stream(device: torch.device) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).stream_id
    if stream not in _kept:
        _kept[stream] = torch.zeros(8, dtype=torch.int32, device=device)
        if torch.cuda.is_current_stream_capturing():
            _kept_in_capture.add(stream)
    return _kept[stream]


def _step(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    kept = _kept_for_stream(x.device)
    kept.add_(0)  # read and written by the step, as the counters were
    h = torch.relu(x @ w)
    return {"out": (h @ w.T).sum(-1), "norm": h.float().pow(2).mean(-1)}


_prefill_intermediates: list[tuple[int, int]] = []  # address ranges the prefill captures allocated and freed


def _prefill(x: torch.Tensor, length: torch.Tensor) -> dict[str, torch.Tensor]:
    lengths = length.to(torch.int64).expand(x.shape[0]).clone()  # int64, [rows]: as a step's sequence lengths
    positions = lengths - 1
    starts = torch.cumsum(lengths, 0) - lengths
    if torch.cuda.is_current_stream_capturing():
        _prefill_intermediates.extend(_ranges([lengths, positions, starts]))
    return {"out": x.float().sum(-1) + (positions + starts).float()}


def _capture_order_check(device: torch.device, width: int) -> dict[str, Any]:
    """Prefill graphs first, then decode graphs that keep a capture-time tensor: overlap and replay checks."""
    graphs = GraphCache(device, enabled=True)
    w = torch.randn(width, width, device=device, dtype=torch.bfloat16)
    length = torch.tensor([113], dtype=torch.int32, device=device)
    for rows in (1, 2, 4, 8):
        graphs.run(("prefill", rows), _prefill, {"x": torch.randn(rows, width, device=device), "length": length})
    before = set(_kept)
    for rows in (1, 2, 4):
        graphs.run(("decode", rows), _step, {"x": torch.randn(rows, width, device=device, dtype=torch.bfloat16),
                                             "w": w})
    capture_kept = [_kept[stream] for stream in (set(_kept) - before) & _kept_in_capture]
    overlaps = [[start, end] for start, end in _ranges(capture_kept)
                for low, high in _prefill_intermediates if start < high and low < end]
    sentinel = -7
    for kept in capture_kept:
        kept.fill_(sentinel)
    for rows in (1, 2, 4, 8):
        graphs.run(("prefill", rows), _prefill, {"x": torch.randn(rows, width, device=device), "length": length})
    torch.cuda.synchronize(device)
    written = [kept.tolist() for kept in capture_kept if bool((kept != sentinel).any())]
    return {"kept_in_captures": len(capture_kept), "kept_on_prefill_intermediates": overlaps,
            "kept_written_by_prefill_replays": written,
            "verdict": ("a prefill replay wrote over a kept tensor" if written else
                        "a kept tensor sits on a prefill intermediate" if overlaps else "no overlap")}


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
    capture_order = _capture_order_check(device, args.width)
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
               "verdict": "a fresh tensor overlapped a live one" if aliases else "no overlap",
               "capture_order": capture_order}
    table = (f"# allocator alias probe\n\n{results['alloc_conf'] or 'default allocator'}: {checked} fresh tensors "
             f"checked over {args.rounds} rounds ({pressure_rounds} out-of-memory releases), {len(_kept)} kept "
             f"tensors, {len(graphs)} graphs: {results['verdict']}\n\ncapture order (prefill graphs, then decode graphs "
             f"keeping a tensor allocated in their capture): {capture_order['kept_in_captures']} kept, "
             f"{capture_order['verdict']}; kept values after the prefill replays: "
             f"{capture_order['kept_written_by_prefill_replays'] or 'unchanged'}\n")
    write_results(args.out, "allocator_alias", results, table)


if __name__ == "__main__":
    main()
