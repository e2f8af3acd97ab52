"""Where the tiny CPU service's first audio waits, from the host's side. Runs the shipped tiny layout on Ray Serve
with short streamed chat replies (text + audio) at a few concurrencies, and reports each point of a reply's way to
its first audio as a mean from /metrics, plus the client's TTFA. Use it for changes to the serving path (Serve
transport, event loops, the ingress), where the model's own time is small; GPU runs measure the model
(`benchmarks/e2e_serve.py`). CPU only: no GPU needed.

    python -m benchmarks.serve_path_bench --concurrency 1,4 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.e2e_serve import URL, histogram_means, scrape
from omni_ray.bench import run_meta, write_results
from omni_ray.serve.metrics import FIRST_AUDIO_WAY

LAYOUT = Path(__file__).resolve().parent.parent / "deployments" / "tiny_cpu.yaml"
# the way to the first audio, the ingress's side (received ≈ sent)
POINTS = tuple(key for key in FIRST_AUDIO_WAY if key != "first_audio_received")
BODY = {"model": "qwen3-omni", "messages": [{"role": "user", "content": "Hello there, tell me something."}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
        "max_completion_tokens": 16}


async def _reply(client: httpx.AsyncClient) -> float | None:
    """One streamed reply read to its end; seconds to its first audio chunk (None: none came)."""
    start = time.perf_counter()
    first = None
    headers = {"X-Request-Start": f"t={time.time_ns() // 1000}"}
    async with client.stream("POST", f"{URL}/v1/chat/completions", json=BODY, timeout=120, headers=headers) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and _has_audio(json.loads(line[len("data: "):])):
                first = time.perf_counter() - start
    return first


def _has_audio(chunk: dict[str, Any]) -> bool:
    """Does this chat-completion chunk carry audio samples?"""
    return any(((choice.get("delta") or {}).get("audio") or {}).get("data") for choice in chunk.get("choices") or [])


async def _level(concurrency: int, rounds: int) -> list[float | None]:
    async with httpx.AsyncClient() as client:
        ttfa: list[float | None] = []
        for _ in range(rounds):
            ttfa += await asyncio.gather(*(_reply(client) for _ in range(concurrency)))
        return ttfa


def measure(concurrency: int, rounds: int) -> dict[str, Any]:
    before = scrape()
    ttfa = [t for t in asyncio.run(_level(concurrency, rounds)) if t is not None]
    means = {key: mean for key, mean in histogram_means(before, scrape()).items() if mean is not None}
    return {"concurrency": concurrency, "requests": concurrency * rounds, "with_audio": len(ttfa),
            "client_ttfa_ms_p50": 1000 * statistics.median(ttfa) if ttfa else None, "server_mean_ms": means}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = " / ".join(p.replace("_", " ") for p in POINTS)
    lines = [f"# The tiny CPU service's way to the first audio ({meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`; {meta['host']}. Server points are means over "
             "the level's replies from /metrics, in ms after the ingress submitted the request; the client's TTFA is "
             "its p50.", "",
             f"| concurrency | replies with audio | client TTFA p50 (ms) | server: {head} (ms) |", "|---|---|---|---|"]
    for r in rows:
        points = " / ".join(f"{r['server_mean_ms'][p]:.1f}" if p in r["server_mean_ms"] else "–" for p in POINTS)
        ttfa = "–" if r["client_ttfa_ms_p50"] is None else f"{r['client_ttfa_ms_p50']:.1f}"
        lines.append(f"| {r['concurrency']} | {r['with_audio']}/{r['requests']} | {ttfa} | {points} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of `concurrency` replies per level")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stem", default="serve_path")
    args = parser.parse_args(argv)
    import ray
    from ray import serve

    from omni_ray.serve.app import app_from_serve_config, start_serve

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        app, spec = app_from_serve_config(LAYOUT)
        start_serve(spec, {"host": "127.0.0.1", "port": 8000})
        serve.run(app, name=spec["name"], route_prefix=spec["route_prefix"])
        while httpx.get(f"{URL}/ready", timeout=5).status_code != 200:
            time.sleep(0.2)
        asyncio.run(_level(1, 3))  # warm-up
        rows = [measure(int(c), args.rounds) for c in args.concurrency.split(",")]
    finally:
        serve.shutdown()
        ray.shutdown()
    meta = run_meta("benchmarks.serve_path_bench", argv, host=f"{os.cpu_count()} CPU cores, no GPU")
    write_results(args.out, args.stem, {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
