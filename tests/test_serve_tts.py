"""Qwen3-TTS over HTTP beside Qwen3-Omni in one Serve application (tiny checkpoints, CPU): the openai client's speech
calls, voice cloning from ref_audio, finish reasons, and every bad request a clear 4xx with nothing left running."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from _service import own_app, stage_streams, wait_until
from conftest import SERVE_PORT

APP, PREFIX = "speech-models", "/speech-models"
CUSTOM, BASE, OMNI = "qwen3-tts", "qwen3-tts-base", "qwen3-omni"
SAMPLES_PER_FRAME = 1920  # 24 kHz at 12.5 frames a second
REFERENCE = Path(__file__).resolve().parent / "goldens" / "qwen3_tts" / "reference.wav"
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
SMALL_ENGINE = {"max_batch": 4, "max_seq_len": 1024}


def _tts(variant: str) -> dict[str, Any]:
    return {"model": {"family": "qwen3_tts", "variant": variant},
            "stages": {"talker": {"engine": SMALL_ENGINE}}}


ARGS = {
    "models": [
        {"model_name": CUSTOM, "pipeline": _tts("custom_voice")},
        {"model_name": BASE, "pipeline": _tts("base")},
        {"model_name": OMNI, "pipeline": {"model": {"family": "qwen3_omni"}}},
    ],
    "limits": {"max_audio_seconds": 60},
}


@pytest.fixture(scope="module")
def url(ray_cluster: str) -> Iterator[str]:
    """One application serving CustomVoice, Base and Qwen3-Omni side by side, beside whatever else Serve runs."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    with own_app(f"http://127.0.0.1:{SERVE_PORT}", APP, PREFIX, ARGS) as app_url:
        yield app_url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _wav_b64(samples: np.ndarray, rate: int) -> str:
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


def _tone(seconds: float, rate: int = 16000) -> str:
    t = np.arange(int(seconds * rate)) / rate
    return _wav_b64(0.3 * np.sin(2 * np.pi * 220 * t), rate)


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.int16)


def _speech_events(url: str, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """A `stream_format: sse` speech request: the audio's bytes and the speech.audio.done event."""
    audio, done = b"", None
    with httpx.stream("POST", f"{url}/v1/audio/speech", json={**body, "stream_format": "sse"}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["type"] == "speech.audio.delta":
                    audio += base64.b64decode(event["audio"])
                else:
                    done = event
    assert done is not None and done["type"] == "speech.audio.done"
    return audio, done


def test_one_application_serves_every_model_and_is_ready_with_every_stage(url: str) -> None:
    from ray import serve

    assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} == {CUSTOM, BASE, OMNI}
    assert httpx.get(f"{url}/ready").status_code == 200
    deployments = set(serve.status().applications[APP].deployments)
    assert deployments == {"ingress", *(f"{CUSTOM}-{stage}" for stage in ("reference", "talker", "vocoder")),
                           *(f"{BASE}-{stage}" for stage in ("reference", "talker", "vocoder")),
                           *(f"{OMNI}-{stage}" for stage in ("encoder", "thinker", "talker", "vocoder"))}
    # the same route takes each family's own request shape
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": OMNI, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == OMNI
    omni_speech = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
        "model": OMNI, "input": "Hi there.", "voice": "ethan", "response_format": "pcm", "max_new_tokens": 3})
    assert omni_speech.status_code == 200 and len(omni_speech.content) > 0
    assert omni_speech.headers["X-Finish-Reason"] == "length"


def test_openai_client_speech_whole_and_streamed_are_the_same_audio(client: openai.OpenAI, url: str) -> None:
    """CustomVoice through the official client, greedy: the whole file, the streamed body and the SSE events carry
    the same samples, whole frames of them, and say why the speech ended."""
    common = {"model": CUSTOM, "voice": "Vivian", "input": "Hello from the speech service."}
    extra = {"language": "English", "temperature": 0, "max_new_tokens": 10}
    whole = client.audio.speech.with_raw_response.create(**common, response_format="wav", extra_body=extra)
    samples, rate = sf.read(io.BytesIO(whole.content), dtype="int16")
    reason = whole.headers["X-Finish-Reason"]
    assert rate == 24000 and len(samples) % SAMPLES_PER_FRAME == 0 and 0 < len(samples) <= 10 * SAMPLES_PER_FRAME
    assert reason in ("stop", "length") and (reason == "length") == (len(samples) == 10 * SAMPLES_PER_FRAME)

    with client.audio.speech.with_streaming_response.create(
            **common, response_format="pcm", extra_body={**extra, "stream": True}) as response:
        streamed = b"".join(response.iter_bytes())
    assert np.array_equal(_pcm(streamed), samples)

    plain = client.audio.speech.create(**common, response_format="pcm", extra_body=extra)
    assert np.array_equal(_pcm(plain.content), samples)

    events, done = _speech_events(url, {**common, **extra, "response_format": "pcm"})
    assert np.array_equal(_pcm(events), samples)
    assert done["finish_reason"] == reason and done["usage"]["output_tokens"] * SAMPLES_PER_FRAME == len(samples)


def test_a_voice_cloned_from_ref_audio_speaks_whole_frames(url: str) -> None:
    """Base: the committed reference speech as base64 with its transcript (in-context), and as a data: URL alone
    (x-vector only)."""
    reference = base64.b64encode(REFERENCE.read_bytes()).decode()
    body = {"model": BASE, "input": "A voice of its own.", "voice": "default", "task_type": "Base",
            "ref_audio": reference, "ref_text": REFERENCE_TEXT, "response_format": "pcm", "max_new_tokens": 8,
            "seed": 3}
    audio, done = _speech_events(url, body)
    frames = done["usage"]["output_tokens"]
    assert 0 < frames <= 8 and len(_pcm(audio)) == frames * SAMPLES_PER_FRAME
    assert np.abs(_pcm(audio)).max() > 0

    x_vector_only = {**body, "ref_audio": f"data:audio/wav;base64,{reference}", "x_vector_only_mode": True}
    del x_vector_only["ref_text"]
    response = httpx.post(f"{url}/v1/audio/speech", json=x_vector_only, timeout=120)
    assert response.status_code == 200 and response.headers["X-Finish-Reason"] in ("stop", "length")
    assert 0 < len(_pcm(response.content)) <= 8 * SAMPLES_PER_FRAME


def test_finish_reason_length_when_max_new_tokens_cuts_the_speech(client: openai.OpenAI, url: str) -> None:
    for model, voice in ((CUSTOM, "ryan"), (OMNI, "ethan")):
        response = client.audio.speech.with_raw_response.create(
            model=model, voice=voice, input="A long sentence that needs many more frames than three.",
            response_format="pcm", extra_body={"max_new_tokens": 3})
        assert response.headers["X-Finish-Reason"] == "length", model
        if model == CUSTOM:
            assert len(_pcm(response.content)) == 3 * SAMPLES_PER_FRAME
        _, done = _speech_events(url, {"model": model, "voice": voice, "input": "Three frames only, please.",
                                       "response_format": "pcm", "max_new_tokens": 3})
        assert done["finish_reason"] == "length" and done["usage"]["output_tokens"] == 3


def _ref(seconds: float, **extra: Any) -> dict[str, Any]:
    return {"model": BASE, "input": "Hi.", "ref_audio": _tone(seconds), "ref_text": "a tone", **extra}


# (name, path, body, status, error code)
BAD: list[tuple[str, str, dict[str, Any], int, str | None]] = [
    ("unknown voice", "/v1/audio/speech", {"model": CUSTOM, "input": "Hi.", "voice": "nobody"}, 400, "invalid_voice"),
    ("unsupported language", "/v1/audio/speech", {"model": CUSTOM, "input": "Hi.", "voice": "vivian",
                                                  "language": "Klingon"}, 400, "unsupported_language"),
    ("reference too short", "/v1/audio/speech", _ref(0.4), 400, "ref_audio_too_short"),
    ("reference too long", "/v1/audio/speech", _ref(31), 400, "ref_audio_too_long"),
    ("reference over max_audio_seconds", "/v1/audio/speech", _ref(61), 413, "audio_too_long"),
    ("reference silent", "/v1/audio/speech", {**_ref(2), "ref_audio": _wav_b64(np.zeros(32000), 16000)}, 400,
     "ref_audio_silent"),
    ("reference undecodable", "/v1/audio/speech",
     {**_ref(2), "ref_audio": base64.b64encode(b"not audio at all").decode()}, 400, "invalid_audio"),
    ("reference not base64", "/v1/audio/speech", {**_ref(2), "ref_audio": "@@not base64@@"}, 400, "invalid_base64"),
    ("reference url disabled", "/v1/audio/speech", {**_ref(2), "ref_audio": "http://example.com/a.wav"}, 400,
     "audio_url_disabled"),
    ("ref_text missing in context", "/v1/audio/speech", {**_ref(2), "ref_text": None}, 400, "missing_ref_text"),
    ("Base without a reference", "/v1/audio/speech", {"model": BASE, "input": "Hi."}, 400, "unsupported_for_model"),
    ("Base naming a voice never stored", "/v1/audio/speech", {"model": BASE, "input": "Hi.", "voice": "nobody"}, 404,
     None),
    ("ref_audio to CustomVoice", "/v1/audio/speech", {**_ref(2), "model": CUSTOM}, 400, "unsupported_for_model"),
    ("instructions to Base", "/v1/audio/speech", _ref(2, instructions="whisper"), 400, "unsupported_for_model"),
    ("task_type of another variant", "/v1/audio/speech",
     {"model": CUSTOM, "input": "Hi.", "voice": "vivian", "task_type": "VoiceDesign"}, 400, "unsupported_task_type"),
    ("Omni's speech field to TTS", "/v1/audio/speech", {"model": CUSTOM, "input": "Hi.", "speed": 2.0}, 400, None),
    ("TTS field to Omni", "/v1/audio/speech", {"model": OMNI, "input": "Hi.", "voice": "ethan", "ref_text": "x"}, 422,
     "invalid_schema"),
    ("chat to a TTS model", "/v1/chat/completions",
     {"model": CUSTOM, "messages": [{"role": "user", "content": "Hi"}]}, 400, "unsupported_model"),
    ("unknown model", "/v1/audio/speech", {"model": "tts-9", "input": "Hi.", "voice": "vivian"}, 404,
     "model_not_found"),
]


@pytest.mark.parametrize("name,path,body,status,code", BAD, ids=[case[0] for case in BAD])
def test_a_bad_request_gets_a_clear_4xx(url: str, name: str, path: str, body: dict[str, Any], status: int,
                                        code: str | None) -> None:
    response = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and set(error) == {"message", "type", "param", "code"}
    assert code is None or error["code"] == code, error


def test_after_bad_requests_nothing_is_left_running_and_the_service_serves(url: str) -> None:
    for case in BAD:
        assert httpx.post(f"{url}{case[1]}", json=case[2], timeout=60).status_code == case[3]
    body = {"model": CUSTOM, "input": "Still here.", "voice": "aiden", "response_format": "pcm", "max_new_tokens": 4}
    assert httpx.post(f"{url}/v1/audio/speech", json=body, timeout=120).status_code == 200
    idle = lambda: all(sum(stage_streams(url, stage).values()) == 0 for stage in ("reference", "talker", "vocoder"))
    assert wait_until(idle, 10), {stage: stage_streams(url, stage) for stage in ("reference", "talker", "vocoder")}
    assert httpx.get(f"{url}/ready").status_code == 200


def test_ignore_eos_speaks_exactly_max_new_tokens_frames(url: str) -> None:
    """The benchmarks' fixed-length speech: `ignore_eos` runs every request to its `max_new_tokens`."""
    body = {"model": CUSTOM, "input": "Fixed length, whatever the model samples.", "voice": "vivian",
            "response_format": "pcm", "max_new_tokens": 12, "ignore_eos": True}
    for seed in (0, 1, 2):
        response = httpx.post(f"{url}/v1/audio/speech", json={**body, "seed": seed}, timeout=120)
        assert response.status_code == 200 and response.headers["X-Finish-Reason"] == "length"
        assert len(_pcm(response.content)) == 12 * SAMPLES_PER_FRAME
