"""fish-speech's HTTP API over real Serve (tiny Qwen3-TTS Base checkpoint, CPU): /v1/tts from a msgpack client that
streams and from JSON, /v1/references on the store /v1/audio/voices shares, `references` on /v1/audio/speech, and
every bad request a clear 4xx with the service still serving."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgpack
import numpy as np
import pytest
import soundfile as sf

from _service import own_app, stage_streams, wait_until
from conftest import SERVE_PORT

APP, PREFIX = "fish-api", "/fish-api"
BASE = "qwen3-tts-base"
REFERENCE = Path(__file__).resolve().parent / "goldens" / "qwen3_tts" / "reference.wav"
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
SAMPLES_PER_FRAME = 1920  # 24 kHz at 12.5 frames a second
FRAMES = 6
MAX_AUDIO_SECONDS = 20
MAX_REQUEST_BYTES = 2 << 20


@pytest.fixture(scope="module")
def url(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ray import serve

    engine = {"max_batch": 4, "max_seq_len": 1024}
    base = {"model": {"family": "qwen3_tts", "variant": "base"}, "stages": {"talker": {"engine": engine}},
            "voices_dir": str(tmp_path_factory.mktemp("fish-voices"))}
    args = {"models": [{"model_name": BASE, "pipeline": base}],
            "limits": {"max_audio_seconds": MAX_AUDIO_SECONDS, "max_request_bytes": MAX_REQUEST_BYTES}}
    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    with own_app(f"http://127.0.0.1:{SERVE_PORT}", APP, PREFIX, args) as app_url:
        yield app_url


def _tone(seconds: float, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    samples = 0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate)
    sf.write(buffer, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def official_request(**fields: Any) -> dict[str, Any]:
    """Every field the official client sends (its defaults), the reference audio as raw bytes."""
    return {"text": "A voice from fish.", "references": [{"audio": REFERENCE.read_bytes(), "text": REFERENCE_TEXT}],
            "reference_id": None, "format": "wav", "latency": "normal", "max_new_tokens": FRAMES, "chunk_length": 300,
            "top_p": 0.8, "repetition_penalty": 1.1, "temperature": 0.8, "streaming": False, "use_memory_cache": "off",
            "seed": 7, **fields}


def post_msgpack(url: str, body: Any, path: str = "/v1/tts") -> httpx.Response:
    """As the official client posts: a msgpack body, `?format=msgpack`."""
    return httpx.post(f"{url}{path}", params={"format": "msgpack"}, content=msgpack.packb(body, use_bin_type=True),
                      headers={"content-type": "application/msgpack"}, timeout=120)


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json() if "json" in response.headers["content-type"] else msgpack.unpackb(response.content)
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body
    return body


def test_a_msgpack_client_streams_raw_pcm_the_same_as_the_whole_reply(url: str) -> None:
    """The official client's request, streamed: raw 16-bit PCM (no WAV header) as fish-speech sends it, read in
    1024-byte pieces, the same samples as the whole file of the same seed."""
    body = official_request(streaming=True)
    with httpx.stream("POST", f"{url}/v1/tts", params={"format": "msgpack"}, timeout=120,
                      content=msgpack.packb(body, use_bin_type=True),
                      headers={"content-type": "application/msgpack"}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers["content-disposition"] == "attachment; filename=audio.wav"
        streamed = b"".join(response.iter_bytes(chunk_size=1024))
    assert not streamed.startswith(b"RIFF") and len(streamed) % (2 * SAMPLES_PER_FRAME) == 0
    assert 0 < len(streamed) <= FRAMES * SAMPLES_PER_FRAME * 2

    whole = post_msgpack(url, official_request())
    assert whole.status_code == 200 and whole.headers["content-type"] == "audio/wav"
    samples, rate = sf.read(io.BytesIO(whole.content), dtype="int16")
    assert rate == 24000 and np.array_equal(samples, np.frombuffer(streamed, np.int16))


def test_a_json_request_gets_a_whole_wav(url: str) -> None:
    reference = base64.b64encode(REFERENCE.read_bytes()).decode()
    response = httpx.post(f"{url}/v1/tts", timeout=120, json={
        "text": "Plain JSON.", "references": [{"audio": reference, "text": REFERENCE_TEXT}], "max_new_tokens": FRAMES,
        "normalize": False, "an_unknown_field": 1})
    assert response.status_code == 200, response.text
    samples, rate = sf.read(io.BytesIO(response.content), dtype="int16")
    assert rate == 24000 and 0 < len(samples) <= FRAMES * SAMPLES_PER_FRAME and len(samples) % SAMPLES_PER_FRAME == 0
    assert np.abs(samples).max() > 0 and response.headers["X-Finish-Reason"] in ("stop", "length")

    raw = httpx.post(f"{url}/v1/tts", timeout=120, json={
        "text": "Raw.", "references": [{"audio": reference, "text": REFERENCE_TEXT}], "max_new_tokens": 3,
        "format": "pcm"})
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/octet-stream"
    assert 0 < len(raw.content) <= 3 * SAMPLES_PER_FRAME * 2


def _references(url: str) -> list[str]:
    listed = httpx.get(f"{url}/v1/references/list", timeout=30)  # msgpack unless JSON is asked for
    assert listed.status_code == 200 and listed.headers["content-type"] == "application/msgpack"
    body = msgpack.unpackb(listed.content)
    assert body["success"] is True
    return body["reference_ids"]


def _voices(url: str) -> dict[str, dict[str, Any]]:
    return {voice["name"]: voice for voice in httpx.get(f"{url}/v1/audio/voices", timeout=30).json()["data"]}


def test_references_add_list_use_update_delete_on_the_shared_voice_store(url: str) -> None:
    added = httpx.post(f"{url}/v1/references/add", timeout=120, data={"id": "Tea", "text": REFERENCE_TEXT},
                       files={"audio": ("reference.wav", REFERENCE.read_bytes(), "audio/wav")})
    assert added.status_code == 200 and msgpack.unpackb(added.content) == {
        "success": True, "message": "Reference voice 'Tea' added successfully", "reference_id": "Tea"}
    assert "Tea" in _references(url)
    voice = _voices(url)["Tea"]  # the same store as /v1/audio/voices
    assert voice["mode"] == "in_context" and voice["text"] == REFERENCE_TEXT

    by_id = post_msgpack(url, official_request(references=[], reference_id="Tea", format="pcm"))
    by_audio = post_msgpack(url, official_request(format="pcm"))
    assert by_id.status_code == 200 and by_id.content == by_audio.content  # the stored voice is its reference's
    speech = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
        "model": BASE, "input": "A voice from fish.", "voice": "Tea", "response_format": "pcm",
        "max_new_tokens": FRAMES, "seed": 7, "temperature": 0.8, "top_p": 0.8, "repetition_penalty": 1.1})
    assert speech.status_code == 200 and speech.content == by_id.content

    renamed = httpx.post(f"{url}/v1/references/update", params={"format": "json"}, timeout=30,
                         json={"old_reference_id": "Tea", "new_reference_id": "Coffee"})
    assert renamed.status_code == 200 and renamed.json()["new_reference_id"] == "Coffee", renamed.text
    assert "Coffee" in _references(url) and "Tea" not in _voices(url)
    assert post_msgpack(url, official_request(references=[], reference_id="Tea")).status_code == 404
    assert post_msgpack(url, official_request(references=[], reference_id="Coffee", format="pcm")).content \
        == by_id.content

    deleted = httpx.request("DELETE", f"{url}/v1/references/delete", headers={"accept": "application/json"},
                            json={"reference_id": "Coffee"}, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["success"] is True, deleted.text
    assert "Coffee" not in _references(url) and "Coffee" not in _voices(url)


def test_a_voice_uploaded_to_audio_voices_is_a_reference(url: str) -> None:
    uploaded = httpx.post(f"{url}/v1/audio/voices", timeout=120, files={
        "audio_sample": ("tone.wav", _tone(2.0), "audio/wav"), "name": (None, b"Hum"), "ref_text": (None, b"a hum")})
    assert uploaded.status_code == 200, uploaded.text
    assert "Hum" in _references(url)
    conflict = httpx.post(f"{url}/v1/references/update", params={"format": "json"}, timeout=30,
                          json={"old_reference_id": "Hum", "new_reference_id": "hum"})
    assert conflict.status_code == 200 and "hum" in _references(url)  # a change of case only
    deleted = httpx.request("DELETE", f"{url}/v1/references/delete", content=msgpack.packb({"reference_id": "HUM"}),
                            headers={"content-type": "application/msgpack"}, timeout=30)
    assert deleted.status_code == 200 and "hum" not in _voices(url)


def test_audio_speech_takes_references(url: str) -> None:
    reference = base64.b64encode(REFERENCE.read_bytes()).decode()
    body = {"model": BASE, "input": "A list of one.", "response_format": "pcm", "max_new_tokens": 4, "seed": 1}
    listed = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                        json={**body, "references": [{"audio": reference, "text": REFERENCE_TEXT}]})
    single = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                        json={**body, "ref_audio": reference, "ref_text": REFERENCE_TEXT})
    assert listed.status_code == 200 and listed.content == single.content and len(listed.content) > 0


TONE = base64.b64encode(_tone(2.0)).decode()
GOOD_REF = {"audio": TONE, "text": "a tone"}
# (name, how it is sent, path, body, status, error code); "msgpack" bodies are packed, "raw" ones sent as they are
BAD: list[tuple[str, str, str, Any, int, str | None]] = [
    ("msgpack that does not decode", "raw", "/v1/tts", b"\xc1\x00", 400, "invalid_msgpack"),
    ("msgpack with trailing bytes", "raw", "/v1/tts", msgpack.packb({"text": "x"}) + b"\x01", 400, "invalid_msgpack"),
    ("msgpack that is not a map", "msgpack", "/v1/tts", ["text"], 400, "invalid_msgpack"),
    ("neither JSON nor msgpack", "text", "/v1/tts", b"text=hello", 415, "unsupported_media_type"),
    ("JSON that does not parse", "json-raw", "/v1/tts", b"{not json", 400, "invalid_json"),
    ("no text", "msgpack", "/v1/tts", {"references": [GOOD_REF]}, 422, "invalid_schema"),
    ("temperature out of range", "msgpack", "/v1/tts", {"text": "x", "references": [GOOD_REF], "temperature": 5},
     422, "invalid_schema"),
    ("unknown format", "msgpack", "/v1/tts", {"text": "x", "references": [GOOD_REF], "format": "aiff"}, 400,
     "unsupported_format"),
    ("streaming mp3", "msgpack", "/v1/tts", {"text": "x", "references": [GOOD_REF], "format": "mp3",
                                             "streaming": True}, 400, "unsupported_format"),
    ("reference audio undecodable", "msgpack", "/v1/tts",
     {"text": "x", "references": [{"audio": b"not audio at all", "text": "t"}]}, 400, "invalid_audio"),
    ("reference audio over max_audio_seconds", "msgpack", "/v1/tts",
     {"text": "x", "references": [{"audio": _tone(MAX_AUDIO_SECONDS + 1), "text": "t"}]}, 413, "audio_too_long"),
    ("reference audio too short", "msgpack", "/v1/tts",
     {"text": "x", "references": [{"audio": _tone(0.3), "text": "t"}]}, 400, "ref_audio_too_short"),
    ("reference without text", "msgpack", "/v1/tts", {"text": "x", "references": [{"audio": _tone(2.0)}]}, 400,
     "missing_ref_text"),
    ("two references to a one-reference family", "msgpack", "/v1/tts",
     {"text": "x", "references": [GOOD_REF, GOOD_REF]}, 400, "too_many_references"),
    ("unknown reference_id", "msgpack", "/v1/tts", {"text": "x", "reference_id": "nobody"}, 404, "voice_not_found"),
    ("unknown model", "msgpack", "/v1/tts", {"text": "x", "references": [GOOD_REF], "model": "tts-9"}, 404,
     "model_not_found"),
    ("body over max_request_bytes", "msgpack", "/v1/tts",
     {"text": "x", "references": [{"audio": b"\x00" * MAX_REQUEST_BYTES, "text": "t"}]}, 413, None),
    ("speech with references and ref_audio", "json", "/v1/audio/speech",
     {"model": BASE, "input": "x", "ref_audio": TONE, "references": [GOOD_REF]}, 400, "conflicting_references"),
    ("speech with two references", "json", "/v1/audio/speech",
     {"model": BASE, "input": "x", "references": [GOOD_REF, GOOD_REF]}, 400, "too_many_references"),
    ("add: id with a slash", "form", "/v1/references/add", {"id": "../up", "text": "t"}, 400,
     "invalid_reference_id"),
    ("add: id with a space", "form", "/v1/references/add", {"id": "two words", "text": "t"}, 400,
     "invalid_reference_id"),
    ("add: no text", "form", "/v1/references/add", {"id": "quiet", "text": " "}, 400, "missing_field"),
    ("add: audio undecodable", "msgpack", "/v1/references/add", {"id": "noise", "text": "t", "audio": b"noise"}, 400,
     "invalid_audio"),
    ("add: no audio", "msgpack", "/v1/references/add", {"id": "silent", "text": "t"}, 400, "missing_audio"),
    ("update: unknown id", "json", "/v1/references/update", {"old_reference_id": "nobody", "new_reference_id": "b"},
     404, "voice_not_found"),
    ("update: the same id", "json", "/v1/references/update", {"old_reference_id": "a", "new_reference_id": "a"}, 400,
     "invalid_reference_id"),
]


def send(url: str, how: str, path: str, body: Any) -> httpx.Response:
    if how == "raw":
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/msgpack"}, timeout=60)
    if how == "msgpack":
        return post_msgpack(url, body, path)
    if how == "text":
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "text/plain"}, timeout=60)
    if how == "json-raw":
        return httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
    if how == "form":
        files = {"audio": ("tone.wav", _tone(2.0), "audio/wav")}
        return httpx.post(f"{url}{path}", data=body, files=files, timeout=60)
    return httpx.post(f"{url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("name,how,path,body,status,code", BAD, ids=[case[0] for case in BAD])
def test_a_bad_request_gets_a_clear_4xx(url: str, name: str, how: str, path: str, body: Any, status: int,
                                        code: str | None) -> None:
    response = send(url, how, path, body)
    assert response.status_code == status, response.content[:500]
    answer = _error(response)
    assert code is None or answer["error"]["code"] == code, answer
    # /v1/tts fails in JSON; /v1/references in msgpack only when asked for by name (`?format=msgpack`)
    asked_msgpack = how == "msgpack" and path.startswith("/v1/references")
    assert response.headers["content-type"] == ("application/msgpack" if asked_msgpack else "application/json")
    if path.startswith("/v1/references"):  # fish-speech's failure fields beside the envelope
        assert answer["success"] is False and answer["message"] == answer["error"]["message"]


def test_references_delete_of_an_unknown_id_is_a_404_in_both_answers(url: str) -> None:
    as_msgpack = httpx.request("DELETE", f"{url}/v1/references/delete", params={"format": "msgpack"},
                               json={"reference_id": "nobody"}, timeout=30)
    assert as_msgpack.status_code == 404 and as_msgpack.headers["content-type"] == "application/msgpack"
    answer = msgpack.unpackb(as_msgpack.content)
    assert answer["success"] is False and answer["reference_id"] == "nobody"
    assert answer["error"]["code"] == "voice_not_found"
    as_json = httpx.request("DELETE", f"{url}/v1/references/delete", json={"reference_id": "nobody"}, timeout=30)
    assert as_json.status_code == 404 and as_json.json()["message"] == answer["message"]


def test_after_bad_requests_nothing_is_left_running_and_the_service_serves(url: str) -> None:
    for _, how, path, body, status, _code in BAD:
        assert send(url, how, path, body).status_code == status
    good = post_msgpack(url, official_request(max_new_tokens=3, format="pcm"))
    assert good.status_code == 200 and len(good.content) > 0
    idle = lambda: all(sum(stage_streams(url, stage).values()) == 0 for stage in ("reference", "talker", "vocoder"))
    assert wait_until(idle, 10), {stage: stage_streams(url, stage) for stage in ("reference", "talker", "vocoder")}
