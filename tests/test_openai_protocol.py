"""Tests for omni_ray.serve.openai_protocol: validation, errors, audio URLs, generate kwargs, response builders."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import soundfile as sf
from pydantic import ValidationError

from omni_ray.audio import AudioTooLongError, encode_wav
from omni_ray.errors import InvalidRequestError
from omni_ray.models.qwen3_omni.prompt import PromptError, _audio_bytes
from omni_ray.serve.audio_urls import resolve_audio_urls
from omni_ray.serve.openai_protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    OpenAIError,
    ServiceLimits,
    SpeechRequest,
    audio_delta,
    audio_message,
    bad_request,
    chat_chunk,
    chat_completion,
    from_validation_error,
    invalid_request,
    models_list,
    overloaded,
    parse_request,
    rate_limited,
    sse,
    too_large,
    unprocessable,
    usage_dict,
)

LIMITS = ServiceLimits()
WAV_B64 = base64.b64encode(encode_wav(np.zeros(1600, np.float32), 16000)).decode()  # 0.1 s of silence
AUDIO_OUT = {"voice": "Ethan", "format": "wav"}


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "qwen3-omni", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return body


def user_parts(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return chat(messages=[{"role": "user", "content": list(parts)}], **fields)


def speech(**fields: Any) -> dict[str, Any]:
    return {"model": "qwen3-omni", "input": "Hello there.", "voice": "ethan", **fields}


def audio_url(url: str) -> dict[str, Any]:
    return user_parts({"type": "audio_url", "audio_url": {"url": url}})


def error_of(
    body: dict[str, Any] | bytes, cls: type = ChatCompletionRequest, limits: ServiceLimits = LIMITS
) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_request(body, cls, limits)
    return info.value


def resolve_error(body: dict[str, Any], limits: ServiceLimits) -> OpenAIError:
    request = parse_request(body, ChatCompletionRequest, limits)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(resolve_audio_urls(request, limits))
    return info.value


MALFORMED_CHAT: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("unknown top-level field", chat(foo=1), 422, "foo"),
    ("messages not a list", chat(messages="hi"), 422, "messages"),
    ("model missing", {"messages": [{"role": "user", "content": "hi"}]}, 422, "model"),
    ("model wrong type", chat(model=5), 422, "model"),
    ("temperature 3", chat(temperature=3), 422, "temperature"),
    ("temperature a string", chat(temperature="hot"), 422, "temperature"),
    ("top_p 0", chat(top_p=0), 422, "top_p"),
    ("top_k negative", chat(top_k=-1), 422, "top_k"),
    ("repetition_penalty 3", chat(repetition_penalty=3.0), 422, "repetition_penalty"),
    ("max_tokens 0", chat(max_tokens=0), 422, "max_tokens"),
    ("max_completion_tokens over the limit", chat(max_completion_tokens=LIMITS.max_completion_tokens + 1),
     400, "max_completion_tokens"),
    ("legacy max_tokens over the limit", chat(max_tokens=10**6), 400, "max_tokens"),
    ("seed not an int", chat(seed="abc"), 422, "seed"),
    ("n=2", chat(n=2), 400, "n"),
    ("stop given", chat(stop=["\n"]), 400, "stop"),
    ("stop string", chat(stop="END"), 400, "stop"),
    ("tools given", chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("tool_choice given", chat(tool_choice="auto"), 400, "tool_choice"),
    ("logprobs true", chat(logprobs=True), 400, "logprobs"),
    ("presence_penalty", chat(presence_penalty=0.5), 400, "presence_penalty"),
    ("frequency_penalty", chat(frequency_penalty=-1), 400, "frequency_penalty"),
    ("logit_bias", chat(logit_bias={"42": 5}), 400, "logit_bias"),
    ("json response_format", chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("audio-only modalities", chat(modalities=["audio"], audio=AUDIO_OUT), 400, "modalities"),
    ("unknown modality", chat(modalities=["text", "video"]), 422, "modalities.1"),
    ("audio modality without audio config", chat(modalities=["text", "audio"]), 400, "audio"),
    ("output audio format ogg", chat(modalities=["text", "audio"], audio={"voice": "ethan", "format": "ogg"}),
     422, "audio.format"),
    ("audio config missing voice", chat(modalities=["text", "audio"], audio={"format": "wav"}), 422, "audio.voice"),
    ("streamed audio not pcm16", chat(modalities=["text", "audio"], audio=AUDIO_OUT, stream=True),
     400, "audio.format"),
    ("stream_options without stream", chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream_options unknown key", chat(stream=True, stream_options={"x": 1}), 422, "stream_options.x"),
    ("empty messages", chat(messages=[]), 422, "messages"),
    ("unknown role", chat(messages=[{"role": "tool", "content": "x"}]), 422, "messages.0.role"),
    ("message without content", chat(messages=[{"role": "user"}]), 422, "messages.0.content"),
    ("content is a number", chat(messages=[{"role": "user", "content": 5}]), 422, "messages.0.content"),
    ("unknown part type", user_parts({"type": "image_url", "image_url": {"url": "x"}}),
     422, "messages.0.content.0"),
    ("part is not an object", user_parts("hi"), 422, "messages.0.content.0"),  # type: ignore[arg-type]
    ("text part without text", user_parts({"type": "text"}), 422, "messages.0.content.0.text"),
    ("extra key in a part", user_parts({"type": "text", "text": "a", "x": 1}), 422, "messages.0.content.0.x"),
    ("input_audio without data", user_parts({"type": "input_audio", "input_audio": {"format": "wav"}}),
     422, "messages.0.content.0.input_audio.data"),
    ("input_audio with empty data", user_parts({"type": "input_audio", "input_audio": {"data": ""}}),
     422, "messages.0.content.0.input_audio.data"),
    ("input_audio unknown format",
     user_parts({"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "aac"}}),
     422, "messages.0.content.0.input_audio.format"),
    ("audio_url without url", user_parts({"type": "audio_url", "audio_url": {}}),
     422, "messages.0.content.0.audio_url.url"),
    ("internal raw-bytes part from a client", user_parts({"type": "audio", "audio": "AAAA"}),
     422, "messages.0.content.0"),
]


@pytest.mark.parametrize("body,status,param", [c[1:] for c in MALFORMED_CHAT], ids=[c[0] for c in MALFORMED_CHAT])
def test_malformed_chat_request(body: dict[str, Any], status: int, param: str | None) -> None:
    err = error_of(body)
    assert (err.status, err.param, err.type) == (status, param, "invalid_request_error"), err.message
    assert err.body()["error"]["param"] == param


def test_validation_error_envelope_lists_fields_without_echoing_input() -> None:
    secret = "sk-should-not-leak"
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(chat(temperature=9, api_key=secret))
    err = from_validation_error(info.value)
    assert err.status == 422 and err.code == "invalid_schema" and err.param in ("temperature", "api_key")
    assert "temperature" in err.message and "api_key" in err.message and secret not in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_stop_sequences_message() -> None:
    assert error_of(chat(stop=["x"])).message == "stop sequences are not supported"
    assert "tool" in error_of(chat(tools=[])).message


@pytest.mark.parametrize("raw,status", [(b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400),
                                        (b'{"model": "' + b"x" * 200 + b'"}', 413)])
def test_body_parsing_errors(raw: bytes, status: int) -> None:
    assert error_of(raw, limits=ServiceLimits(max_request_bytes=100)).status == status


@pytest.mark.parametrize("depth", [900, 100_000])
def test_deeply_nested_bodies_are_a_400(depth: int) -> None:
    """Nesting the decoder takes (900 lists) and nesting past Python's recursion limit: a 400, not a RecursionError
    (a 500) in the decoder or in the check of the body's strings."""
    raw = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    error = error_of(raw)
    assert error.status in (400, 422) and error.type == "invalid_request_error"


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": [{"role": "user", "content": "\\udcff"}]}',  # escaped, without its pair
    b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xb3\xbf"}]}',  # raw bytes Python's decoder passes
    b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
    b'{"model": "m", "input": "hi", "voice": "\\ud800"}',
])
def test_lone_surrogates_are_refused_as_not_text(raw: bytes) -> None:
    """JSON escapes (and Python's decoder on raw bytes) let a lone UTF-16 surrogate into a string, which no text
    encoder takes (the tokenizer failed on it with a 500): a 400 before anything reads the text. An escaped pair
    is one character, and passes."""
    error = error_of(raw)
    assert (error.status, error.code) == (400, "invalid_json") and "surrogate" in error.message
    paired = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}',
                           ChatCompletionRequest, LIMITS)
    assert paired.messages[0].content == "\U0001f600"


MALFORMED_SPEECH: list[tuple[str, dict[str, Any], int, str]] = [
    ("empty input", speech(input=""), 422, "input"),
    ("whitespace input", speech(input="  \n"), 422, "input"),
    ("input too long", speech(input="a" * (LIMITS.max_speech_input_chars + 1)), 400, "input"),
    ("speed 2", speech(speed=2.0), 400, "speed"),
    ("speed out of range", speech(speed=10), 422, "speed"),
    ("unknown format", speech(response_format="aac"), 422, "response_format"),
    ("instructions too long", speech(instructions="x" * 5000), 400, "instructions"),
    ("instructions not a string", speech(instructions=["calm"]), 422, "instructions"),
    ("streamed mp3", speech(stream=True, response_format="mp3"), 400, "response_format"),
    ("missing voice", {"model": "m", "input": "hi"}, 422, "voice"),
    ("unknown field", speech(language="en"), 422, "language"),
]


@pytest.mark.parametrize("body,status,param", [c[1:] for c in MALFORMED_SPEECH], ids=[c[0] for c in MALFORMED_SPEECH])
def test_malformed_speech_request(body: dict[str, Any], status: int, param: str) -> None:
    err = error_of(body, SpeechRequest)
    assert (err.status, err.param) == (status, param), err.message


@pytest.mark.parametrize("fmt,content_type,encoder", [("wav", "audio/wav", "wav"), ("pcm", "audio/pcm", "pcm16"),
                                                      ("flac", "audio/flac", "flac"), ("mp3", "audio/mpeg", "mp3"),
                                                      ("opus", "audio/ogg", "opus")])
def test_speech_formats(fmt: str, content_type: str, encoder: str) -> None:
    request = parse_request(speech(response_format=fmt, voice=" Chelsie"), SpeechRequest, LIMITS)
    assert (request.content_type, request.audio_format) == (content_type, encoder)
    kwargs = request.to_speak_kwargs()
    assert request.speaker == "chelsie" and kwargs["speaker"] == "chelsie" and kwargs["instructions"] is None
    assert kwargs["talker_sampling"].temperature == 0.9  # not greedy: the released Talker settings
    greedy = parse_request(speech(temperature=0, seed=3), SpeechRequest, LIMITS).to_speak_kwargs()["talker_sampling"]
    assert greedy.greedy and greedy.repetition_penalty == 1.05
    styled = parse_request(speech(instructions="Say it cheerfully."), SpeechRequest, LIMITS)
    assert styled.to_speak_kwargs()["instructions"] == "Say it cheerfully."
    assert parse_request(speech(), SpeechRequest, LIMITS).response_format == "wav"
    assert parse_request(speech(stream=True, response_format="pcm"), SpeechRequest, LIMITS).stream


def test_generate_kwargs_audio_greedy_seed_voice() -> None:
    body = chat(modalities=["text", "audio"], audio={"voice": "Ethan", "format": "flac"}, temperature=0, seed=7,
                max_completion_tokens=64, max_tokens=32, top_k=20, repetition_penalty=1.1)
    kwargs = parse_request(body, ChatCompletionRequest, LIMITS).to_generate_kwargs(LIMITS)
    sampling = kwargs.pop("sampling")
    assert sampling.greedy and sampling.seed == 7 and sampling.top_k == 20 and sampling.repetition_penalty == 1.1
    talker = kwargs.pop("talker_sampling")
    assert talker.greedy  # a greedy request is greedy end to end
    assert kwargs == {"max_tokens": 64, "audio": True, "speaker": "ethan", "audio_format": "flac", "ignore_eos": False}


def test_generate_kwargs_defaults_text_only() -> None:
    request = parse_request(chat(user="u1", metadata={"a": "b"}, store=False, n=1, presence_penalty=0, stop=None,
                                 response_format={"type": "text"}, logprobs=False), ChatCompletionRequest, LIMITS)
    kwargs = request.to_generate_kwargs(ServiceLimits(default_max_tokens=100))
    s = kwargs["sampling"]
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed, s.greedy) == (1.0, 1.0, 0, 1.0, None, False)
    assert kwargs["max_tokens"] == 100 and kwargs["audio"] is False and kwargs["speaker"] is None
    assert ChatCompletionRequest.model_validate(chat(max_tokens=12)).to_generate_kwargs(LIMITS)["max_tokens"] == 12
    capped = ServiceLimits(default_max_tokens=500, max_completion_tokens=50)
    assert ChatCompletionRequest.model_validate(chat()).to_generate_kwargs(capped)["max_tokens"] == 50
    assert not request.wants_audio and not request.include_usage


def test_streaming_request() -> None:
    body = chat(stream=True, stream_options={"include_usage": True}, modalities=["text", "audio"],
                audio={"voice": "aiden", "format": "pcm16"}, temperature=0.7, top_p=0.8)
    request = parse_request(body, ChatCompletionRequest, LIMITS)
    kwargs = request.to_generate_kwargs(LIMITS)
    assert request.include_usage and kwargs["audio_format"] == "pcm16"
    assert (kwargs["sampling"].temperature, kwargs["sampling"].top_p) == (0.7, 0.8)


def test_pipeline_messages_are_prompt_builder_parts() -> None:
    body = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "input_audio", "input_audio": {"data": WAV_B64, "format": "wav"}}]},
        {"role": "assistant", "content": "a tone"}])
    request = asyncio.run(resolve_audio_urls(parse_request(body, ChatCompletionRequest, LIMITS), LIMITS))
    messages = request.to_pipeline_messages()
    assert messages[0] == {"role": "system", "content": "be brief"}
    assert messages[1]["content"][0] == {"type": "text", "text": "what is this?"}
    assert _audio_bytes(messages[1]["content"][1]) == base64.b64decode(WAV_B64)


def test_unresolved_audio_url_is_a_programming_error() -> None:
    request = parse_request(audio_url("data:audio/wav;base64," + WAV_B64), ChatCompletionRequest, LIMITS)
    with pytest.raises(RuntimeError, match="resolve_audio_urls"):
        request.to_pipeline_messages()


def _resolved_parts(body: dict[str, Any], limits: ServiceLimits = LIMITS) -> list[dict[str, Any]]:
    request = asyncio.run(resolve_audio_urls(parse_request(body, ChatCompletionRequest, limits), limits))
    return request.to_pipeline_messages()[0]["content"]


def test_data_urls_pass_through_to_the_builder() -> None:
    (good,) = _resolved_parts(audio_url("data:audio/wav;base64," + WAV_B64))
    assert _audio_bytes(good) == base64.b64decode(WAV_B64)
    (bad,) = _resolved_parts(audio_url("data:audio/wav;base64,not*base64!"))
    assert bad == {"type": "input_audio", "input_audio": {"data": "not*base64!"}}
    with pytest.raises(PromptError):  # the builder's check, surfaced later as a 400
        _audio_bytes(bad)
    assert resolve_error(audio_url("data:audio/wav;base64"), LIMITS).status == 400


def test_input_audio_duration_limit() -> None:
    long_b64 = base64.b64encode(encode_wav(np.zeros(16000 * 3, np.float32), 16000)).decode()
    body = user_parts({"type": "input_audio", "input_audio": {"data": long_b64}},
                      {"type": "audio_url", "audio_url": {"url": "data:;base64," + long_b64}})
    err = resolve_error(body, ServiceLimits(max_audio_seconds=5))
    assert (err.status, err.code) == (413, "audio_too_long")
    assert len(_resolved_parts(body, ServiceLimits(max_audio_seconds=7))) == 2


@pytest.mark.parametrize("url,code", [("https://example.com/a.wav", "audio_url_disabled"),
                                      ("file:///etc/passwd", "local_files_disabled"), ("ftp://host/a.wav", None)])
def test_audio_url_schemes_refused_by_default(url: str, code: str | None) -> None:
    err = resolve_error(audio_url(url), LIMITS)
    assert (err.status, err.code, err.param) == (400, code, "messages.0.content.0.audio_url.url")


def test_local_files(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    wav = base64.b64decode(WAV_B64)
    (allowed / "in.wav").write_bytes(wav)
    (outside / "secret.wav").write_bytes(wav)
    (allowed / "escape.wav").symlink_to(outside / "secret.wav")
    (allowed / "inner.wav").symlink_to(allowed / "in.wav")
    limits = ServiceLimits(allowed_local_audio_dirs=[str(allowed)])
    for name in ("in.wav", "inner.wav"):
        assert _resolved_parts(audio_url((allowed / name).as_uri()), limits) == [{"type": "audio", "audio": wav}]
    for url in ((outside / "secret.wav").as_uri(), (allowed / "escape.wav").as_uri(),
                f"file://{allowed}/../outside/secret.wav"):
        err = resolve_error(audio_url(url), limits)
        assert (err.status, err.code) == (400, "local_file_not_allowed"), url
    assert resolve_error(audio_url((allowed / "missing.wav").as_uri()), limits).status == 400
    assert resolve_error(audio_url(allowed.as_uri()), limits).status == 400  # a directory
    small = ServiceLimits(allowed_local_audio_dirs=[str(allowed)], max_url_bytes=100)
    assert resolve_error(audio_url((allowed / "in.wav").as_uri()), small).status == 413


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture()
def http_root(tmp_path: Path) -> Iterator[str]:
    """A local static file server: the fetch path is tested without leaving the machine."""
    (tmp_path / "a.wav").write_bytes(base64.b64decode(WAV_B64))
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_http_audio_urls(http_root: str) -> None:
    limits = ServiceLimits(allow_audio_urls=True, url_fetch_timeout_s=5)
    wav = base64.b64decode(WAV_B64)
    assert _resolved_parts(audio_url(f"{http_root}/a.wav"), limits) == [{"type": "audio", "audio": wav}]
    err = resolve_error(audio_url(f"{http_root}/missing.wav"), limits)
    assert (err.status, err.code) == (400, "audio_url_fetch_failed") and "404" in err.message
    assert resolve_error(audio_url(f"{http_root}/a.wav"), limits.model_copy(update={"max_url_bytes": 64})).status == 413


def test_invalid_request_mapping() -> None:
    try:
        try:
            raise AudioTooLongError("audio is 700.00s long, exceeding the limit of 600s")
        except AudioTooLongError as exc:
            raise PromptError(str(exc)) from exc
    except PromptError as wrapped:
        err = invalid_request(wrapped)
    assert (err.status, err.code, err.type) == (413, "audio_too_long", "invalid_request_error")
    err = invalid_request(InvalidRequestError("unknown voice 'alloy'; available: aiden, chelsie, ethan"))
    assert err.status == 400 and "alloy" in err.message


def test_error_constructors() -> None:
    assert bad_request("m", "p", "c").body() == {"error": {"message": "m", "type": "invalid_request_error",
                                                           "param": "p", "code": "c"}}
    assert (too_large("m").status, unprocessable("m").status) == (413, 422)
    limited, busy = rate_limited(2.5), overloaded(0)
    assert (limited.status, limited.type, limited.headers) == (429, "rate_limit_error", {"Retry-After": "3"})
    assert (busy.status, busy.type, busy.headers) == (503, "server_error", {"Retry-After": "1"})
    assert isinstance(busy, Exception) and busy.body()["error"]["code"] == "overloaded"


def test_sse_framing() -> None:
    chunk = chat_chunk("chatcmpl-1", "m", 100, {"role": "assistant", "content": "é"})
    event = sse(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == chunk
    assert SSE_DONE == sse("[DONE]") == b"data: [DONE]\n\n"
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["index"] == 0
    assert chunk["choices"][0]["finish_reason"] is None and "usage" not in chunk
    final = chat_chunk("chatcmpl-1", "m", 100, None, usage=usage_dict(3, 4))
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 7


def test_audio_delta_round_trip() -> None:
    pcm = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0], dtype=np.float32)
    delta = audio_delta("audio_1", pcm, "hel")
    samples = np.frombuffer(base64.b64decode(delta["audio"]["data"]), dtype="<i2")
    np.testing.assert_array_equal(samples, [0, 16384, -16384, 32767, -32767, 32767])
    assert delta["audio"]["id"] == "audio_1" and delta["audio"]["transcript"] == "hel"
    assert audio_delta("audio_1", None, "lo") == {"audio": {"id": "audio_1", "transcript": "lo"}}


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_chat_completion_audio_decodes(fmt: str) -> None:
    pcm = (0.3 * np.sin(np.arange(2400) / 10)).astype(np.float32)
    audio = audio_message("audio_1", pcm, fmt, "hi there", created=1000)
    body = chat_completion("chatcmpl-1", "m", 1000, "hi there", "stop", usage_dict(5, 2, audio_frames=30), audio)
    message = body["choices"][0]["message"]
    assert message["content"] == "hi there" and message["audio"]["transcript"] == "hi there"
    assert message["audio"]["expires_at"] == 4600 and body["object"] == "chat.completion"
    decoded, sr = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="int16")
    assert sr == 24000 and np.array_equal(decoded, np.round(pcm * 32767).astype(np.int16))
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "completion_tokens_details": {"audio_tokens": 30}}
    raw = base64.b64decode(audio_message("a", pcm, "pcm16", "", 0)["data"])
    assert np.array_equal(np.frombuffer(raw, "<i2"), decoded)


def test_text_completion_and_models() -> None:
    finished_usage = {"prompt_tokens": 1, "completion_tokens": 1}  # Finished.usage of a text-only reply
    body = chat_completion("chatcmpl-2", "m", 1, "hello", "length", usage_dict(**finished_usage))
    assert body["choices"][0]["message"]["content"] == "hello" and body["choices"][0]["finish_reason"] == "length"
    assert "audio" not in body["choices"][0]["message"] and "completion_tokens_details" not in body["usage"]
    listing = models_list(["qwen3-omni"], created=5)
    assert listing == {"object": "list", "data": [{"id": "qwen3-omni", "object": "model", "created": 5,
                                                   "owned_by": "omni-ray"}]}
