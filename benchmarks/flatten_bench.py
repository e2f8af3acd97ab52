"""What packing one relay message costs the producer: the Thinker's prefill message to the Talker at a few request
counts (per request the user turn's states [100, 2048] bf16, its multimodal mask [100] bool, the assistant prefix
[3, 2048] bf16, and the first token's embedding [2048] bf16, as in Qwen3-Omni-30B-A3B), flattened into a ring-slot
sized buffer: the torch ops one `flatten` runs (each a kernel launch and the relay thread's time on a GPU) and its
wall time on this machine's device.

    python -m benchmarks.flatten_bench --device cpu --requests 1,8,32 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.op_counts import count_ops, ops_cell
from omni_ray.bench import run_meta, write_results
from omni_ray.relay.channel import RelayItem, RelayMessage
from omni_ray.relay.collective import flatten, pack

USER_POSITIONS, HIDDEN = 100, 2048


def prefill_message(requests: int, device: torch.device) -> RelayMessage:
    items = []
    for index in range(requests):
        prefix = {
            "user_states": torch.randn(USER_POSITIONS, HIDDEN, device=device).bfloat16(),
            "user_multimodal": torch.zeros(USER_POSITIONS, dtype=torch.bool, device=device),
            "assistant_prefix": torch.randn(3, HIDDEN, device=device).bfloat16(),
        }
        items.append(RelayItem(f"request-{index}", tensors=prefix))
        items.append(RelayItem(f"request-{index}", tensors={"text_embed": torch.randn(HIDDEN, device=device).bfloat16()}))
    return RelayMessage("thinker", items)


def measure(requests: int, device: torch.device, repeats: int) -> dict[str, Any]:
    _, tensors, nbytes = pack(prefill_message(requests, device))
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        flatten(tensors, nbytes, device, out=out)
    ops = count_ops(lambda: flatten(tensors, nbytes, device, out=out))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flatten(tensors, nbytes, device, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"requests": requests, "tensors": len(tensors), "mib": nbytes / 2**20, "ops": ops,
            "flatten_ms_p50": statistics.median(times)}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Packing the Thinker's prefill message ({meta.get('device', '')})", "",
             f"commit `{meta.get('commit', '')}`, command `{meta.get('command', '')}`", "",
             "| requests | tensors | MiB | torch ops in one flatten | flatten p50 (ms) |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['requests']} | {row['tensors']} | {row['mib']:.1f} | {ops_cell(row['ops'])} "
                     f"| {row['flatten_ms_p50']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flatten_bench", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="flatten_bench")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = [measure(int(count), device, args.repeats) for count in args.requests.split(",")]
    meta = run_meta("benchmarks.flatten_bench", argv, device=str(device))
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
