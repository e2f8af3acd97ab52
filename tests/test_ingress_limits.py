"""The ingress's request hardening, without a service: strict types, blank voices, the speech SSE format, the early
limits (body bytes while reading, JSON items, prompt characters), the parsing pool and the OpenAPI request bodies."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from omni_ray.serve.openai_protocol import (
    ChatCompletionRequest,
    OpenAIError,
    ServiceLimits,
    SpeechRequest,
    chat_chunk,
    chat_completion,
    parse_request,
    speech_audio_delta,
    speech_audio_done,
    usage_dict,
)
from omni_ray.serve.request_work import ParsingPool, read_body

LIMITS = ServiceLimits()
MODEL = "qwen3-omni"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def speech(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello", "voice": "ethan", **fields}


def refusal(body: dict[str, Any] | bytes, cls: type, limits: ServiceLimits = LIMITS) -> OpenAIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(OpenAIError) as info:
        parse_request(raw, cls, limits)
    return info.value


COERCIONS: list[tuple[str, dict[str, Any], type, str]] = [
    ("stream yes", chat(stream="yes"), ChatCompletionRequest, "stream"),
    ("stream 1", chat(stream=1), ChatCompletionRequest, "stream"),
    ("temperature as a string", chat(temperature="0.5"), ChatCompletionRequest, "temperature"),
    ("max tokens as a string", chat(max_completion_tokens="10"), ChatCompletionRequest, "max_completion_tokens"),
    ("max tokens as a float", chat(max_completion_tokens=10.0), ChatCompletionRequest, "max_completion_tokens"),
    ("include_usage as a string", chat(stream=True, stream_options={"include_usage": "true"}), ChatCompletionRequest,
     "stream_options.include_usage"),
    ("ignore_eos as a string", chat(ignore_eos="false"), ChatCompletionRequest, "ignore_eos"),
    ("speech stream yes", speech(stream="yes"), SpeechRequest, "stream"),
    ("speech seed as a string", speech(seed="3"), SpeechRequest, "seed"),
    ("speech speed as a string", speech(speed="1"), SpeechRequest, "speed"),
    ("unknown stream_format", speech(stream_format="mp3"), SpeechRequest, "stream_format"),
]


@pytest.mark.parametrize("body,cls,param", [c[1:] for c in COERCIONS], ids=[c[0] for c in COERCIONS])
def test_no_value_is_coerced_to_another_type(body: dict[str, Any], cls: type, param: str) -> None:
    error = refusal(body, cls)
    assert (error.status, error.param) == (422, param), error.message


def test_ints_stay_acceptable_where_numbers_are_expected() -> None:
    request = parse_request(json.dumps(chat(temperature=1, top_p=1, repetition_penalty=1)).encode(),
                            ChatCompletionRequest, LIMITS)
    assert request.temperature == 1.0 and isinstance(request.temperature, float) and request.top_p == 1.0
    assert parse_request(json.dumps(speech(speed=1, temperature=0)).encode(), SpeechRequest, LIMITS).speed == 1.0


@pytest.mark.parametrize("voice", [" ", "\t\n", "   "])
def test_a_blank_voice_is_a_400_not_the_default_voice(voice: str) -> None:
    error = refusal(chat(modalities=["text", "audio"], audio={"voice": voice, "format": "wav"}), ChatCompletionRequest)
    assert (error.status, error.param, error.code) == (400, "audio.voice", "invalid_voice")
    error = refusal(speech(voice=voice), SpeechRequest)
    assert (error.status, error.param, error.code) == (400, "voice", "invalid_voice")


def test_speech_stream_format() -> None:
    default = parse_request(json.dumps(speech()).encode(), SpeechRequest, LIMITS)
    assert default.stream_format == "audio" and not default.streams
    events = parse_request(json.dumps(speech(stream_format="sse", response_format="pcm")).encode(), SpeechRequest, LIMITS)
    assert events.streams and not events.stream
    assert parse_request(json.dumps(speech(stream=True)).encode(), SpeechRequest, LIMITS).streams  # the extension
    error = refusal(speech(stream_format="sse", response_format="mp3"), SpeechRequest)
    assert (error.status, error.param) == (400, "response_format")


def test_speech_events_are_openais() -> None:
    delta = speech_audio_delta(b"\x01\x02\x03")
    assert delta == {"type": "speech.audio.delta", "audio": "AQID"}
    done = speech_audio_done(12, 40)
    assert done == {"type": "speech.audio.done", "usage": {"input_tokens": 12, "output_tokens": 40, "total_tokens": 52}}


def test_audio_finish_reason_sits_next_to_finish_reason() -> None:
    final = chat_chunk("c", "m", 1, {}, "stop", usage_dict(1, 2), audio_finish_reason="length")
    assert final["choices"][0]["finish_reason"] == "stop" and final["choices"][0]["audio_finish_reason"] == "length"
    assert "audio_finish_reason" not in chat_chunk("c", "m", 1, {}, "stop")["choices"][0]  # a text-only reply
    whole = chat_completion("c", "m", 1, "hi", "stop", usage_dict(1, 2), {"id": "a"}, audio_finish_reason="length")
    assert whole["choices"][0]["audio_finish_reason"] == "length"
    assert "audio_finish_reason" not in chat_completion("c", "m", 1, "hi", "stop", usage_dict(1, 2))["choices"][0]


def test_a_prompt_over_max_prompt_chars_is_refused_before_tokenizing() -> None:
    limits = ServiceLimits(max_prompt_chars=1000)
    body = chat(messages=[{"role": "user", "content": "x" * 1000}])
    error = refusal(body, ChatCompletionRequest, limits)
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert "1032 characters" in error.message  # the text and 16 for the message and 16 for its one part
    parts = [{"type": "text", "text": "x" * 100}] * 10
    assert refusal(chat(messages=[{"role": "user", "content": parts}]), ChatCompletionRequest, limits).status == 400
    many = [{"role": "user", "content": ""}] * 40  # empty messages still count: the template's markup
    assert refusal(chat(messages=many), ChatCompletionRequest, limits).status == 400
    fine = parse_request(json.dumps(chat(messages=[{"role": "user", "content": "x" * 900}])).encode(),
                         ChatCompletionRequest, limits)
    assert fine.prompt_chars == 932


def test_a_body_of_many_tiny_values_is_refused_before_decoding() -> None:
    limits = ServiceLimits(max_json_items=1000)
    raw = b'{"model": "m", "metadata": {' + b",".join(b'"k%d": "v"' % i for i in range(600)) + b"}}"
    error = refusal(raw, ChatCompletionRequest, limits)
    assert (error.status, error.code) == (400, "too_many_json_items")
    ok = json.dumps(chat(messages=[{"role": "user", "content": "a, b: c"}])).encode()
    assert parse_request(ok, ChatCompletionRequest, limits).prompt_chars == 39


class _Request:
    """What read_body reads of a Starlette request."""

    def __init__(self, pieces: list[bytes], length: int | None = None) -> None:
        self.pieces, self.read = pieces, 0
        self.headers = {} if length is None else {"content-length": str(length)}

    async def stream(self) -> Any:
        for piece in self.pieces:
            self.read += 1
            yield piece


def test_the_body_limit_holds_while_reading() -> None:
    assert asyncio.run(read_body(_Request([b"ab", b"cd"]), 4)) == b"abcd"  # type: ignore[arg-type]
    said = _Request([b"x" * 10], length=10)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_body(said, 4))  # type: ignore[arg-type]
    assert info.value.status == 413 and said.read == 0  # refused on its Content-Length, before reading
    endless = _Request([b"x" * 3] * 1000)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(read_body(endless, 10))  # type: ignore[arg-type]
    assert info.value.status == 413 and endless.read == 4  # refused at the piece that passed the limit


def test_the_parsing_pool_is_bounded_and_leaves_the_loop_free() -> None:
    release = threading.Event()
    running: list[int] = []

    def work(i: int) -> int:
        running.append(i)
        release.wait(5)
        return i

    async def scenario() -> None:
        pool = ParsingPool(ServiceLimits(max_parsing_concurrency=2, max_parsing_wait_s=0.3))
        first = [asyncio.ensure_future(pool.run(work, i)) for i in range(2)]
        ticks = 0
        started = time.perf_counter()
        while time.perf_counter() - started < 0.3:  # the loop keeps turning while both threads are busy
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 3 and sorted(running) == [0, 1], (ticks, running)
        with pytest.raises(OpenAIError) as info:  # no thread frees up in max_parsing_wait_s: 503
            await pool.run(work, 2)
        assert info.value.status == 503 and info.value.headers["Retry-After"] == "1"
        first[0].cancel()  # a client gone: its slot stays held until its work ends
        waiting = asyncio.ensure_future(pool.run(work, 3))
        await asyncio.sleep(0.05)
        assert 3 not in running
        release.set()
        assert await first[1] == 1 and await waiting == 3

    asyncio.run(scenario())


def test_openapi_describes_both_request_bodies() -> None:
    from omni_ray.serve.ingress import app

    document = app.openapi()
    schemas = document["components"]["schemas"]
    # a speech body is Qwen3-Omni's or Qwen3-TTS's, by the family of the model it names
    for path, models in (("/v1/chat/completions", ["ChatCompletionRequest"]),
                         ("/v1/audio/speech", ["SpeechRequest", "TTSSpeechRequest"])):
        body = document["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert body["required"] and [ref.rsplit("/", 1)[1] for ref in _refs(schema)] == models
        assert all(schemas[model]["additionalProperties"] is False for model in models)
    assert {"ref_audio", "ref_text", "task_type", "language", "max_new_tokens"} <= set(schemas["TTSSpeechRequest"]["properties"])
    assert set(schemas["SpeechRequest"]["properties"]["stream_format"]["enum"]) == {"audio", "sse"}
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    refs = {ref.rsplit("/", 1)[1] for ref in _refs(document)}
    assert refs <= set(schemas), refs - set(schemas)  # every reference resolves


def _refs(value: Any) -> list[str]:
    if isinstance(value, dict):
        own = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
        return own + [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []


@pytest.mark.parametrize("text", ["plain ascii " * 200_000, "é, ü: " * 200_000, "\\u00e9 " * 300_000])
def test_big_bodies_decode_as_json_loads_does(text: str) -> None:
    """A big plain-ASCII body takes pydantic's decoder, others json.loads: the same request either way, and the
    same refusals (a lone surrogate, broken JSON)."""
    from omni_ray.serve.json_body import decode_json_object

    limits = ServiceLimits(max_prompt_chars=10_000_000, max_json_items=10_000_000)
    raw = json.dumps(chat(messages=[{"role": "user", "content": text}], metadata={"n": "1"})).encode()
    assert len(raw) > 1 << 20
    assert decode_json_object(raw) == json.loads(raw)
    assert parse_request(raw, ChatCompletionRequest, limits).messages[0].content == text
    lone = raw.replace(b'"n": "1"', b'"n": "\\ud800"')
    assert refusal(lone, ChatCompletionRequest, limits).code == "invalid_json"
    assert refusal(raw[:-1], ChatCompletionRequest, limits).code == "invalid_json"
