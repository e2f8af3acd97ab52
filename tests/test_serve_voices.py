"""/v1/audio/voices over real Serve (tiny Base and CustomVoice checkpoints, CPU): a voice uploaded once speaks as its
reference does, is still there and speaks the same after the service restarts, and every bad request is a clear 4xx."""

from __future__ import annotations

import base64
import io
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from _service import own_app, ready_status
from conftest import SERVE_PORT

APP, PREFIX = "voices", "/voices"
BASE, CUSTOM = "qwen3-tts-base", "qwen3-tts"
REFERENCE = Path(__file__).resolve().parent / "goldens" / "qwen3_tts" / "reference.wav"
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
SAMPLES_PER_FRAME = 1920  # 24 kHz at 12.5 frames a second
MAX_VOICES = 3
MAX_REQUEST_BYTES = 1 << 20
GREEDY = {"temperature": 0, "max_new_tokens": 6}


def _args(voices_dir: Path) -> dict[str, Any]:
    engine = {"max_batch": 4, "max_seq_len": 1024}
    base = {"model": {"family": "qwen3_tts", "variant": "base"}, "stages": {"talker": {"engine": engine}},
            "voices_dir": str(voices_dir), "max_voices": MAX_VOICES}
    custom = {"model": {"family": "qwen3_tts", "variant": "custom_voice"}, "stages": {"talker": {"engine": engine}}}
    return {"models": [{"model_name": BASE, "pipeline": base}, {"model_name": CUSTOM, "pipeline": custom}],
            "limits": {"max_audio_seconds": 60, "max_request_bytes": MAX_REQUEST_BYTES}}


class Service:
    """The application on one voices directory, which a test may restart (deleted, then deployed again)."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.apps = ExitStack()
        self.url = ""

    def start(self) -> None:
        self.url = self.apps.enter_context(own_app(f"http://127.0.0.1:{SERVE_PORT}", APP, PREFIX, self.args))

    def restart(self) -> None:
        self.apps.close()
        self.start()


@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    running = Service(_args(tmp_path_factory.mktemp("voices")))
    running.start()
    try:
        yield running
    finally:
        running.apps.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _tone(seconds: float, rate: int = 16000) -> bytes:
    return _wav(0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * rate)) / rate), rate)


def _form(**fields: Any) -> dict[str, Any]:
    """Multipart fields for httpx's `files=`: text as plain form fields, (filename, bytes, type) as files."""
    return {name: value if isinstance(value, tuple) else (None, str(value).encode()) for name, value in fields.items()}


def _upload(url: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/audio/voices", files=_form(**fields), timeout=120)


def _listed(url: str, **params: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{url}/v1/audio/voices", params=params, timeout=30)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["voices"] == [voice["name"] for voice in body["data"]]
    return {voice["name"]: voice for voice in body["data"]}


def _speech_in(client: openai.OpenAI, voice: str) -> bytes:
    """Greedy speech in a stored voice, through the openai client."""
    audio = client.audio.speech.create(model=BASE, voice=voice, input="A voice kept on disk.", response_format="pcm",
                                       extra_body=GREEDY).content
    assert audio and len(audio) % (2 * SAMPLES_PER_FRAME) == 0
    return audio


def test_an_uploaded_voice_speaks_as_its_reference_and_after_a_restart(service: Service) -> None:
    reference = REFERENCE.read_bytes()
    response = _upload(service.url, audio_sample=("reference.wav", reference, "audio/wav"), name="Morning",
                       ref_text=REFERENCE_TEXT)
    assert response.status_code == 200, response.text
    voice = response.json()
    assert voice["object"] == "audio.voice" and voice["id"] == voice["name"] == "Morning" and voice["model"] == BASE
    assert voice["mode"] == "in_context" and voice["text"] == REFERENCE_TEXT and voice["frames"] > 0
    seconds = sf.info(io.BytesIO(reference)).duration
    assert abs(voice["seconds"] - seconds) < 0.01 and isinstance(voice["created"], int)
    assert voice["success"] is True and voice["voice"]["name"] == "Morning"  # vllm-omni's shape too
    assert _listed(service.url)["Morning"] == voice["voice"]  # the only Base model is the default
    assert _listed(service.url, model=BASE)["Morning"] == voice["voice"]

    by_name = _speech_in(_client(service.url), "Morning")
    cloned = httpx.post(f"{service.url}/v1/audio/speech", timeout=120, json={
        "model": BASE, "input": "A voice kept on disk.", "ref_audio": base64.b64encode(reference).decode(),
        "ref_text": REFERENCE_TEXT, "response_format": "pcm", **GREEDY})
    assert cloned.status_code == 200, cloned.text
    assert by_name == cloned.content  # the stored codes and x-vector are the reference's
    assert _speech_in(_client(service.url), "morning") == by_name  # names are matched without case

    service.restart()
    assert _listed(service.url)["Morning"] == voice["voice"]
    assert _speech_in(_client(service.url), "Morning") == by_name


def test_a_deleted_voice_is_gone_and_the_store_keeps_its_cap(service: Service) -> None:
    client = _client(service.url)
    tone = ("tone.wav", _tone(2.0), "audio/wav")
    made = client.audio.voices.create(audio_sample=tone, consent="unused", name="Brief")  # the official client
    assert made.id == made.name == "Brief" and made.object == "audio.voice" and made.created_at > 0
    assert _listed(service.url)["Brief"]["mode"] == "x_vector_only"  # no transcript: the x-vector alone
    assert len(_speech_in(client, "brief")) > 0

    duplicate = _upload(service.url, audio_sample=tone, name="BRIEF")
    assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "voice_exists", duplicate.text
    fillers = [f"filler-{index}" for index in range(MAX_VOICES - len(_listed(service.url)))]
    for name in fillers:
        assert _upload(service.url, audio=tone, name=name, x_vector_only_mode="true").status_code == 200
    full = _upload(service.url, audio_sample=tone, name="one-too-many")
    assert full.status_code == 409 and full.json()["error"]["code"] == "too_many_voices", full.text
    for name in fillers:
        assert httpx.delete(f"{service.url}/v1/audio/voices/{name}", timeout=30).status_code == 200

    deleted = client.audio.voices.delete("Brief")
    assert deleted.deleted and deleted.id == "Brief" and deleted.object == "audio.voice.deleted"
    assert "Brief" not in _listed(service.url)
    with pytest.raises(openai.NotFoundError) as gone:
        client.audio.speech.create(model=BASE, voice="Brief", input="Hi.", response_format="pcm", extra_body=GREEDY)
    assert gone.value.status_code == 404 and gone.value.code == "voice_not_found"
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete("Brief")


def test_the_other_models_list_their_speakers(service: Service) -> None:
    speakers = _listed(service.url, model=CUSTOM)
    assert "vivian" in speakers and speakers["vivian"]["mode"] == "speaker"


TRANSCRIBED = {"audio_sample": ("reference.wav", REFERENCE.read_bytes(), "audio/wav"), "ref_text": REFERENCE_TEXT}
MULTIPART = "multipart/form-data; boundary=edge"
BAD_UPLOADS = [  # (case, form fields or (content type, raw body), status, code)
    ("bad name", {**TRANSCRIBED, "name": "two words"}, 400, "invalid_voice_name"),
    ("name too long", {**TRANSCRIBED, "name": "x" * 65}, 400, "invalid_voice_name"),
    ("no name", TRANSCRIBED, 400, "missing_name"),
    ("no audio", {"name": "silent-film", "ref_text": REFERENCE_TEXT}, 400, "missing_audio"),
    ("undecodable audio", {"name": "noise", "audio_sample": ("a.wav", b"not audio at all", "audio/wav")}, 400,
     "invalid_audio"),
    ("audio too short", {"name": "blip", "audio_sample": ("a.wav", _tone(0.4), "audio/wav")}, 400,
     "ref_audio_too_short"),
    ("audio silent", {"name": "hush", "audio_sample": ("a.wav", _wav(np.zeros(32000)), "audio/wav")}, 400,
     "ref_audio_silent"),
    ("in-context without ref_text", {"name": "untold", "audio_sample": TRANSCRIBED["audio_sample"],
                                     "x_vector_only_mode": "false"}, 400, "missing_ref_text"),
    ("flag not a bool", {**TRANSCRIBED, "name": "maybe", "x_vector_only_mode": "maybe"}, 422, "invalid_schema"),
    ("unknown field", {**TRANSCRIBED, "name": "extra", "colour": "blue"}, 422, "unknown_field"),
    ("a prompt voice", {**TRANSCRIBED, "name": "prompted", "type": "prompt"}, 400, "unsupported_voice_type"),
    ("non-Base model", {**TRANSCRIBED, "name": "custom", "model": CUSTOM}, 400, "unsupported_for_model"),
    ("unknown model", {**TRANSCRIBED, "name": "nowhere", "model": "tts-9"}, 404, "model_not_found"),
    ("not multipart", ("application/json", b'{"name": "json"}'), 400, "invalid_content_type"),
    ("no boundary", ("multipart/form-data", b"--edge\r\n"), 400, "invalid_multipart"),
    ("no closing boundary", (MULTIPART, b'--edge\r\nContent-Disposition: form-data; name="name"\r\n\r\ncut'), 400,
     "invalid_multipart"),
    ("part without headers", (MULTIPART, b"--edge\r\n\r\nname\r\n--edge--\r\n"), 400, "invalid_multipart"),
    ("field twice", (MULTIPART, b'--edge\r\nContent-Disposition: form-data; name="name"\r\n\r\na\r\n'
                                b'--edge\r\nContent-Disposition: form-data; name="name"\r\n\r\nb\r\n--edge--\r\n'), 400,
     "invalid_multipart"),
    ("body too large", {"name": "huge", "audio_sample": ("a.wav", b"\0" * MAX_REQUEST_BYTES, "audio/wav")}, 413,
     "request_too_large"),
]


def _send_bad(url: str, form: Any) -> httpx.Response:
    if isinstance(form, tuple):
        content_type, body = form
        return httpx.post(f"{url}/v1/audio/voices", content=body, headers={"content-type": content_type}, timeout=60)
    return httpx.post(f"{url}/v1/audio/voices", files=_form(**form), timeout=60)


def _assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and set(error) == {"message", "type", "param", "code"} and error["code"] == code, error


@pytest.mark.parametrize("form,status,code", [case[1:] for case in BAD_UPLOADS], ids=[case[0] for case in BAD_UPLOADS])
def test_a_bad_upload_gets_a_clear_4xx(service: Service, form: Any, status: int, code: str) -> None:
    _assert_error(_send_bad(service.url, form), status, code)


BAD_OTHERS = [  # (case, method, path, status, code)
    ("delete an unknown voice", "DELETE", "/v1/audio/voices/nobody", 404, "voice_not_found"),
    ("delete a bad name", "DELETE", "/v1/audio/voices/no.dots", 400, "invalid_voice_name"),
    ("delete from CustomVoice", "DELETE", f"/v1/audio/voices/vivian?model={CUSTOM}", 400, "unsupported_for_model"),
    ("list an unknown model", "GET", "/v1/audio/voices?model=tts-9", 404, "model_not_found"),
]


@pytest.mark.parametrize("method,path,status,code", [case[1:] for case in BAD_OTHERS],
                         ids=[case[0] for case in BAD_OTHERS])
def test_a_bad_list_or_delete_gets_a_clear_4xx(service: Service, method: str, path: str, status: int,
                                               code: str) -> None:
    _assert_error(httpx.request(method, f"{service.url}{path}", timeout=30), status, code)


def test_after_bad_requests_the_service_serves_and_stored_nothing(service: Service) -> None:
    before = _listed(service.url)
    for _, form, status, _ in BAD_UPLOADS:
        assert _send_bad(service.url, form).status_code == status
    assert _listed(service.url) == before
    assert ready_status(service.url) == 200
    speech = httpx.post(f"{service.url}/v1/audio/speech", timeout=120, json={
        "model": CUSTOM, "input": "Still here.", "voice": "aiden", "response_format": "pcm", "max_new_tokens": 4})
    assert speech.status_code == 200 and speech.content
