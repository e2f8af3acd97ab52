"""fish-speech's API without a service: /v1/tts bodies told apart and checked, mapped onto the speech request, the
references' answer format, and renaming a voice in the shared store."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch

from omni_ray.serve.fish_references import AnswerFormat, answer_format
from omni_ray.serve.fish_tts_api import FishTTSRequest, decode_body, media_type, parse_tts_request, speech_body
from omni_ray.serve.openai_protocol import OpenAIError, ServiceLimits
from omni_ray.serve.speech_protocol import TTSSpeechRequest
from omni_ray.serve.voice_uploads import cloning_model
from omni_ray.voice_store import InvalidVoiceNameError, VoiceExistsError, VoiceNotFoundError, VoiceStore

LIMITS = ServiceLimits(max_request_bytes=4096, max_json_items=64)
MODEL = SimpleNamespace(name="cloner")


def _refused(call: Any, status: int, code: str | None) -> OpenAIError:
    with pytest.raises(OpenAIError) as refused:
        call()
    assert refused.value.status == status and (code is None or refused.value.code == code), refused.value.message
    return refused.value


# ---- bodies ----------------------------------------------------------------------------------------------------------

def test_the_content_type_tells_msgpack_from_json() -> None:
    body = {"text": "hi", "references": [{"audio": b"\x00\x01", "text": "t"}]}
    assert decode_body("application/msgpack", msgpack.packb(body, use_bin_type=True), LIMITS) == body
    assert decode_body("application/x-msgpack; charset=binary", msgpack.packb(body), LIMITS)["text"] == "hi"
    assert decode_body("Application/JSON; charset=utf-8", b'{"text": "hi"}', LIMITS) == {"text": "hi"}
    assert media_type("application/msgpack; q=1") == "application/msgpack" and media_type(None) == ""
    for content_type in (None, "", "text/plain", "multipart/form-data; boundary=x", "msgpack"):
        error = _refused(lambda: decode_body(content_type, b'{"text": "hi"}', LIMITS), 415, "unsupported_media_type")
        assert error.headers["Accept"] == "application/msgpack, application/json"


@pytest.mark.parametrize("raw", [b"", b"\xc1", msgpack.packb({"text": "x"}) + b"\x00", msgpack.packb([1, 2]),
                                 msgpack.packb("text"), b"\xa3\xff\xfe\xfd", msgpack.packb({1: "x"}),
                                 msgpack.packb({"a": list(range(65))}), b"\x91" * 5000])
def test_msgpack_that_is_not_one_map_within_limits_is_a_400(raw: bytes) -> None:
    _refused(lambda: decode_body("application/msgpack", raw, ServiceLimits(max_json_items=64)), 400,
             "invalid_msgpack")


def test_a_msgpack_body_over_the_byte_limit_is_a_413() -> None:
    _refused(lambda: decode_body("application/msgpack", msgpack.packb({"text": "x" * 5000}), LIMITS), 413, None)


def test_the_official_fields_and_their_ranges() -> None:
    request = parse_tts_request({"text": "hi", "prosody": {"speed": 1}, "chunk_length": 300, "latency": "balanced"})
    assert request.format == "wav" and request.streaming is False and request.max_new_tokens == 1024
    assert not hasattr(request, "prosody")  # unknown fields are ignored, as the official server does
    for field, value in (("temperature", 0.05), ("temperature", 1.5), ("top_p", 0.0), ("repetition_penalty", 3.0),
                         ("latency", "fast"), ("use_memory_cache", "maybe"), ("max_new_tokens", -1)):
        _refused(lambda: parse_tts_request({"text": "hi", field: value}), 422, "invalid_schema")
    _refused(lambda: parse_tts_request({"references": []}), 422, "invalid_schema")
    _refused(lambda: parse_tts_request({"text": "hi", "format": "aiff"}), 400, "unsupported_format")
    for compressed in ("mp3", "opus", "flac"):
        assert parse_tts_request({"text": "hi", "format": compressed}).format == compressed
        _refused(lambda: parse_tts_request({"text": "hi", "format": compressed, "streaming": True}), 400,
                 "unsupported_format")
    assert parse_tts_request({"text": "hi", "format": "pcm", "streaming": True}).streaming


def test_a_tts_request_maps_onto_the_speech_request() -> None:
    official = {"text": "Hello.", "references": [{"audio": b"RIFF", "text": "ref"}], "reference_id": None,
                "format": "pcm", "streaming": True, "seed": 3, "max_new_tokens": 40, "top_p": 0.7,
                "repetition_penalty": 1.2, "temperature": 0.6, "normalize": True, "use_memory_cache": "on"}
    body = speech_body(FishTTSRequest.model_validate(official), MODEL)  # type: ignore[arg-type]
    assert body == {"model": "cloner", "input": "Hello.", "response_format": "pcm", "stream": True,
                    "references": [{"audio": b"RIFF", "text": "ref"}], "seed": 3, "temperature": 0.6, "top_p": 0.7,
                    "repetition_penalty": 1.2, "max_new_tokens": 40}
    speech = TTSSpeechRequest.model_validate(body)
    assert speech.cloning_references[0].audio == b"RIFF" and speech.cloning_references[0].text == "ref"

    # reference_id wins over references; fields the client left out keep the model's defaults; 0 frames: no cap
    by_id = speech_body(FishTTSRequest.model_validate({**official, "reference_id": "alice", "max_new_tokens": 0,
                                                       "seed": None}), MODEL)  # type: ignore[arg-type]
    assert by_id["voice"] == "alice" and "references" not in by_id and "max_new_tokens" not in by_id
    plain = speech_body(FishTTSRequest.model_validate({"text": "Hi."}), MODEL)  # type: ignore[arg-type]
    assert plain == {"model": "cloner", "input": "Hi.", "response_format": "wav", "stream": False,
                     "max_new_tokens": 1024}


def test_speech_takes_references_or_ref_audio_not_both() -> None:
    single = TTSSpeechRequest.model_validate({"model": "m", "input": "x", "ref_audio": "QUJD", "ref_text": "t"})
    assert [(r.audio, r.text) for r in single.cloning_references] == [("QUJD", "t")]
    listed = TTSSpeechRequest.model_validate({"model": "m", "input": "x",
                                              "references": [{"audio": "QUJD", "text": "t"}, {"audio": "REVG"}]})
    assert [(r.audio, r.text) for r in listed.cloning_references] == [("QUJD", "t"), ("REVG", None)]
    assert TTSSpeechRequest.model_validate({"model": "m", "input": "x", "voice": "v"}).cloning_references == []
    _refused(lambda: TTSSpeechRequest.model_validate({"model": "m", "input": "x", "ref_audio": "QUJD",
                                                      "references": [{"audio": "REVG", "text": "t"}]}),
             400, "conflicting_references")


def test_references_succeed_in_msgpack_and_fail_in_json_unless_asked_otherwise() -> None:
    assert answer_format(None, None) == answer_format(None, "*/*") == AnswerFormat(False, True)
    assert answer_format("json", None) == answer_format("application/json", "application/msgpack") == \
        AnswerFormat(True, True)
    assert answer_format("msgpack", "application/json") == answer_format(" MsgPack", None) == AnswerFormat(False, False)
    assert answer_format(None, "application/json") == AnswerFormat(True, True)
    assert answer_format(None, "application/json, application/msgpack") == AnswerFormat(False, False)


def _served(name: str, clones: bool) -> Any:
    variant = "base" if clones else "custom_voice"
    orchestrator = SimpleNamespace(voice_store=object() if clones else None, variant=variant)
    return SimpleNamespace(name=name, family="qwen3_tts", orchestrator=orchestrator)


def test_the_model_is_the_one_named_else_the_only_one_that_clones() -> None:
    one: dict[str, Any] = {"custom": _served("custom", False), "base": _served("base", True)}
    assert cloning_model(one, None).name == "base" and cloning_model(one, "base").name == "base"
    _refused(lambda: cloning_model(one, "custom"), 400, "unsupported_for_model")
    _refused(lambda: cloning_model(one, "nobody"), 404, "model_not_found")
    two = {**one, "base-2": _served("base-2", True)}
    assert "base, base-2" in _refused(lambda: cloning_model(two, None), 400, "model_required").message
    assert cloning_model(two, "base-2").name == "base-2"
    _refused(lambda: cloning_model({"custom": one["custom"]}, None), 400, "unsupported_for_model")


# ---- the shared store's rename ---------------------------------------------------------------------------------------

def _save(store: VoiceStore, name: str, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {"codes": torch.randint(0, 1024, (12, 4), generator=generator), "x_vector": torch.randn(8)}
    return store.save_tensors(name, tensors, "a transcript", 12, 1.5)


def test_a_renamed_voice_keeps_its_tensors_and_frees_its_old_name(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    saved = _save(store, "Tea")
    before = store.load_tensors("Tea")
    renamed = store.rename("Tea", "Coffee")
    assert renamed["name"] == "Coffee" and renamed["digest"] == saved["digest"]
    assert VoiceStore(tmp_path).names() == ["Coffee"]  # on disk: a new store on the directory sees it
    after = store.load_tensors("coffee")
    assert after.text == "a transcript"
    assert all(torch.equal(after.tensors[key], before.tensors[key]) for key in before.tensors)
    with pytest.raises(VoiceNotFoundError):
        store.load_tensors("Tea")
    store.rename("Coffee", "COFFEE")  # a change of case only
    assert store.names() == ["COFFEE"]
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.startswith(".")) == [
        "coffee.safetensors"]


def test_a_rename_refuses_a_taken_name_an_unknown_voice_and_a_bad_name(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    _save(store, "one")
    _save(store, "two", seed=1)
    with pytest.raises(VoiceExistsError):
        store.rename("one", "TWO")
    with pytest.raises(VoiceNotFoundError):
        store.rename("three", "four")
    with pytest.raises(InvalidVoiceNameError):
        store.rename("one", "../one")
    assert store.names() == ["one", "two"]
