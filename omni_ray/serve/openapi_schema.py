"""The request bodies in /openapi.json: the routes read raw bytes (parsed off the event loop), so FastAPI knows none."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from omni_ray.serve.fish_tts_api import FishTTSRequest
from omni_ray.serve.openai_protocol import ChatCompletionRequest, SpeechRequest
from omni_ray.serve.speech_protocol import TTSSpeechRequest

REF = "#/components/schemas/{model}"
# each route's bodies: a speech request is Qwen3-Omni's or Qwen3-TTS's, by the family of the model it names; fish-speech's
# /v1/tts takes the same fields as msgpack (see docs/http-api.md)
MODELS: dict[str, tuple[type, ...]] = {"chat": (ChatCompletionRequest,), "speech": (SpeechRequest, TTSSpeechRequest),
                                       "tts": (FishTTSRequest,)}


def _body(models: tuple[type, ...]) -> dict[str, Any]:
    refs = [{"$ref": REF.format(model=model.__name__)} for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# each POST route's `openapi_extra`
REQUEST_BODIES: dict[str, dict[str, Any]] = {name: _body(models) for name, models in MODELS.items()}

# POST /v1/audio/voices: a multipart form (parsed by `voice_uploads.parse_multipart_form`)
VOICE_UPLOAD_FORM: dict[str, Any] = {
    "type": "object",
    "required": ["name", "audio_sample"],
    "properties": {
        "audio_sample": {"type": "string", "format": "binary", "description": "the reference speech: a wav, flac, "
                         "ogg or mp3 file of 1 to 30 s, any rate and channel count (also accepted as 'audio')"},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$",
                 "description": "the voice's name, unique without case; speech requests name it as `voice`"},
        "ref_text": {"type": "string", "description": "the audio's transcript: in-context cloning (without it the "
                     "voice is x-vector only)"},
        "x_vector_only_mode": {"type": "boolean", "description": "clone from the speaker embedding alone"},
        "model": {"type": "string", "description": "a served Qwen3-TTS Base model (default: the only one)"},
        "consent": {"type": "string", "description": "OpenAI's consent recording id: accepted and ignored"},
        "type": {"type": "string", "enum": ["audio_sample"], "description": "OpenAI's: how the voice is made"},
    },
}
VOICE_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": VOICE_UPLOAD_FORM}}}}


def request_schemas() -> dict[str, Any]:
    """The request models' JSON schemas and every schema they refer to, keyed as components/schemas."""
    schemas: dict[str, Any] = {}
    for model in (model for models in MODELS.values() for model in models):
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def with_request_schemas(app: FastAPI) -> None:
    """`app.openapi()` with the request models' schemas among its components (made once, on first call)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
