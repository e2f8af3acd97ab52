"""Malformed HTTP requests get their documented 4xx in the OpenAI error envelope; disconnects free every stage."""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf


MODEL = "qwen3-omni"
HELLO = [{"role": "user", "content": "Hello"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, **fields}


def _audio_message(data: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}]


def _long_wav(seconds: float) -> str:
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros(int(seconds * 8000), np.float32), 8000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


# (name, method, path, json body or raw bytes, expected status)
BAD: list[tuple[str, str, str, Any, int]] = [
    ("invalid json", "POST", "/v1/chat/completions", b"{not json", 400),
    ("json array body", "POST", "/v1/chat/completions", b"[1, 2]", 400),
    ("unknown field", "POST", "/v1/chat/completions", _chat(bogus=1), 422),
    ("temperature out of range", "POST", "/v1/chat/completions", _chat(temperature=5), 422),
    ("top_p zero", "POST", "/v1/chat/completions", _chat(top_p=0), 422),
    ("max tokens zero", "POST", "/v1/chat/completions", _chat(max_completion_tokens=0), 422),
    ("max tokens over limit", "POST", "/v1/chat/completions", _chat(max_completion_tokens=100_000), 400),
    ("n=2", "POST", "/v1/chat/completions", _chat(n=2), 400),
    ("tools", "POST", "/v1/chat/completions", _chat(tools=[{"type": "function"}]), 400),
    ("stop sequences", "POST", "/v1/chat/completions", _chat(stop=["x"]), 400),
    ("audio-only modality", "POST", "/v1/chat/completions", _chat(modalities=["audio"]), 400),
    ("audio modality without audio config", "POST", "/v1/chat/completions", _chat(modalities=["text", "audio"]), 400),
    ("unknown voice", "POST", "/v1/chat/completions",
     _chat(modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"}), 400),
    ("streamed audio not pcm16", "POST", "/v1/chat/completions",
     _chat(modalities=["text", "audio"], audio={"voice": "ethan", "format": "mp3"}, stream=True), 400),
    ("stream_options without stream", "POST", "/v1/chat/completions", _chat(stream_options={"include_usage": True}), 400),
    ("empty messages", "POST", "/v1/chat/completions", _chat(messages=[]), 422),
    ("unknown role", "POST", "/v1/chat/completions", _chat(messages=[{"role": "robot", "content": "hi"}]), 422),
    ("bad base64 audio", "POST", "/v1/chat/completions", _chat(messages=_audio_message("@@not base64@@")), 400),
    ("undecodable audio", "POST", "/v1/chat/completions",
     _chat(messages=_audio_message(base64.b64encode(b"definitely not a wav file").decode())), 400),
    ("audio too long", "POST", "/v1/chat/completions", _chat(messages=_audio_message(_long_wav(25))), 413),
    ("body too large", "POST", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": "x" * 3_000_000}]), 413),
    ("audio url disabled", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "http://example.com/a.wav"}}]}]), 400),
    ("local file disabled", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}]}]), 400),
    ("prompt over max_prompt_tokens", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "many words here " * 1000}]), 400),
    ("unknown model", "POST", "/v1/chat/completions", {**_chat(), "model": "gpt-9"}, 404),
    ("speech empty input", "POST", "/v1/audio/speech", {"model": MODEL, "input": "  ", "voice": "ethan"}, 422),
    ("speech speed", "POST", "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "ethan", "speed": 2.0}, 400),
    ("speech unknown format", "POST", "/v1/audio/speech",
     {"model": MODEL, "input": "hi", "voice": "ethan", "response_format": "aac"}, 422),
    ("speech unknown voice", "POST", "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "nobody"}, 400),
    ("speech blank voice", "POST", "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "  "}, 400),
    ("blank voice", "POST", "/v1/chat/completions",
     _chat(modalities=["text", "audio"], audio={"voice": " \t", "format": "wav"}), 400),
    ("stream as a string", "POST", "/v1/chat/completions", _chat(stream="yes"), 422),
    ("temperature as a string", "POST", "/v1/chat/completions", _chat(temperature="0.5"), 422),
    ("speech stream as a string", "POST", "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "ethan", "stream": "yes"}, 422),
    ("speech events as mp3", "POST", "/v1/audio/speech",
     {"model": MODEL, "input": "hi", "voice": "ethan", "stream_format": "sse", "response_format": "mp3"}, 400),
    ("speech unknown stream_format", "POST", "/v1/audio/speech",
     {"model": MODEL, "input": "hi", "voice": "ethan", "stream_format": "chunks"}, 422),
    ("prompt over max_prompt_chars", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "x" * 300_000}]), 400),
    ("body said too large", "POST", "/v1/chat/completions", b"{" + b" " * (3 * 1024 * 1024) + b"}", 413),
    ("wrong method", "GET", "/v1/chat/completions", None, 405),
    ("unknown path", "POST", "/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("name,method,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_malformed_request_gets_its_documented_status(
    serve_url: str, name: str, method: str, path: str, body: Any, status: int
) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    response = httpx.request(method, f"{serve_url}{path}", timeout=60, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] in ("invalid_request_error", "not_found_error")


def test_a_wrong_method_says_which_are_allowed(serve_url: str) -> None:
    for path, allowed in (("/v1/chat/completions", "POST"), ("/v1/audio/speech", "POST"), ("/health", "GET")):
        response = httpx.request("PUT", f"{serve_url}{path}", timeout=60)
        assert response.status_code == 405 and allowed in response.headers["allow"], (path, response.headers)


def test_openapi_json_describes_the_request_bodies(serve_url: str) -> None:
    document = httpx.get(f"{serve_url}/openapi.json", timeout=60).json()
    schemas = document["components"]["schemas"]
    ref = "#/components/schemas/{}".format
    speech = {"anyOf": [{"$ref": ref("SpeechRequest")}, {"$ref": ref("TTSSpeechRequest")}]}  # by the model's family
    for path, schema in (("/v1/chat/completions", {"$ref": ref("ChatCompletionRequest")}), ("/v1/audio/speech", speech)):
        body = document["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == schema
    for model in ("ChatCompletionRequest", "SpeechRequest", "TTSSpeechRequest"):
        assert schemas[model]["properties"], model
    assert schemas["SpeechRequest"]["properties"]["stream_format"]["enum"] == ["audio", "sse"]
    # the routes still read the body themselves: a body FastAPI would refuse is ours to answer
    response = httpx.post(f"{serve_url}/v1/audio/speech", content=b"[]", timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_service_keeps_serving_after_bad_requests(serve_url: str) -> None:
    for _, method, path, body, _ in BAD[:5]:
        httpx.request(method, f"{serve_url}{path}", json=body if isinstance(body, dict) else None, timeout=60)
    response = httpx.post(f"{serve_url}/v1/chat/completions", json=_chat(max_completion_tokens=3), timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None


def _stage_load(metrics: str) -> dict[str, float]:
    """Sum of running/waiting/streams gauges per stage from /metrics."""
    load: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(("omni_stage_running{", "omni_stage_waiting{", "omni_stage_streams{")):
            labels, value = line.rsplit(" ", 1)
            stage = labels.split('stage="')[1].split('"')[0]
            load[stage] = load.get(stage, 0.0) + float(value)
    return load


def test_client_disconnect_frees_every_stage_within_a_second(serve_url: str) -> None:
    # A long verbatim speech request: it cannot end early on a stop token, so it is surely still running.
    body = {"model": MODEL, "voice": "ethan", "response_format": "pcm", "stream": True,
            "input": "The quick brown fox jumps over the lazy dog. " * 40}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{serve_url}/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            chunks = response.iter_bytes()  # held until the block ends: a dropped iterator closes the connection
            next(chunks)  # first audio arrived: the request is live
            deadline = time.monotonic() + 3  # replicas report every 0.25 s
            busy: dict[str, float] = {}
            while busy.get("talker", 0) == 0 and time.monotonic() < deadline:
                busy = _stage_load(httpx.get(f"{serve_url}/metrics").text)
                time.sleep(0.05)
        closed = time.monotonic()  # leaving the block closes the connection: the client is gone
    assert busy.get("talker", 0) > 0, busy  # it really was running
    while True:
        load = _stage_load(httpx.get(f"{serve_url}/metrics").text)
        if all(v == 0 for v in load.values()) and set(load) >= {"thinker", "talker", "vocoder", "encoder"}:
            break
        assert time.monotonic() - closed < 1.0, f"stages still busy 1 s after the disconnect: {load}"
        time.sleep(0.05)
    print(f"\nevery stage idle {1000 * (time.monotonic() - closed):.0f} ms after the disconnect (as seen by /metrics)")
    cancelled = 'omni_requests_cancelled_total{endpoint="speech"}'
    deadline = time.monotonic() + 3  # the ingress replica that served it posts its counts every 0.25 s
    while cancelled not in httpx.get(f"{serve_url}/metrics").text:
        assert time.monotonic() < deadline, "the cancellation was never counted"
        time.sleep(0.05)


def test_a_stage_at_capacity_is_a_503_with_retry_after_not_a_500() -> None:
    """A vocoder with every state slot taken refuses a stream with CapacityError; it reaches the ingress wrapped
    by Ray and by the orchestrator's StageError, and still becomes 503 overloaded."""
    from ray.exceptions import RayTaskError

    from omni_ray.errors import CapacityError, StageError
    from omni_ray.serve.ingress import _as_openai_error

    remote = RayTaskError("decode", "traceback", CapacityError("the vocoder holds 256 streams already")).as_instanceof_cause()
    try:
        raise StageError(f"vocoder did not start: {remote}") from remote
    except StageError as exc:
        error = _as_openai_error(exc)
    assert error.status == 503 and error.body()["error"]["code"] == "overloaded"
    assert error.headers.get("Retry-After")
    assert _as_openai_error(StageError("talker: boom")).status == 500  # a real failure stays a server error


def test_a_stream_failing_after_its_headers_ends_with_an_error_event_not_a_cut_transfer() -> None:
    """A stage failing mid-reply, after the 200 and the first chunks went out (the 1-GPU service's device mismatch in
    the Talker): a chat stream's last events are the error in the OpenAI envelope and [DONE], so the
    client reads why (the openai client raises it) instead of a broken chunked transfer. A raw audio stream has no room
    for an error: it is cut. Both are counted."""
    import asyncio
    import json

    from prometheus_client import generate_latest

    from omni_ray.errors import StageError
    from omni_ray.serve.ingress import OmniIngress, _sse_error
    from omni_ray.serve.metrics import ServiceMetrics

    async def failing() -> Any:
        yield b"data: first\n\n"
        raise StageError("talker: Expected all tensors to be on the same device")

    class Replica:  # what `_counted` reads of the ingress replica
        metrics = ServiceMetrics()

    async def drain(endpoint: str, tail: Any) -> list[bytes]:
        return [chunk async for chunk in OmniIngress._counted(Replica(), endpoint, failing(), tail)]

    chunks = asyncio.run(drain("chat", _sse_error))
    assert chunks[0] == b"data: first\n\n"
    events = b"".join(chunks[1:]).decode().split("\n\n")
    error = json.loads(events[0].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "same device" in error["message"]
    assert events[1:] == ["data: [DONE]", ""]
    with pytest.raises(StageError):
        asyncio.run(drain("speech", None))
    page = generate_latest(Replica.metrics.registry).decode()
    assert 'omni_stream_failures_total{endpoint="chat"} 1.0' in page
    assert 'omni_stream_failures_total{endpoint="speech"} 1.0' in page


def test_a_server_error_is_logged_with_its_traceback_and_a_client_error_is_not(caplog: pytest.LogCaptureFixture) -> None:
    """A request that fails on our side answers 500 in the OpenAI envelope, and the replica's log keeps why (the
    message and the traceback; the client only reads "internal error"). A client's mistake answers 4xx and logs
    nothing."""
    import asyncio
    import json
    import logging

    from omni_ray.serve import openai_protocol as oai
    from omni_ray.serve.ingress import OmniIngress
    from omni_ray.serve.metrics import ServiceMetrics

    class Replica:  # what `_guard` reads of the ingress replica
        metrics = ServiceMetrics()
        limits = oai.ServiceLimits()

    class Request:
        headers: dict[str, str] = {}

        async def stream(self) -> Any:
            yield b"{}"

    async def broken(raw: bytes) -> Any:
        raise KeyError("a bug of ours")

    async def refused(raw: bytes) -> Any:
        raise oai.bad_request("max_tokens is too large")

    with caplog.at_level(logging.ERROR, logger="omni_ray.serve.ingress"):
        response = asyncio.run(OmniIngress._guard(Replica(), "chat", broken, Request()))
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["message"] == "internal error"
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "a bug of ours" in record.getMessage() and record.exc_info is not None
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="omni_ray.serve.ingress"):
        response = asyncio.run(OmniIngress._guard(Replica(), "chat", refused, Request()))
    assert response.status_code == 400 and not caplog.records
