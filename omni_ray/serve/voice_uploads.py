"""/v1/audio/voices: a multipart upload parsed strictly, the model a voice request names, and the voice objects."""

from __future__ import annotations

import email.parser
import email.utils
from dataclasses import dataclass
from email.message import Message
from typing import Any, Iterable

from omni_ray.reference_audio import ReferenceAudio
from omni_ray.reference_audio import REFERENCE_SAMPLE_RATE
from omni_ray.serve import openai_protocol as oai
from omni_ray.serve.audio_urls import decode_reference_bytes
from omni_ray.serve.served_model import ServedModel, cloning_reference
from omni_ray.voice_store import (
    InvalidVoiceNameError, TooManyVoicesError, VoiceExistsError, VoiceNotFoundError, VoiceStoreError,
    check_voice_name,
)

MAX_FORM_PARTS = 16
MAX_BOUNDARY_CHARS = 70  # RFC 2046
AUDIO_FIELDS = ("audio_sample", "audio")  # vllm-omni's and OpenAI's name, and a plain one
# consent: OpenAI's and vllm-omni's consent recording id, accepted and ignored; type: OpenAI's, only audio_sample
TEXT_FIELDS = ("name", "ref_text", "x_vector_only_mode", "model", "consent", "type")
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
STORE_ERROR_CODES: dict[type[VoiceStoreError], str] = {
    InvalidVoiceNameError: "invalid_voice_name", VoiceNotFoundError: "voice_not_found",
    VoiceExistsError: "voice_exists", TooManyVoicesError: "too_many_voices",
}


@dataclass(frozen=True)
class FormPart:
    """One field of a multipart/form-data body: its bytes, and the file name and type a file part carries."""

    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None


def malformed(reason: str) -> oai.OpenAIError:
    return oai.bad_request(f"malformed multipart/form-data body: {reason}", None, "invalid_multipart")


def _params(header: str, value: str) -> Message:
    message = Message()
    message[header] = value
    return message


def parse_multipart_form(content_type: str | None, body: bytes, max_parts: int = MAX_FORM_PARTS) -> dict[str, FormPart]:
    """The fields of a multipart/form-data body, by name. Strict: the boundary the Content-Type names, a closing
    delimiter, each part with `Content-Disposition: form-data; name=...` and a blank line before its data, no field
    twice, at most `max_parts` parts; anything else is a 400 (`invalid_multipart`)."""
    header = _params("content-type", content_type or "")
    if header.get_content_type() != "multipart/form-data" or not content_type:
        raise oai.bad_request("POST /v1/audio/voices takes multipart/form-data (the audio file and the form's "
                              f"fields), not {content_type or 'no Content-Type'!r}", None, "invalid_content_type")
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= MAX_BOUNDARY_CHARS or not boundary.isascii():
        raise malformed("the Content-Type names no usable boundary")
    pieces = (b"\r\n" + body).split(b"\r\n--" + boundary.encode())
    fields: dict[str, FormPart] = {}
    for piece in pieces[1:]:  # pieces[0]: the preamble
        if piece.startswith(b"--"):  # the closing delimiter; what follows is the epilogue
            return fields
        if len(fields) >= max_parts:
            raise malformed(f"more than {max_parts} parts")
        part = _form_part(piece)
        if part.name in fields:
            raise malformed(f"field {part.name!r} is given twice")
        fields[part.name] = part
    raise malformed("no closing boundary" if len(pieces) > 1 else "no part starts with the boundary")


def _form_part(piece: bytes) -> FormPart:
    """One part after its delimiter: optional padding, CRLF, headers, a blank line, the data."""
    line_end = piece.find(b"\r\n")
    if line_end < 0 or piece[:line_end].strip(b" \t"):
        raise malformed("a boundary line holds more than the boundary")
    headers_end = piece.find(b"\r\n\r\n", line_end)
    if headers_end < 0:
        raise malformed("a part has no blank line after its headers")
    try:
        header_text = piece[line_end + 2: headers_end].decode("utf-8")
    except UnicodeDecodeError:
        raise malformed("a part's headers are not UTF-8") from None
    headers = email.parser.HeaderParser().parsestr(header_text + "\r\n\r\n")
    disposition = headers.get("content-disposition")
    if headers.defects or disposition is None:
        raise malformed("each part needs a Content-Disposition header")
    if headers.get_content_disposition() != "form-data":
        raise malformed("a part's Content-Disposition is not form-data")
    name = headers.get_param("name", header="content-disposition")
    name = email.utils.collapse_rfc2231_value(name) if name is not None else None
    if not name:
        raise malformed("a part's Content-Disposition names no field")
    return FormPart(name, piece[headers_end + 4:], headers.get_filename(), headers.get("content-type"))


def _text(fields: dict[str, FormPart], name: str) -> str | None:
    part = fields.get(name)
    if part is None:
        return None
    try:
        return part.data.decode("utf-8")
    except UnicodeDecodeError:
        raise oai.bad_request(f"field {name!r} is not UTF-8 text", name, "invalid_field") from None


def _flag(value: str | None, name: str) -> bool | None:
    if value is None:
        return None
    word = value.strip().lower()
    if word not in TRUE_WORDS + FALSE_WORDS:
        raise oai.unprocessable(f"{name} must be true or false, not {value[:32]!r}", name)
    return word in TRUE_WORDS


def parse_voice_upload(content_type: str | None, body: bytes, limits: oai.ServiceLimits
                       ) -> tuple[dict[str, FormPart], str, str | None]:
    """An upload's form fields (unknown ones refused with 422), its voice's name (checked: 400) and the model its
    `model` field names."""
    fields = parse_multipart_form(content_type, body)
    unknown = sorted(set(fields) - set(AUDIO_FIELDS) - set(TEXT_FIELDS))
    if unknown:
        known = ", ".join(AUDIO_FIELDS + TEXT_FIELDS)
        raise oai.unprocessable(f"unknown form field {unknown[0]!r}; an upload takes {known}", unknown[0],
                                "unknown_field")
    kind = _text(fields, "type")
    if kind is not None and kind != "audio_sample":
        raise oai.bad_request(f"type {kind[:32]!r}: only voices from an audio sample are made here", "type",
                              "unsupported_voice_type")
    name = _text(fields, "name")
    if name is None:
        raise oai.bad_request("an upload needs the voice's name (form field 'name')", "name", "missing_name")
    check_voice_name(name)  # InvalidVoiceNameError: a 400 (store_error)
    ref_text = _text(fields, "ref_text")
    if ref_text is not None and len(ref_text) > limits.max_speech_input_chars:
        raise oai.bad_request(f"ref_text is {len(ref_text)} characters, over the limit of "
                              f"{limits.max_speech_input_chars}", "ref_text", "string_above_max_length")
    return fields, name, _text(fields, "model")


def upload_reference(fields: dict[str, FormPart], limits: oai.ServiceLimits,
                     target_rate: int = REFERENCE_SAMPLE_RATE) -> ReferenceAudio:
    """The uploaded audio decoded and checked as `ref_audio` is (the same 4xx codes), with its transcript: in-context
    cloning with `ref_text`, x-vector only without it or with `x_vector_only_mode`."""
    given = [name for name in AUDIO_FIELDS if name in fields]
    if not given:
        raise oai.bad_request("an upload needs the reference audio (file field 'audio_sample')", "audio_sample",
                              "missing_audio")
    if len(given) > 1:
        raise oai.bad_request("give the audio once: 'audio_sample' or 'audio'", given[1], "invalid_field")
    ref_text = _text(fields, "ref_text")
    has_text = bool((ref_text or "").strip())
    x_vector_only = _flag(_text(fields, "x_vector_only_mode"), "x_vector_only_mode")
    if x_vector_only is False and not has_text:
        raise oai.bad_request("in-context voice cloning needs ref_text, the audio's transcript (or leave "
                              "x_vector_only_mode unset)", "ref_text", "missing_ref_text")
    x_vector_only = bool(x_vector_only) or not has_text
    samples, rate = decode_reference_bytes(fields[given[0]].data, limits, given[0])
    return cloning_reference(samples, rate, None if x_vector_only else ref_text, x_vector_only, given[0], target_rate)


def voice_model(models: dict[str, ServedModel], name: str | None) -> ServedModel:
    """The model a voices request names (`model`, form field or query parameter), else the only model that clones
    voices, else the only model served. An unknown id is a 404; an ambiguous request a 400 naming the choices."""
    if name:
        if name not in models:
            raise oai.model_not_found(name)
        return models[name]
    cloning = [model for model in models.values() if clones_voices(model)]
    if len(cloning) == 1:
        return cloning[0]
    if len(models) == 1:
        return next(iter(models.values()))
    raise oai.bad_request(f"name the model (form field or query parameter 'model'): one of {', '.join(models)}",
                          "model", "model_required")


def cloning_model(models: dict[str, ServedModel], name: str | None) -> ServedModel:
    """The model a cloning request (fish-speech's /v1/tts and /v1/references) names, else the only served model that
    clones voices. An unknown id is a 404; a model that does not clone, none that does, or several, a 400."""
    if name:
        if name not in models:
            raise oai.model_not_found(name)
        require_cloning(models[name], "this request")
        return models[name]
    cloning = [model for model in models.values() if clones_voices(model)]
    if len(cloning) == 1:
        return cloning[0]
    if not cloning:
        raise oai.bad_request(f"no served model clones voices (served: {', '.join(models)})", "model",
                              "unsupported_for_model")
    names = ", ".join(model.name for model in cloning)
    raise oai.bad_request(f"several served models clone voices: name one as 'model' ({names})", "model",
                          "model_required")


def clones_voices(model: ServedModel) -> bool:
    """Whether a model clones voices and keeps them in the shared voice store: its orchestrator has a `voice_store`
    (Qwen3-TTS Base; any family whose orchestrator offers one, with `add_voice`, `list_voices`, `delete_voice` and
    `stored_voice`)."""
    return getattr(model.orchestrator, "voice_store", None) is not None


def require_cloning(model: ServedModel, what: str) -> None:
    """Stored voices are cloned voices: only a model that clones voices has them."""
    if not clones_voices(model):
        if model.family == "qwen3_tts":
            kind = f"a Qwen3-TTS {model.orchestrator.variant} model"
        else:
            kind = f"a {model.family} model"
        raise oai.bad_request(f"{what} needs a model that clones voices (stored voices are cloned voices); "
                              f"'{model.name}' is {kind}", "model", "unsupported_for_model")


def store_error(exc: VoiceStoreError) -> oai.OpenAIError:
    """The voice store's refusal in the OpenAI envelope, with its status and a code."""
    code = next((code for kind, code in STORE_ERROR_CODES.items() if isinstance(exc, kind)), None)
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return oai.OpenAIError(exc.status, str(exc), kind, "name", code)


# ---- responses -------------------------------------------------------------------------------------------------------

def voice_object(entry: dict[str, Any], model: str) -> dict[str, Any]:
    """A stored voice as the API shows it: OpenAI's voice object (object `audio.voice`, id, name, created_at, type
    `audio_sample`) with what the store knows of it (mode, frames, seconds, created, text, digest)."""
    created = int(entry["created"])
    return {"object": "audio.voice", "id": entry["name"], "name": entry["name"], "type": "audio_sample",
            "created_at": created, "created": created, "model": model, "mode": entry["mode"],
            "frames": entry["frames"], "seconds": round(float(entry["seconds"]), 3), "text": entry["text"],
            "digest": entry["digest"]}


def speaker_object(name: str, model: str) -> dict[str, Any]:
    """A model's built-in speaker (CustomVoice, Qwen3-Omni), listed so that clients can discover voices."""
    return {"object": "audio.voice", "id": name, "name": name, "type": "speaker", "model": model, "mode": "speaker"}


def voice_created(entry: dict[str, Any], model: str) -> dict[str, Any]:
    """The upload's answer: the voice object, plus vllm-omni's `success` and `voice` (the same object)."""
    voice = voice_object(entry, model)
    return {**voice, "success": True, "voice": voice}


def voice_list(voices: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """{object: list, data: [voice objects]}, and vllm-omni's `voices` (their names)."""
    data = list(voices)
    return {"object": "list", "data": data, "voices": [voice["name"] for voice in data]}


def voice_deleted(name: str, model: str) -> dict[str, Any]:
    """OpenAI's deletion object (object `audio.voice.deleted`, id, deleted), plus vllm-omni's success and message."""
    return {"object": "audio.voice.deleted", "id": name, "deleted": True, "model": model, "success": True,
            "message": f"voice {name!r} deleted"}
