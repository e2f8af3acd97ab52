"""A soak: 4 concurrent mixed requests for OMNI_RAY_SOAK_S seconds (300 by default): none lost or hung, and no replica
process's resident memory grows by 5 % or more from the first minute after warm-up to the last."""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from omni_ray.config import FAMILY_STAGES
from _service import MODEL, StreamRecord, Tally, app_pids, chat_body, own_app, record, rss_kib, stream_chat, wav_b64

APP, PREFIX = "soak", "/soak"
SOAK_S = float(os.environ.get("OMNI_RAY_SOAK_S", "300"))
WARMUP_S = min(60.0, SOAK_S / 5)  # allocators and caches settle first
WINDOW_S = min(60.0, (SOAK_S - WARMUP_S) / 4)  # RSS: median of the first window after warm-up vs of the last
CONCURRENCY = 4
READ_TIMEOUT_S = 60.0  # no byte for this long: hung
HUNG_AFTER_S = 120.0  # a request running longer than this counts as hung too
RSS_GROWTH_LIMIT = 0.05
SAMPLE_EVERY_S = 2.0
DEPLOYMENTS = ("ingress", *FAMILY_STAGES["qwen3_omni"])
AUDIO_IN = wav_b64(1.5)
SPEECH = {"model": MODEL, "voice": "ethan", "input": "The soak test keeps the service busy for a while."}


def _stream_chat(url: str) -> str | None:
    rec = StreamRecord()
    stream_chat(url, chat_body("Tell me about the sea.", stream=True, audio=True, max_tokens=16, ignore_eos=True), rec,
                timeout=READ_TIMEOUT_S)
    return None if rec.ok and rec.audio_chunks > 0 else f"stream chat: {rec}"


def _whole_chat(url: str) -> str | None:
    response = httpx.post(f"{url}/v1/chat/completions", json=chat_body("What is two plus two?", stream=False, audio=False,
                                                                      max_tokens=16), timeout=READ_TIMEOUT_S)
    ok = response.status_code == 200 and isinstance(response.json()["choices"][0]["message"]["content"], str)
    return None if ok else f"whole chat: {response.status_code} {response.text[:200]}"


def _audio_in_chat(url: str) -> str | None:
    body = chat_body("What do you hear?", stream=False, audio=True, max_tokens=12, ignore_eos=True, audio_in=AUDIO_IN)
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=READ_TIMEOUT_S)
    ok = response.status_code == 200 and (response.json()["choices"][0]["message"].get("audio") or {}).get("data")
    return None if ok else f"audio-in chat: {response.status_code} {response.text[:200]}"


def _speech_stream(url: str) -> str | None:
    size, status = 0, None
    with httpx.stream("POST", f"{url}/v1/audio/speech", json={**SPEECH, "response_format": "pcm", "stream": True},
                      timeout=READ_TIMEOUT_S) as response:
        status = response.status_code
        for chunk in response.iter_bytes():
            size += len(chunk)
    return None if status == 200 and size > 0 and size % 2 == 0 else f"speech stream: {status}, {size} bytes"


def _speech_whole(url: str) -> str | None:
    response = httpx.post(f"{url}/v1/audio/speech", json={**SPEECH, "response_format": "wav"}, timeout=READ_TIMEOUT_S)
    ok = response.status_code == 200 and response.content[:4] == b"RIFF" and len(response.content) > 44
    return None if ok else f"speech: {response.status_code} {response.content[:200]!r}"


KINDS: dict[str, Callable[[str], str | None]] = {
    "chat_stream_audio": _stream_chat, "chat_whole_text": _whole_chat, "chat_audio_in": _audio_in_chat,
    "speech_stream": _speech_stream, "speech_whole": _speech_whole,
}


@pytest.fixture(scope="module")
def soak_url(serve_url: str) -> Iterator[str]:
    """Its own application, one replica per deployment, so that the processes measured serve only the soak."""
    with own_app(serve_url, APP, PREFIX, {"model_name": MODEL}) as url:
        yield url


def _percentile(values: list[float], q: float) -> float | None:
    return round(statistics.quantiles(values, n=100)[int(q) - 1], 3) if len(values) >= 2 else (values[0] if values else None)


@pytest.mark.timeout(int(SOAK_S) + 600)
def test_soak_loses_no_request_and_keeps_memory_flat(soak_url: str) -> None:
    pids = app_pids(APP, DEPLOYMENTS)
    assert len(pids) == len(DEPLOYMENTS), pids
    tally, failures, latencies = Tally(), [], {kind: [] for kind in KINDS}
    lock = threading.Lock()
    started = time.monotonic()
    stop_at = started + SOAK_S

    def worker(offset: int) -> None:
        kinds = list(KINDS)
        i = offset
        while time.monotonic() < stop_at:
            kind = kinds[i % len(kinds)]
            i += 1
            t0 = time.monotonic()
            try:
                failure = KINDS[kind](soak_url)
            except Exception as exc:  # a timeout or a broken connection: lost
                failure = f"{kind}: {exc!r}"
            elapsed = time.monotonic() - t0
            if failure is None and elapsed > HUNG_AFTER_S:
                failure = f"{kind}: took {elapsed:.0f} s"
            tally.add("failed" if failure else "ok")
            with lock:
                latencies[kind].append(elapsed)
                if failure:
                    failures.append(f"{time.monotonic() - started:.0f} s: {failure}")

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(CONCURRENCY)]
    for thread in threads:
        thread.start()
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
    while time.monotonic() < stop_at:
        now = time.monotonic() - started
        for name, pid in pids.items():
            rss = rss_kib(pid)
            if rss is not None:
                samples[name].append((now, rss))
        time.sleep(SAMPLE_EVERY_S)
    for thread in threads:
        thread.join(timeout=HUNG_AFTER_S + READ_TIMEOUT_S)
    hung = sum(thread.is_alive() for thread in threads)
    assert app_pids(APP, DEPLOYMENTS) == pids, "a replica was replaced during the soak"

    growth: dict[str, dict[str, Any]] = {}
    for name, points in samples.items():
        first = [rss for t, rss in points if WARMUP_S <= t < WARMUP_S + WINDOW_S]
        last = [rss for t, rss in points if t >= SOAK_S - WINDOW_S]
        base, end = statistics.median(first), statistics.median(last)
        growth[name] = {"rss_mib_after_warmup": round(base / 1024, 1), "rss_mib_at_end": round(end / 1024, 1),
                        "growth_pct": round(100 * (end - base) / base, 2)}
    total = sum(tally.counts.values())
    record("soak", {
        "seconds": SOAK_S, "concurrency": CONCURRENCY, "warmup_s": WARMUP_S, "window_s": WINDOW_S, "requests": total,
        "ok": tally.counts.get("ok", 0), "failed": tally.counts.get("failed", 0), "hung_workers": hung,
        "failures": failures[:20], "rss": growth,
        "latency_s": {kind: {"count": len(v), "p50": _percentile(v, 50), "max": round(max(v), 3) if v else None}
                      for kind, v in latencies.items()},
    })
    assert hung == 0, f"{hung} worker(s) still waiting on a request"
    assert not failures, f"{len(failures)} of {total} requests lost or failed:\n" + "\n".join(failures[:20])
    assert all(latencies[kind] for kind in KINDS), {kind: len(v) for kind, v in latencies.items()}
    grown = {name: g for name, g in growth.items() if g["growth_pct"] >= 100 * RSS_GROWTH_LIMIT}
    assert not grown, f"resident memory grew by 5 % or more: {grown}"
