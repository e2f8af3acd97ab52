"""Shared helpers of the chaos, soak and schemathesis tests: request bodies, timed streams, replica processes, records."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import httpx
import numpy as np
import soundfile as sf

MODEL = "qwen3-omni"
# OMNI_RAY_RESILIENCE_RECORD=path: the chaos, soak and schemathesis tests merge their figures into this JSON file
RECORD_ENV = "OMNI_RAY_RESILIENCE_RECORD"


def chat_body(prompt: str, *, stream: bool, audio: bool, max_tokens: int, ignore_eos: bool = False,
              audio_in: str | None = None, temperature: float = 0.8) -> dict[str, Any]:
    """A chat completion: streamed with pcm16 audio out, or whole (wav when audio is asked for)."""
    content: Any = prompt
    if audio_in is not None:
        content = [{"type": "input_audio", "input_audio": {"data": audio_in, "format": "wav"}},
                   {"type": "text", "text": prompt}]
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream,
                            "max_completion_tokens": max_tokens, "temperature": temperature}
    if audio:
        body.update(modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16" if stream else "wav"})
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def wav_b64(seconds: float = 1.0, rate: int = 16000) -> str:
    """A short tone as base64 WAV, for an `input_audio` part."""
    t = np.arange(int(seconds * rate)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass
class StreamRecord:
    """What one streamed chat request did, with monotonic times (`time.monotonic()`)."""

    status: int | None = None
    started: float = 0.0
    first_audio: float | None = None  # first SSE chunk holding audio data
    error_at: float | None = None  # the SSE error event
    error: dict[str, Any] | None = None
    done: bool = False  # data: [DONE] arrived
    ended: float | None = None  # the body ended (or the connection broke)
    broken: str | None = None  # the exception that ended a broken connection
    audio_chunks: int = 0
    text_chunks: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.broken is None


def stream_chat(url: str, body: dict[str, Any], record: StreamRecord, timeout: float = 180.0) -> None:
    """POST a streamed chat completion and fill `record` as its events arrive (run it in a thread)."""
    record.started = time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as response:
            record.status = response.status_code
            if response.status_code != 200:
                record.error = {"status_body": response.read().decode(errors="replace")[:500]}
                record.ended = time.monotonic()
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    record.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    record.error_at, record.error = time.monotonic(), event["error"]
                    continue
                delta = event["choices"][0]["delta"] if event.get("choices") else {}
                if (delta.get("audio") or {}).get("data"):
                    record.audio_chunks += 1
                    record.first_audio = record.first_audio or time.monotonic()
                record.text_chunks += bool(delta.get("content"))
    except Exception as exc:  # a broken connection or a timeout: the caller asserts on it
        record.broken = repr(exc)
    record.ended = time.monotonic()


def start_streams(url: str, bodies: list[dict[str, Any]], timeout: float = 180.0) -> tuple[list[StreamRecord], list[threading.Thread]]:
    records = [StreamRecord() for _ in bodies]
    threads = [threading.Thread(target=stream_chat, args=(url, body, rec, timeout), daemon=True)
               for body, rec in zip(bodies, records)]
    for thread in threads:
        thread.start()
    return records, threads


def wait_until(condition: Callable[[], bool], seconds: float, period: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(period)
    return condition()


def ready_status(url: str) -> int | None:
    """GET /ready's status; None when nothing answers in time."""
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code
    except httpx.HTTPError:
        return None


# ---- replica processes (same machine): Ray's actor table, read from the GCS (the state API needs the dashboard) ----

def replica_pids(app: str, deployment: str) -> dict[str, int]:
    """Live replicas of `deployment` in Serve application `app`: {replica unique id: process id}."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    actors = ray._private.state.actors()  # {actor id: {"Name", "State", "Pid", ...}}
    return {info["Name"][len(prefix):]: int(info["Pid"]) for info in actors.values()
            if str(info.get("Name") or "").startswith(prefix) and info.get("State") == "ALIVE" and info.get("Pid")}


def app_pids(app: str, deployments: tuple[str, ...]) -> dict[str, int]:
    """Every replica process of the application: {"<deployment>/<replica id>": pid}."""
    return {f"{name}/{rid}": pid for name in deployments for rid, pid in replica_pids(app, name).items()}


def rss_kib(pid: int) -> int | None:
    """The process's resident set (VmRSS, KiB); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def stage_streams(url: str, stage: str) -> dict[str, float]:
    """`omni_stage_streams` per replica of one stage, from /metrics: {replica id: open streams}."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("omni_stage_streams{") and f'stage="{stage}"' in line:
            labels, value = line.rsplit(" ", 1)
            out[labels.split('replica="')[1].split('"')[0]] = float(value)
    return out


# ---- the record ----------------------------------------------------------------------------------------------------

_RECORD_LOCK = threading.Lock()


def record(section: str, figures: dict[str, Any]) -> None:
    """Merge `figures` under `section` into the JSON file named by OMNI_RAY_RESILIENCE_RECORD (no-op without it)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    with _RECORD_LOCK:
        target = Path(path)
        data = json.loads(target.read_text()) if target.exists() else {}
        data[section] = {**data.get(section, {}), **figures}
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def summary(record_: StreamRecord, since: float) -> dict[str, Any]:
    """A stream's outcome relative to `since` (a kill), for the record and failure messages."""
    out = asdict(record_)
    for key in ("first_audio", "error_at", "ended"):
        out[key] = None if out[key] is None else round(out[key] - since, 3)
    out["started"] = round(record_.started - since, 3)
    return out


@dataclass
class Tally:
    """Counts of requests by outcome, thread-safe."""

    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1


@contextmanager
def own_app(serve_url: str, name: str, prefix: str, args: dict[str, Any]) -> Iterator[str]:
    """An application of its own beside the session's service (built from `args`), routed and ready: its URL; it is
    deleted afterwards."""
    from ray import serve

    from _scaling import wait_for_route
    from omni_ray.serve.app import build_app

    serve.run(build_app(args), name=name, route_prefix=prefix)
    try:
        wait_for_route(serve_url, prefix)
        url = f"{serve_url}{prefix}"
        assert wait_until(lambda: ready_status(url) == 200, 120), f"the {name} app never became ready"
        yield url
    finally:
        serve.delete(name)
