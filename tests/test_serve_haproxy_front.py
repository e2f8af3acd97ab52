"""`omni-ray serve --haproxy`: the CLI starts its own Ray cluster with Serve's HAProxy front, and HTTP reaches the
ingress through HAProxy: streamed speech, a whole reply with its finish reason, and a bad request's 4xx envelope
that leaves the service serving (tiny Qwen3-TTS CustomVoice on CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from conftest import SERVE_PORT

ROOT = Path(__file__).resolve().parents[1]
PORT = SERVE_PORT + 7
SPEECH = {"model": "qwen3-tts", "input": "Hello there.", "voice": "vivian", "response_format": "pcm",
          "max_new_tokens": 6, "ignore_eos": True}


def _haproxy_processes() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "haproxy":
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def haproxy_url(tiny_checkpoint: Path) -> Iterator[str]:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    before = set(_haproxy_processes())
    process = subprocess.Popen(
        [sys.executable, "-m", "omni_ray.cli", "serve", "--config", str(ROOT / "deployments" / "qwen3_tts_tiny_cpu.yaml"),
         "--host", "127.0.0.1", "--port", str(PORT), "--haproxy"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.time() + 240
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-3000:] if process.stderr else "exited"
            try:
                if httpx.post(f"{url}/v1/audio/speech", json=SPEECH, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the service never spoke"
            time.sleep(1.0)
        assert set(_haproxy_processes()) - before, "no HAProxy process serves the port"
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in set(_haproxy_processes()) - before:  # the front outlives a driver killed before Serve stopped it
            os.kill(pid, signal.SIGTERM)


def test_speech_streams_through_haproxy_and_a_bad_request_gets_its_4xx(haproxy_url: str) -> None:
    with httpx.stream("POST", f"{haproxy_url}/v1/audio/speech", json={**SPEECH, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200
        streamed = b"".join(reply.iter_bytes())
    assert len(streamed) == 6 * 1920 * 2  # six 12.5 Hz frames of 16-bit samples at 24 kHz

    bad = httpx.post(f"{haproxy_url}/v1/audio/speech", json={**SPEECH, "voice": "nobody"}, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "voice" and "vivian" in bad.json()["error"]["message"]

    whole = httpx.post(f"{haproxy_url}/v1/audio/speech", json=SPEECH, timeout=60)
    assert whole.status_code == 200 and whole.headers["x-finish-reason"] == "length"
    assert len(whole.content) == len(streamed)  # sampled anew: the same length, not the same samples
