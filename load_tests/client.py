"""HTTP side of the load generator: prompts, request bodies, and timed streaming calls through aiohttp."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from load_tests.metrics import RequestRecord, StreamState, apply_chat_event, build_record
from load_tests.sse import SSEParser

DEFAULT_PROMPTS: tuple[str, ...] = (
    "Hello, who are you?",
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
    "Give me three tips for sleeping better.",
    "Explain how a rainbow forms, as if I were ten years old.",
    "Translate 'good morning, how did you sleep?' into French and Spanish.",
    "Describe the taste of a fresh mango to someone who has never had one.",
    "What's a good name for a grey cat?",
    "Walk me through making a cup of pour-over coffee, step by step, with quantities and timings.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "I have eggs, spinach, and feta. What can I cook for dinner in fifteen minutes?",
    "Count from one to twenty, slowly.",
    "Read me a limerick about a programmer who forgot to save their work.",
    "What are the pros and cons of working from home? Please answer in a friendly, conversational tone.",
    "Say 'testing, one, two, three'.",
)

AUDIO_FORMATS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".ogg": "ogg"}


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a file (one per non-blank line) or the built-in varied set."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


@dataclass(frozen=True)
class AudioInput:
    """An input clip sent as an `input_audio` content part."""

    data_b64: str
    format: str


def load_audio_input(path: str) -> AudioInput:
    """Read a clip and base64-encode it; the format comes from the file extension (default wav)."""
    p = Path(path)
    return AudioInput(base64.b64encode(p.read_bytes()).decode("ascii"), AUDIO_FORMATS.get(p.suffix.lower(), "wav"))


def chat_body(model: str, prompt: str, *, max_tokens: int, voice: str, temperature: float, seed: int | None,
              audio: AudioInput | None = None, ignore_eos: bool = False) -> dict[str, Any]:
    """A streaming text+audio chat-completions request."""
    content: str | list[dict[str, Any]] = prompt
    if audio is not None:
        content = [{"type": "input_audio", "input_audio": {"data": audio.data_b64, "format": audio.format}},
                   {"type": "text", "text": prompt}]
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"},
        "stream": True, "stream_options": {"include_usage": True},  # usage only comes when asked for
        "max_completion_tokens": max_tokens, "temperature": temperature,
    }
    if seed is not None:
        body["seed"] = seed
    if ignore_eos:  # omni-ray extension: fixed-length replies for benchmarks
        body["ignore_eos"] = True
    return body


def load_reference_audio(path: str) -> str:
    """A reference clip for voice cloning (`ref_audio`), base64-encoded as read."""
    return base64.b64encode(Path(path).read_bytes()).decode("ascii")


def speech_body(model: str, text: str, *, voice: str | None, max_new_tokens: int | None = None,
                ignore_eos: bool = False, **fields: Any) -> dict[str, Any]:
    """A streaming raw-PCM text-to-speech request; `fields` (Qwen3-TTS: `task_type`, `language`, `ref_audio`,
    `ref_text`, ...) are sent where not None. `voice=None` sends none (Base cloning from `ref_audio`)."""
    body: dict[str, Any] = {"model": model, "input": text, "response_format": "pcm", "stream": True}
    if voice is not None:
        body["voice"] = voice
    if max_new_tokens is not None:  # the frame cap (12.5 frames a second)
        body["max_new_tokens"] = max_new_tokens
    if ignore_eos:  # omni-ray extension: fixed-length speech for benchmarks
        body["ignore_eos"] = True
    body.update({key: value for key, value in fields.items() if value is not None})
    return body


async def fetch_default_model(session: aiohttp.ClientSession, url: str, timeout: float) -> str:
    """The first model id listed by GET /v1/models."""
    async with session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        resp.raise_for_status()
        listing = await resp.json(content_type=None)
    data = listing.get("data") if isinstance(listing, dict) else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ValueError(f"GET /v1/models listed no model: {listing!r}")
    return str(data[0]["id"])


async def _read_http_error(resp: aiohttp.ClientResponse, state: StreamState) -> None:
    """Record an HTTP error reply's `{"error": {...}}` body (or its raw text) in `state`."""
    raw = await resp.read()
    text = raw.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
    except (json.JSONDecodeError, AttributeError):
        err = None
    if isinstance(err, dict):
        state.fail(str(err.get("type") or "http_error"), str(err.get("message", "")))
    else:
        state.fail("http_error", text[:500])


async def _consume_chat(resp: aiohttp.ClientResponse, state: StreamState) -> None:
    parser = SSEParser()
    async for piece in resp.content.iter_any():
        t = time.perf_counter()
        for payload in parser.feed(piece):
            apply_chat_event(state, payload, t)
    t = time.perf_counter()
    for payload in parser.close():
        apply_chat_event(state, payload, t)
    if not state.done:
        state.fail("incomplete_stream", "stream ended without data: [DONE]")


async def _consume_speech(resp: aiohttp.ClientResponse, state: StreamState) -> None:
    async for piece in resp.content.iter_any():
        state.add_audio(time.perf_counter(), len(piece))


async def send_request(session: aiohttp.ClientSession, url: str, scenario: str, body: dict[str, Any], *,
                       index: int, run_start: float, timeout: float) -> RequestRecord:
    """POST one streaming request, read it to the end, and return its metrics. Never raises for request failures."""
    path = "/v1/chat/completions" if scenario == "chat" else "/v1/audio/speech"
    state = StreamState()
    status: int | None = None
    retry_after: str | None = None
    start = time.perf_counter()
    try:
        headers = {"X-Request-Start": f"t={time.time_ns() // 1000}"}  # the server measures the way in from it
        async with session.post(f"{url}{path}", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            status = resp.status
            retry_after = resp.headers.get("Retry-After")
            if status != 200:
                await _read_http_error(resp, state)
            elif scenario == "chat":
                await _consume_chat(resp, state)
            else:
                await _consume_speech(resp, state)
    except asyncio.TimeoutError:
        state.fail("timeout", f"no complete reply within {timeout:g} s")
    except aiohttp.ClientPayloadError as exc:
        state.fail("incomplete_stream", str(exc) or type(exc).__name__)
    except aiohttp.ClientError as exc:
        state.fail("connection_error", str(exc) or type(exc).__name__)
    end = time.perf_counter()
    return build_record(index, scenario, start, end, run_start, status, state, retry_after)
