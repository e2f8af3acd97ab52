"""Relay latency and bandwidth between two processes: the pairwise-collective path (NCCL between GPUs) or CUDA IPC
(two processes on one GPU) against the host path (TCP), payloads 4 KB to 16 MB, each delivery checked bitwise
(SHA-256 of the bytes). Use it for changes to `omni_ray/relay` or to choose a transport for a layout. With
`--step-messages` it also times the pipeline's step messages on the host path in one process (a Talker step's codes, a
Thinker step's embeddings, for 1 / 8 / 32 requests): the frame codec alone (encode, then decode), and a message's
way through a loopback connection (send until delivered).

    python -m benchmarks.relay_bench --out DIR                                                    # two GPUs: NCCL
    python -m benchmarks.relay_bench --producer cuda:0 --consumer cuda:0 --modes ipc,host --out DIR  # one GPU: IPC
    python -m benchmarks.relay_bench --producer cpu --consumer cpu --modes host --step-messages --out DIR  # CPU"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import secrets
import statistics
import time
from typing import Any

import torch

from omni_ray.bench import run_meta, write_results
from omni_ray.relay import RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelayServer
from omni_ray.relay.auth import SECRET_ENV
from omni_ray.relay.collective import CollectiveReceiver
from omni_ray.relay.ipc import IpcReceiver
from omni_ray.relay.tcp import TcpTransport, decode_message, encode_message
from omni_ray.relay.transports import PlacementTransport, gpu_uuid

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _request_ids(iterations: int, modes: list[str]) -> list[str]:
    return [f"{mode}-{size}-{i}" for mode in modes for size in SIZES for i in range(iterations)]


def consumer(device: str, iterations: int, modes: list[str], conn: Any) -> None:
    """Receives every message, acks each at once, and returns the payload's digest on each size's first one."""

    async def main() -> None:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        endpoint = RelayEndpoint()
        server = RelayServer(endpoint)
        CollectiveReceiver(endpoint, dev, timeout_s=30)
        if dev.type == "cuda":
            IpcReceiver(endpoint, dev)
        conn.send(RelayPeer("consumer", await server.start("127.0.0.1"), str(dev), gpu_uuid(dev)))

        def on_item(item: RelayItem) -> None:
            tensor = item.tensors["x"].to(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            check = digest(tensor) if item.request_id.endswith("-0") else None
            conn.send((item.request_id, tensor.device.type, check, time.time()))

        for rid in _request_ids(iterations, modes):
            endpoint.claim(rid, on_item)
        await asyncio.Event().wait()

    asyncio.run(main())


async def produce(device: str, peer: RelayPeer, iterations: int, modes: list[str], conn: Any) -> list[dict[str, Any]]:
    dev = torch.device(device)
    loop = asyncio.get_running_loop()
    rows = []
    transports = {mode: PlacementTransport(dev, mode) for mode in modes}  # type: ignore[arg-type]
    for mode in modes:
        transport = transports[mode]
        for size in SIZES:
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8, device=dev)
            times, sent, delivered = [], [], []
            for i in range(iterations):
                rid = f"{mode}-{size}-{i}"
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                start, wall_start = time.perf_counter(), time.time()
                tensor = payload.cpu() if transport.needs_host_tensors(peer, size) else payload  # what a stage does
                await transport.send(peer, RelayMessage("producer", [RelayItem(rid, tensors={"x": tensor}, seq=0)]))
                sent.append(time.perf_counter() - start)
                got_rid, got_device, check, delivered_at = await loop.run_in_executor(None, conn.recv)
                times.append(time.perf_counter() - start)
                delivered.append(delivered_at - wall_start)  # one clock for both processes (same machine)
                assert got_rid == rid, (got_rid, rid)
                if check is not None and check != digest(payload):
                    raise AssertionError(f"{mode} {size} bytes: the delivered bytes differ")

            def p50_us(values: list[float]) -> float:
                return statistics.median(values[3:] if len(values) > 4 else values) * 1e6

            latency = p50_us(times)
            rows.append({"mode": mode, "bytes": size, "latency_us_p50": latency,
                         "latency_us_min": min(times[3:] if len(times) > 4 else times) * 1e6,
                         "gb_per_s": size / latency * 1e-3, "sent_us_p50": p50_us(sent),
                         "delivered_us_p50": p50_us(delivered), "bitwise_equal": True, "received_on": got_device,
                         "transport": type(transport.select(peer)).__name__})
            print(json.dumps(rows[-1]), flush=True)
    return rows


STEP_REQUESTS = (1, 8, 32)


def step_message(kind: str, requests: int) -> RelayMessage:
    """One step's message as the stages send it: a Talker's frame of 16 code groups per request (int64, with the
    step's clock), or a Thinker's text embedding per request (bf16, 2048 wide)."""
    items = []
    for i in range(requests):
        if kind == "talker":
            items.append(RelayItem(f"req-{i}", tensors={"codes": torch.randint(0, 2048, (16, 1))},
                                   meta={"clock": 1234}, seq=100))
        else:
            items.append(RelayItem(f"req-{i}", tensors={"text_embed": torch.randn(2048).to(torch.bfloat16)}, seq=100))
    return RelayMessage("producer", items)


def _median_of_rounds(sample: Any, rounds: int, per_round: int) -> float:
    """The median over `rounds` of each round's median time (µs) of `sample()` (one call, timed)."""
    medians = []
    for _ in range(rounds):
        times = []
        for _ in range(per_round):
            start = time.perf_counter()
            sample()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return statistics.median(medians) * 1e6


async def step_message_rows(rounds: int = 7, per_round: int = 200) -> list[dict[str, Any]]:
    """Per step message: the codec's encode and decode (µs), and send-until-delivered through a loopback connection
    in this process (µs; sender and receiver share one event loop, so it is the whole CPU cost of a message)."""
    endpoint = RelayEndpoint()
    server = RelayServer(endpoint)
    peer = RelayPeer("consumer", await server.start("127.0.0.1"))
    transport = TcpTransport()
    delivered: asyncio.Queue[str] = asyncio.Queue()
    rows = []
    for kind in ("talker", "thinker"):
        for requests in STEP_REQUESTS:
            message = step_message(kind, requests)
            encode_us = _median_of_rounds(lambda: encode_message(message), rounds, per_round)
            frame = b"".join(encode_message(message))
            decode_us = _median_of_rounds(lambda: decode_message(bytearray(frame)), rounds, per_round)
            times = []
            for round_index in range(rounds):
                round_times = []
                for i in range(per_round // 4):
                    # fresh request ids each time (the endpoint checks each request's order), made before the clock
                    tag = f"{kind}-{requests}-{round_index}-{i}"
                    sent = RelayMessage("producer", [RelayItem(f"{item.request_id}-{tag}", item.kind, item.tensors,
                                                               item.meta, 0) for item in message.items])
                    for item in sent.items:
                        endpoint.claim(item.request_id, lambda got: delivered.put_nowait(got.request_id))
                    start = time.perf_counter()
                    await transport.send(peer, sent)
                    while await delivered.get() != sent.items[-1].request_id:
                        pass
                    round_times.append(time.perf_counter() - start)
                    for item in sent.items:
                        endpoint.release(item.request_id)
                times.append(statistics.median(round_times))
            rows.append({"message": kind, "requests": requests, "frame_bytes": len(frame),
                         "encode_us_p50": encode_us, "decode_us_p50": decode_us,
                         "loopback_us_p50": statistics.median(times) * 1e6})
            print(json.dumps(rows[-1]), flush=True)
    await server.close()
    return rows


def step_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["", "The pipeline's step messages on the host path, in one process: the frame codec (encode, decode) and "
             "a message's way through a loopback connection (send until delivered, sender and receiver on one event "
             "loop). Medians of 7 rounds' medians.", "",
             "| step message | requests | frame bytes | encode (µs) | decode (µs) | loopback send→delivered (µs) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        label = "Talker: codes (16×1 int64) + clock" if row["message"] == "talker" else "Thinker: text_embed (2048 bf16)"
        lines.append(f"| {label} | {row['requests']} | {row['frame_bytes']} | {row['encode_us_p50']:.1f} | "
                     f"{row['decode_us_p50']:.1f} | {row['loopback_us_p50']:.0f} |")
    return "\n".join(lines) + "\n"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fast = [m for m in modes if m != "host"]
    lines = [f"# Relay latency per step message ({meta['devices']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`", "",
             "One message per step: the producer sends, the consumer acks over a pipe on delivery (so each time includes "
             "one pipe hop, ~tens of µs). The host path includes the device→host copy a stage makes before sending "
             "and the consumer's host→device copy. Every size's first delivery is checked bitwise (SHA-256).", "",
             "| payload | " + " | ".join(f"{m} p50 (µs) | {m} GB/s" for m in modes) + " | "
             + " | ".join(f"{m} speed-up vs host" for m in fast) + " |",
             "|---|" + "---|---|" * len(modes) + "---|" * len(fast)]
    by = {(r["mode"], r["bytes"]): r for r in rows}
    for size in SIZES:
        label = f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"
        cells = [f"{by[(m, size)]['latency_us_p50']:.0f} | {by[(m, size)]['gb_per_s']:.2f}" for m in modes]
        gains = [f"{by[('host', size)]['latency_us_p50'] / by[(m, size)]['latency_us_p50']:.1f}x" if "host" in modes
                 else "–" for m in fast]
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(gains) + " |")
    lines += ["", "Where the time goes, p50 µs from the send's start: the producer's `send` returned / the consumer "
              "delivered the message / the producer got the ack.", "",
              "| payload | " + " | ".join(f"{m}: sent / delivered / acked" for m in modes) + " |",
              "|---|" + "---|" * len(modes)]
    for size in SIZES:
        label = f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"
        cells = [f"{by[(m, size)].get('sent_us_p50', 0):.0f} / {by[(m, size)].get('delivered_us_p50', 0):.0f} / "
                 f"{by[(m, size)]['latency_us_p50']:.0f}" for m in modes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay_bench", description=__doc__)
    parser.add_argument("--producer", default="cuda:0")
    parser.add_argument("--consumer", default="cuda:1")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--modes", default="collective,host", help="relay modes to compare, e.g. ipc,host on one GPU")
    parser.add_argument("--step-messages", action="store_true",
                        help="also time the pipeline's step messages on the host path, in this process")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))  # one relay secret for both processes (the child inherits)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=consumer, args=(args.consumer, args.iterations, modes, theirs), daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 120
        while not ours.poll(1):
            if not process.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the consumer process did not start (exit code {process.exitcode})")
        peer = ours.recv()
        rows = asyncio.run(produce(args.producer, peer, args.iterations, modes, ours))
    finally:
        process.kill()
    gpu = f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""
    meta = run_meta("benchmarks.relay_bench", argv, devices=f"{args.producer} → {args.consumer}{gpu}")
    document: dict[str, Any] = {"meta": meta, "rows": rows}
    table = markdown(meta, rows)
    if args.step_messages:
        document["step_messages"] = asyncio.run(step_message_rows())
        table += step_markdown(document["step_messages"])
    write_results(args.out, "relay", document, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
