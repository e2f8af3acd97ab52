"""fish-speech's HTTP API on the shared service: POST /v1/tts (JSON or msgpack) mapped onto the speech request."""

from __future__ import annotations

import uuid
from email.message import Message
from typing import Any, Literal

import msgpack
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_ray.audio import encode_audio, writable_formats
from omni_ray.serve import openai_protocol as oai
from omni_ray.serve.served_model import ServedModel, prepare_speech
from omni_ray.serve.voice_uploads import cloning_model

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
JSON_TYPE = "application/json"
ACCEPTED_BODIES = "application/msgpack, application/json"
# fish-speech's formats and the ones the shared encoders add; `pcm` is raw 16-bit little-endian mono
TTS_FORMATS = ("wav", "pcm", "mp3", "opus", "flac")
STREAMED_FORMATS = ("wav", "pcm")
# the official server's Content-Type per format (raw pcm: a plain byte stream)
TTS_CONTENT_TYPES = {"wav": "audio/wav", "pcm": "application/octet-stream", "mp3": "audio/mpeg",
                     "opus": "audio/ogg", "flac": "audio/flac"}
SAMPLING_FIELDS = ("seed", "temperature", "top_p", "repetition_penalty")


class FishReference(BaseModel):
    """One reference of a /v1/tts request: the speech (bytes in msgpack, base64 or a data: URL in JSON) and its
    transcript."""

    model_config = ConfigDict(extra="ignore")

    audio: str | bytes = Field(min_length=1)
    text: str | None = None


class FishTTSRequest(BaseModel):
    """POST /v1/tts in fish-speech's field names and ranges. Unknown fields are ignored, as the official server does."""

    model_config = ConfigDict(extra="ignore")

    text: str
    references: list[FishReference] = Field(default_factory=list)
    reference_id: str | None = None
    format: str = "wav"
    streaming: bool = False
    seed: int | None = None
    max_new_tokens: int = Field(default=1024, ge=0, description="the speech's codec frame cap; 0: the model's own")
    top_p: float = Field(default=0.8, ge=0.1, le=1.0)
    repetition_penalty: float = Field(default=1.1, ge=0.9, le=2.0)
    temperature: float = Field(default=0.8, ge=0.1, le=1.0)
    # accepted in the official types and ignored (docs/http-api.md says why)
    chunk_length: int = 200
    latency: Literal["normal", "balanced"] = "normal"
    use_memory_cache: Literal["on", "off"] = "off"
    normalize: bool = True
    model: str | None = Field(default=None, description="extension: which served model speaks (default: the only "
                              "one that clones voices)")


def media_type(content_type: str | None) -> str:
    """The bare media type of a Content-Type header, lower case ('' when there is none)."""
    if not content_type:
        return ""
    header = Message()
    header["content-type"] = content_type
    return header.get_content_type() if "/" in content_type else ""


def decode_body(content_type: str | None, raw: bytes, limits: oai.ServiceLimits) -> dict[str, Any]:
    """A JSON or msgpack body (told apart by its Content-Type, as the official server does) as a map. Another type is
    a 415; a body that does not decode, or is not a map, a 400."""
    media = media_type(content_type)
    if media == JSON_TYPE:
        return oai.parse_json_body(raw, limits)
    if media not in MSGPACK_TYPES:
        raise oai.OpenAIError(415, f"the body must be application/msgpack or application/json, not "
                              f"{content_type or 'without a Content-Type'!r}", "invalid_request_error", None,
                              "unsupported_media_type", {"Accept": ACCEPTED_BODIES})
    if len(raw) > limits.max_request_bytes:
        raise oai.too_large(f"request body is {len(raw)} bytes, over the limit of {limits.max_request_bytes}")
    items = limits.max_json_items
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_array_len=items, max_map_len=items)
    except (ValueError, TypeError, msgpack.StackError, msgpack.FormatError) as exc:  # ExtraData is a ValueError
        raise oai.bad_request(f"the body is not valid msgpack: {exc}", None, "invalid_msgpack") from None
    if not isinstance(body, dict):
        raise oai.bad_request(f"the body must be a msgpack map, not {type(body).__name__}", None, "invalid_msgpack")
    return body


def parse_tts_request(body: dict[str, Any]) -> FishTTSRequest:
    """The official request's fields checked; a schema error is a 422 listing the failing fields."""
    try:
        request = FishTTSRequest.model_validate(body)
    except ValidationError as exc:
        raise oai.from_validation_error(exc) from None
    if request.format not in TTS_FORMATS:
        raise oai.bad_request(f"format {request.format[:32]!r} is not supported: use one of {', '.join(TTS_FORMATS)}",
                              "format", "unsupported_format")
    if request.format != "pcm" and request.format not in writable_formats():
        raise oai.bad_request(f"format {request.format!r} cannot be encoded by this server's audio library",
                              "format", "unsupported_format")
    if request.streaming and request.format not in STREAMED_FORMATS:
        raise oai.bad_request("streaming is available as wav (raw 16-bit PCM, as fish-speech streams it) or pcm "
                              "only", "format", "unsupported_format")
    return request


def speech_body(request: FishTTSRequest, model: ServedModel) -> dict[str, Any]:
    """The /v1/audio/speech body a /v1/tts request stands for: `reference_id` as the stored voice (it wins over
    `references`, as in fish-speech), the references as `references`, the sampling fields the client set."""
    body: dict[str, Any] = {"model": model.name, "input": request.text, "response_format": request.format,
                            "stream": request.streaming}
    if request.reference_id is not None:
        body["voice"] = request.reference_id
    elif request.references:
        body["references"] = [{"audio": reference.audio, "text": reference.text} for reference in request.references]
    body.update({name: getattr(request, name) for name in SAMPLING_FIELDS if name in request.model_fields_set})
    if request.max_new_tokens > 0:
        body["max_new_tokens"] = request.max_new_tokens
    return body


def prepare_tts(models: dict[str, ServedModel], content_type: str | None, raw: bytes, limits: oai.ServiceLimits
                ) -> tuple[ServedModel, FishTTSRequest, oai.SpeechRequest, dict[str, Any]]:
    """A /v1/tts request decoded and checked, its model, and the speech request it maps to with its speak()
    arguments (references decoded); blocking, run on the ingress's parsing pool."""
    request = parse_tts_request(decode_body(content_type, raw, limits))
    model = cloning_model(models, request.model)
    speech, kwargs = prepare_speech(model, speech_body(request, model), limits)
    if "sample_rate" in kwargs:  # fish-speech answers at the model's own rate, not OpenAI's 24 kHz
        kwargs["sample_rate"] = model.audio_rate
    return model, request, speech, kwargs


async def synthesize(ingress: Any, raw: bytes, content_type: str | None) -> Response:
    """POST /v1/tts on `ingress` (an OmniIngress: its models, parsing pool, stream helpers and metrics), at the
    model's own rate (`X-Sample-Rate`; S2 Pro: 44.1 kHz). Streaming: the audio as raw 16-bit PCM chunks, no WAV header,
    as fish-speech streams it; else the whole file."""
    model, request, speech, kwargs = await ingress.parsing.run(prepare_tts, ingress.models, content_type, raw,
                                                               ingress.limits)
    first, events = await ingress._start(model.orchestrator.speak(
        speech.input, request_id=f"tts-{uuid.uuid4().hex}", **kwargs))
    media = TTS_CONTENT_TYPES[request.format]
    headers = {"Content-Disposition": f"attachment; filename=audio.{request.format}",
               "X-Sample-Rate": str(model.audio_rate)}
    if request.streaming:
        body = ingress._speech_stream(first, events, wav=False)
        return StreamingResponse(ingress._counted("tts", body), media_type=media, headers=headers)
    samples, final = await ingress._collect(first, events)
    reason = final.audio_finish_reason or final.finish_reason
    return Response(encode_audio(samples, model.audio_rate, speech.audio_format), media_type=media,
                    headers={**headers, "X-Finish-Reason": reason})
