"""fish-speech's /v1/references/{add,list,delete,update} on the shared voice store, answered in msgpack or JSON."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgpack
from fastapi.responses import JSONResponse, Response

from omni_ray.errors import InvalidRequestError
from omni_ray.serve import openai_protocol as oai
from omni_ray.serve.audio_urls import audio_bytes, decode_reference_bytes
from omni_ray.serve.fish_tts_api import decode_body, media_type
from omni_ray.serve.served_model import ServedModel, cloning_reference, reference_rate
from omni_ray.serve.voice_uploads import cloning_model, parse_multipart_form, store_error
from omni_ray.voice_store import VoiceStoreError, check_voice_name

FORM_TYPE = "multipart/form-data"
JSON_ANSWERS = ("json", "application/json")
MSGPACK_ANSWERS = ("msgpack", "application/msgpack")
ADD_FIELDS = ("id", "audio", "text", "model")


@dataclass(frozen=True)
class AnswerFormat:
    """How a references route answers: a success as the official server would (msgpack unless JSON is asked for), a
    failure in JSON (the OpenAI envelope) unless msgpack is asked for by name."""

    success_json: bool
    error_json: bool


def answer_format(query_format: str | None, accept: str | None) -> AnswerFormat:
    """`?format=json|msgpack` first, else the Accept header: JSON named without msgpack, or msgpack named."""
    asked = (query_format or "").strip().lower()
    if asked in JSON_ANSWERS + MSGPACK_ANSWERS:
        return AnswerFormat(asked in JSON_ANSWERS, asked in JSON_ANSWERS)
    accept = (accept or "").strip().lower()
    msgpack_named = "application/msgpack" in accept
    return AnswerFormat("application/json" in accept and not msgpack_named, not msgpack_named)


def answer(body: dict[str, Any], as_json: bool, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    if as_json:
        return JSONResponse(body, status_code=status, headers=headers)
    return Response(msgpack.packb(body, use_bin_type=True), status_code=status, headers=headers,
                    media_type="application/msgpack")


def _client_error(exc: Exception) -> oai.OpenAIError | None:
    if isinstance(exc, oai.OpenAIError):
        return exc
    if isinstance(exc, VoiceStoreError):
        return store_error(exc)
    if isinstance(exc, InvalidRequestError):
        return oai.invalid_request(exc)
    return None


async def answered(work: Callable[[], Awaitable[dict[str, Any]]], ids: dict[str, str], answers: AnswerFormat
                   ) -> Response:
    """The official answer of `work` (its fields with `success: true`), or for a client error the official failure
    fields (`success: false`, `message`, the ids) together with the OpenAI error envelope, at the error's status.
    Server errors propagate (the ingress answers them with a 500)."""
    try:
        return answer({"success": True, **await work()}, answers.success_json)
    except Exception as exc:
        error = _client_error(exc)
        if error is None or error.status >= 500:
            raise
        body = {"success": False, "message": error.message, **ids, **error.body()}
        return answer(body, answers.error_json, error.status, error.headers)


def _text_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise oai.bad_request(f"field {name!r} is required", name, "missing_field")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise oai.bad_request(f"field {name!r} is not UTF-8 text", name, "invalid_field") from None
    if not isinstance(value, str):
        raise oai.bad_request(f"field {name!r} must be a string", name, "invalid_field")
    if not value.strip():
        raise oai.bad_request(f"field {name!r} cannot be empty", name, "missing_field")
    return value


def _model_name(body: dict[str, Any], query_model: str | None) -> str | None:
    """The model a references request names: its body's `model` field, else the `model` query parameter."""
    named = body.get("model")
    return named if isinstance(named, str) and named else query_model


def _shown(value: Any) -> str:
    """An id field as an answer repeats it: the string given, else empty."""
    return value[:255] if isinstance(value, str) else ""


def _reference_id(body: dict[str, Any], name: str) -> str:
    """An id field, checked against the store's rule for names (1 to 64 letters, digits, '_' or '-')."""
    value = _text_field(body, name)
    try:
        return check_voice_name(value)
    except VoiceStoreError as exc:
        raise oai.bad_request(f"{name}: {exc}", name, "invalid_reference_id") from None


def _fields(content_type: str | None, raw: bytes, limits: oai.ServiceLimits,
            known: tuple[str, ...] = ADD_FIELDS) -> dict[str, Any]:
    """A references request's fields: a multipart form (text parts as strings, the file as bytes), JSON or msgpack.
    A form field not `known` is a 422."""
    if media_type(content_type) != FORM_TYPE:
        return decode_body(content_type, raw, limits)
    parts = parse_multipart_form(content_type, raw)
    unknown = sorted(set(parts) - set(known))
    if unknown:
        raise oai.unprocessable(f"unknown form field {unknown[0]!r}; fields: {', '.join(known)}", unknown[0],
                                "unknown_field")
    return {name: part.data if name == "audio" else part.data.decode("utf-8", "replace")
            for name, part in parts.items()}


def prepare_add(models: dict[str, ServedModel], content_type: str | None, raw: bytes, limits: oai.ServiceLimits,
                query_model: str | None) -> tuple[ServedModel, str, Any]:
    """/v1/references/add's model, id and reference (decoded, checked, with its transcript); blocking, run on the
    ingress's parsing pool. The id is checked against the store before the audio is decoded."""
    body = _fields(content_type, raw, limits)
    reference_id = _reference_id(body, "id")
    text = _text_field(body, "text")
    if len(text) > limits.max_speech_input_chars:
        raise oai.bad_request(f"text is {len(text)} characters, over the limit of {limits.max_speech_input_chars}",
                              "text", "string_above_max_length")
    model = cloning_model(models, _model_name(body, query_model))
    model.orchestrator.voice_store.check_can_add(reference_id)
    audio = body.get("audio")
    if isinstance(audio, str) and audio:
        audio = audio_bytes(audio, limits, "audio")
    if not isinstance(audio, bytes) or not audio:
        raise oai.bad_request("field 'audio' is required: the reference speech (a file, or bytes in msgpack)",
                              "audio", "missing_audio")
    samples, rate = decode_reference_bytes(audio, limits, "audio")
    return model, reference_id, cloning_reference(samples, rate, text, False, "audio", reference_rate(model))


async def add_reference(ingress: Any, raw: bytes, content_type: str | None, query_model: str | None,
                        answers: AnswerFormat) -> Response:
    """POST /v1/references/add: {id, audio, text} as a form (or msgpack, or JSON with base64 audio) → a stored
    voice, encoded once."""
    async def work() -> dict[str, Any]:
        model, reference_id, reference = await ingress.parsing.run(
            prepare_add, ingress.models, content_type, raw, ingress.limits, query_model)
        ids["reference_id"] = reference_id
        await model.orchestrator.add_voice(reference_id, reference)
        return {"message": f"Reference voice '{reference_id}' added successfully", "reference_id": reference_id}

    ids = {"reference_id": ""}
    return await answered(work, ids, answers)


async def list_references(ingress: Any, query_model: str | None, answers: AnswerFormat) -> Response:
    """GET /v1/references/list: the stored voices' names."""
    async def work() -> dict[str, Any]:
        model = cloning_model(ingress.models, query_model)
        names = [entry["name"] for entry in await model.orchestrator.list_voices()]
        return {"reference_ids": names, "message": f"Found {len(names)} reference voices"}

    return await answered(work, {"reference_ids": []}, answers)


async def _body_fields(ingress: Any, raw: bytes, content_type: str | None, known: tuple[str, ...]
                       ) -> dict[str, Any]:
    return await ingress.parsing.run(_fields, content_type, raw, ingress.limits, known)


async def delete_reference(ingress: Any, raw: bytes, content_type: str | None, query_model: str | None,
                           answers: AnswerFormat) -> Response:
    """DELETE /v1/references/delete: {reference_id} → the stored voice removed."""
    ids = {"reference_id": ""}

    async def work() -> dict[str, Any]:
        body = await _body_fields(ingress, raw, content_type, ("reference_id", "model"))
        ids["reference_id"] = _shown(body.get("reference_id"))
        reference_id = _reference_id(body, "reference_id")
        model = cloning_model(ingress.models, _model_name(body, query_model))
        await model.orchestrator.delete_voice(reference_id)
        return {"message": f"Reference voice '{reference_id}' deleted successfully", "reference_id": reference_id}

    return await answered(work, ids, answers)


async def update_reference(ingress: Any, raw: bytes, content_type: str | None, query_model: str | None,
                           answers: AnswerFormat) -> Response:
    """POST /v1/references/update: {old_reference_id, new_reference_id} → the stored voice renamed."""
    ids = {"old_reference_id": "", "new_reference_id": ""}

    async def work() -> dict[str, Any]:
        body = await _body_fields(ingress, raw, content_type, ("old_reference_id", "new_reference_id", "model"))
        ids.update({name: _shown(body.get(name)) for name in ids})
        old, new = _reference_id(body, "old_reference_id"), _reference_id(body, "new_reference_id")
        if old == new:
            raise oai.bad_request("the new reference id must differ from the old one", "new_reference_id",
                                  "invalid_reference_id")
        model = cloning_model(ingress.models, _model_name(body, query_model))
        await asyncio.to_thread(model.orchestrator.voice_store.rename, old, new)
        return {"message": f"Reference voice renamed from '{old}' to '{new}' successfully",
                "old_reference_id": old, "new_reference_id": new}

    return await answered(work, ids, answers)
