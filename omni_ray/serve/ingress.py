"""The OpenAI-compatible HTTP front (FastAPI on Ray Serve) of one or more models: chat, speech, models, health, metrics.

No `from __future__ import annotations` here: FastAPI must see real annotations after Serve rebinds the routes.
"""


import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np
from fastapi import FastAPI, Request
from ray import serve
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omni_ray.audio import encode_audio, wav_stream_header
from omni_ray.errors import CapacityError, InvalidRequestError, StageError
from omni_ray.events import AudioChunk, Event, Finished, TextDelta
from omni_ray.models.qwen3_omni.prompt import Prompt
from omni_ray.reference_audio import ReferenceAudio
from omni_ray.serve import fish_references, fish_tts_api
from omni_ray.serve import openai_protocol as oai
from omni_ray.serve.metrics import ServiceMetrics
from omni_ray.serve.openai_responses import OUTPUT_SAMPLE_RATE
from omni_ray.serve.openapi_schema import REQUEST_BODIES, VOICE_UPLOAD_BODY, with_request_schemas
from omni_ray.serve.request_work import ParsingPool, read_body
from omni_ray.serve.served_model import ServedModel, prepare_chat, prepare_speech, reference_rate, served_model
from omni_ray.serve.stats import READY_AFTER_S, StatsReporter, serve_replica_id, stats_board
from omni_ray.serve.voice_uploads import (
    clones_voices, parse_voice_upload, require_cloning, speaker_object, store_error, upload_reference, voice_created,
    voice_deleted, voice_list, voice_model, voice_object,
)
from omni_ray.voice_store import VoiceStoreError

FINISH_REASON_HEADER = "X-Finish-Reason"  # a whole speech body's end: stop (EOS) or length (a frame cap)
logger = logging.getLogger(__name__)
app = FastAPI(title="omni-ray", docs_url=None, redoc_url=None)
with_request_schemas(app)


def error_response(error: oai.OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _as_openai_error(exc: Exception) -> oai.OpenAIError:
    """Client mistakes → 4xx; full queues → 503 with Retry-After; anything else is ours → 500."""
    if isinstance(exc, oai.OpenAIError):
        return exc
    if isinstance(exc, VoiceStoreError):  # its status (400, 404, 409) and a code
        return store_error(exc)
    if isinstance(exc, InvalidRequestError):
        return oai.invalid_request(exc)
    cause: BaseException | None = exc
    while cause is not None:  # a stage at capacity arrives wrapped (StageError ← Ray's task error ← CapacityError)
        if isinstance(cause, CapacityError) or type(cause).__name__ == "BackPressureError":
            return oai.overloaded(getattr(cause, "retry_after_s", None) or 1.0)  # the stage's estimate
        cause = cause.__cause__
    return oai.internal_error(str(exc) if isinstance(exc, StageError) else "internal error")


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)  # a 405's Allow


def _with_sent(timing: dict[str, float], first_sent: float | None) -> dict[str, float]:
    """A streamed reply's timing plus when its first audio chunk was handed to the HTTP response."""
    return timing if first_sent is None else {**timing, "first_audio_sent": first_sent}


def _sse_error(exc: Exception) -> bytes:
    """A chat stream's last events after a failure: the error in the OpenAI envelope (as its HTTP body would be),
    then [DONE]."""
    return oai.sse(_as_openai_error(exc).body()) + oai.SSE_DONE


def _speech_sse_error(exc: Exception) -> bytes:
    """A speech event stream's last event after a failure: the error in the OpenAI envelope (no speech.audio.done)."""
    return oai.sse(_as_openai_error(exc).body())


def speech_finish_reason(final: Finished) -> str:
    """Why a reply's speech ended: `stop` (the Talker's EOS) or `length` (a frame cap, or the Talker's context)."""
    return final.audio_finish_reason or final.finish_reason


def _answer_format(request: Request) -> fish_references.AnswerFormat:
    """How fish-speech's /v1/references routes answer this request (`?format=`, `Accept`)."""
    return fish_references.answer_format(request.query_params.get("format"), request.headers.get("accept"))


@serve.ingress(app)
class OmniIngress:
    """Parses and validates requests, and runs each through its model's orchestrator over that model's stage
    deployments. `models`: one spec per served model (`served_model`), routed by the request's `model`."""

    def __init__(self, models: list[dict[str, Any]], limits: dict[str, Any]) -> None:
        self.limits = oai.ServiceLimits.model_validate(limits)
        served = [served_model(spec, self.limits) for spec in models]
        self.models: dict[str, ServedModel] = {model.name: model for model in served}
        self.default_model = served[0]  # whose schema judges a body that names no model
        self.parsing = ParsingPool(self.limits)
        self.metrics = ServiceMetrics()
        self.board = stats_board()
        # the other ingress replicas' /metrics include this one's requests: it posts them with its load
        self.replica_id = serve_replica_id() or f"ingress-{uuid.uuid4().hex[:8]}"
        self.reporter = StatsReporter(self.replica_id, self._board_stats)

    def _board_stats(self) -> dict[str, Any]:
        return {"stage": "ingress", "reply_samples": self.metrics.reply_samples()}

    # ---- routes --------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions", openapi_extra=REQUEST_BODIES["chat"])
    async def route_chat(self, request: Request) -> Response:
        return await self._guard("chat", self.chat, request)

    @app.post("/v1/audio/speech", openapi_extra=REQUEST_BODIES["speech"])
    async def route_speech(self, request: Request) -> Response:
        return await self._guard("speech", self.speech, request)

    @app.post("/v1/audio/voices", openapi_extra=VOICE_UPLOAD_BODY)
    async def route_upload_voice(self, request: Request, model: Optional[str] = None) -> Response:
        content_type = request.headers.get("content-type")
        return await self._guard("voices", lambda raw: self.upload_voice(raw, content_type, model), request)

    @app.get("/v1/audio/voices")
    async def route_list_voices(self, request: Request, model: Optional[str] = None) -> Response:
        return await self._guard("voices", lambda _: self.list_voices(model), request)

    @app.delete("/v1/audio/voices/{name}")
    async def route_delete_voice(self, request: Request, name: str, model: Optional[str] = None) -> Response:
        return await self._guard("voices", lambda _: self.delete_voice(name, model), request)

    # fish-speech's API (fish_tts_api.py, fish_references.py)
    @app.post("/v1/tts", openapi_extra=REQUEST_BODIES["tts"])
    async def route_fish_tts(self, request: Request) -> Response:
        content_type = request.headers.get("content-type")
        return await self._guard("tts", lambda raw: fish_tts_api.synthesize(self, raw, content_type), request)

    @app.post("/v1/references/add")
    async def route_add_reference(self, request: Request, model: Optional[str] = None) -> Response:
        content_type, answers = request.headers.get("content-type"), _answer_format(request)
        return await self._guard("references", lambda raw: fish_references.add_reference(
            self, raw, content_type, model, answers), request)

    @app.get("/v1/references/list")
    async def route_list_references(self, request: Request, model: Optional[str] = None) -> Response:
        answers = _answer_format(request)
        return await self._guard("references", lambda _: fish_references.list_references(self, model, answers),
                                 request)

    @app.delete("/v1/references/delete")
    async def route_delete_reference(self, request: Request, model: Optional[str] = None) -> Response:
        content_type, answers = request.headers.get("content-type"), _answer_format(request)
        return await self._guard("references", lambda raw: fish_references.delete_reference(
            self, raw, content_type, model, answers), request)

    @app.post("/v1/references/update")
    async def route_update_reference(self, request: Request, model: Optional[str] = None) -> Response:
        content_type, answers = request.headers.get("content-type"), _answer_format(request)
        return await self._guard("references", lambda raw: fish_references.update_reference(
            self, raw, content_type, model, answers), request)

    @app.get("/v1/models")
    async def route_models(self) -> JSONResponse:
        return JSONResponse(oai.models_list(list(self.models)))

    @app.get("/health")
    async def route_health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def route_ready(self) -> Response:
        return await self.ready()

    @app.get("/metrics")
    async def route_metrics(self) -> Response:
        return await self.metrics_text()

    # ---- helpers -------------------------------------------------------------------------------------------
    def _route(self, raw: bytes) -> tuple[ServedModel, dict[str, Any]]:
        """The model a body names, and the body decoded. An unknown id is a 404; a body that names none (or not as
        a string) is judged by the first model's schema, which refuses it."""
        body = oai.parse_json_body(raw, self.limits)
        name = body.get("model")
        if isinstance(name, str) and name in self.models:
            return self.models[name], body
        if isinstance(name, str) and name:
            raise oai.model_not_found(name)
        return self.default_model, body

    async def _start(self, events: AsyncIterator[Event]) -> tuple[Event | None, AsyncIterator[Event]]:
        """Run until the first event so that request errors become HTTP errors, not a broken stream."""
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            return None, events
        return first, events

    async def _collect(self, first: Event | None, events: AsyncIterator[Event]) -> tuple[np.ndarray, Finished]:
        """A whole (non-streamed) reply: all its audio and its final event; records its latency metrics."""
        pcm: list[np.ndarray] = []
        seconds = 0.0
        final: Finished | None = None
        event = first
        while event is not None:
            if isinstance(event, AudioChunk):
                pcm.append(event.pcm)
                seconds += len(event.pcm) / event.sample_rate
            elif isinstance(event, Finished):
                final = event
            event = await anext(events, None)
        if final is None:
            raise StageError("the reply ended without a final event")
        samples = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
        self.metrics.observe_reply(final.timing, seconds, final.t)
        return samples, final

    async def _guard(self, endpoint: str, handler: Any, request: Request) -> Response:
        self.metrics.observe_request_path(request.headers.get("x-request-start"), time.time())
        self.metrics.in_flight.inc()
        try:
            response = await handler(await read_body(request, self.limits.max_request_bytes))
        except asyncio.CancelledError:
            self.metrics.cancelled.labels(endpoint).inc()
            raise
        except Exception as exc:
            error = _as_openai_error(exc)
            if error.status >= 500:  # ours, not the client's: keep the traceback
                logger.error("%s request failed: %s", endpoint, exc, exc_info=exc)
            response = error_response(error)
        finally:
            self.metrics.in_flight.dec()
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _counted(self, endpoint: str, stream: AsyncIterator[bytes],
                       error_tail: Optional[Callable[[Exception], bytes]] = None) -> AsyncIterator[bytes]:
        """Streaming bodies: count cancellations (client gone) and failures after the headers were sent. A failure
        ends the body with `error_tail(error)` where its format has room for one (an SSE error event: the client
        reads the error and the stream ends cleanly), else cuts it."""
        try:
            async for chunk in stream:
                yield chunk
        except asyncio.CancelledError:
            self.metrics.cancelled.labels(endpoint).inc()
            raise
        except Exception as exc:
            self.metrics.stream_failures.labels(endpoint).inc()
            logger.warning("a streamed %s reply failed after its headers were sent: %s", endpoint, exc)
            if error_tail is None:
                raise
            yield error_tail(exc)

    # ---- chat ----------------------------------------------------------------------------------------------
    def _prepare_chat(self, raw: bytes) -> tuple[ServedModel, tuple[bool, dict[str, Any], list[dict[str, Any]], Prompt]]:
        """The model a chat request names, and what the request needs before any stage sees it; on the parsing pool."""
        model, body = self._route(raw)
        return model, prepare_chat(model, body, self.limits)

    async def chat(self, raw: bytes) -> Response:
        model, (stream, kwargs, messages, prompt) = await self.parsing.run(self._prepare_chat, raw)
        audio_format = kwargs.pop("audio_format")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        first, events = await self._start(
            model.orchestrator.generate(messages, request_id=rid, prompt=prompt, **kwargs)
        )
        if stream:
            body = self._chat_stream(model.name, rid, created, first, events, kwargs["audio"])
            return StreamingResponse(self._counted("chat", body, _sse_error), media_type="text/event-stream")
        return await self._chat_whole(model.name, rid, created, first, events, audio_format)

    async def _chat_stream(
        self, model_name: str, rid: str, created: int, first: Event | None, events: AsyncIterator[Event], audio: bool
    ) -> AsyncIterator[bytes]:
        audio_id = f"audio_{rid}"
        yield oai.sse(oai.chat_chunk(rid, model_name, created, {"role": "assistant", "content": ""}))
        seconds = 0.0
        first_sent: float | None = None
        event = first
        while event is not None:
            if isinstance(event, TextDelta):
                delta: dict[str, Any] = {"content": event.text}
                if audio:
                    delta.update(oai.audio_delta(audio_id, None, event.text))
                yield oai.sse(oai.chat_chunk(rid, model_name, created, delta))
            elif isinstance(event, AudioChunk):
                seconds += len(event.pcm) / event.sample_rate
                first_sent = first_sent or time.time()
                yield oai.sse(oai.chat_chunk(rid, model_name, created, oai.audio_delta(audio_id, event.pcm)))
            elif isinstance(event, Finished):
                usage = oai.usage_dict(event.usage["prompt_tokens"], event.usage["completion_tokens"], event.usage.get("audio_frames"))
                self.metrics.observe_reply(_with_sent(event.timing, first_sent), seconds, event.t)
                yield oai.sse(oai.chat_chunk(rid, model_name, created, {}, event.finish_reason, usage,
                                             event.audio_finish_reason if audio else None))
            event = await anext(events, None)
        yield oai.SSE_DONE

    async def _chat_whole(
        self, model_name: str, rid: str, created: int, first: Event | None, events: AsyncIterator[Event],
        audio_format: str | None,
    ) -> Response:
        samples, final = await self._collect(first, events)
        audio = oai.audio_message(f"audio_{rid}", samples, audio_format, final.text, created) if audio_format else None
        usage = oai.usage_dict(final.usage["prompt_tokens"], final.usage["completion_tokens"], final.usage.get("audio_frames"))
        body = oai.chat_completion(rid, model_name, created, final.text, final.finish_reason, usage, audio,
                                   final.audio_finish_reason if audio_format else None)
        return JSONResponse(body)

    # ---- speech --------------------------------------------------------------------------------------------
    def _prepare_speech(self, raw: bytes) -> tuple[ServedModel, oai.SpeechRequest, dict[str, Any]]:
        """The model a speech request names, the request parsed by that model's schema and its speak() arguments
        (Qwen3-Omni: the prompt built and the input tokenized; Qwen3-TTS: ref_audio decoded); on the parsing pool."""
        model, body = self._route(raw)
        request, kwargs = prepare_speech(model, body, self.limits)
        return model, request, kwargs

    async def speech(self, raw: bytes) -> Response:
        model, request, kwargs = await self.parsing.run(self._prepare_speech, raw)
        first, events = await self._start(model.orchestrator.speak(
            request.input, request_id=f"speech-{uuid.uuid4().hex}", **kwargs
        ))
        if request.stream_format == "sse":
            body = self._speech_stream(first, events, request.response_format == "wav", events_out=True)
            return StreamingResponse(self._counted("speech", body, _speech_sse_error), media_type="text/event-stream")
        if request.stream:
            body = self._speech_stream(first, events, request.response_format == "wav")
            return StreamingResponse(self._counted("speech", body), media_type=request.content_type)
        samples, final = await self._collect(first, events)
        return Response(encode_audio(samples, OUTPUT_SAMPLE_RATE, request.audio_format), media_type=request.content_type,
                        headers={FINISH_REASON_HEADER: speech_finish_reason(final)})

    async def _speech_stream(
        self, first: Event | None, events: AsyncIterator[Event], wav: bool, events_out: bool = False
    ) -> AsyncIterator[bytes]:
        """The audio's bytes as they are made (a WAV stream header first); with `events_out`, each piece as a
        speech.audio.delta event and a last speech.audio.done with usage and the speech's finish reason."""
        def piece(audio: bytes) -> bytes:
            return oai.sse(oai.speech_audio_delta(audio)) if events_out else audio

        if wav:
            yield piece(wav_stream_header(OUTPUT_SAMPLE_RATE))
        seconds = 0.0
        first_sent: float | None = None
        event = first
        while event is not None:
            if isinstance(event, AudioChunk):
                seconds += len(event.pcm) / event.sample_rate
                first_sent = first_sent or time.time()
                yield piece(encode_audio(event.pcm, event.sample_rate, "pcm16"))
            elif isinstance(event, Finished):
                self.metrics.observe_reply(_with_sent(event.timing, first_sent), seconds, event.t)
                if events_out:  # the text read (the instruction turn and the input), the codec frames made
                    read = event.usage["prompt_tokens"] + event.usage["completion_tokens"]
                    frames = int(event.usage.get("audio_frames", 0))
                    yield oai.sse(oai.speech_audio_done(read, frames, speech_finish_reason(event)))
            event = await anext(events, None)

    # ---- voices --------------------------------------------------------------------------------------------
    def _prepare_upload(self, raw: bytes, content_type: str | None, query_model: str | None
                        ) -> tuple[ServedModel, str, ReferenceAudio]:
        """A voice upload's model, name and reference audio decoded and checked; on the parsing pool. The name is
        checked against the store (taken, or the store full) before the audio is decoded."""
        fields, name, form_model = parse_voice_upload(content_type, raw, self.limits)
        model = voice_model(self.models, form_model or query_model)
        require_cloning(model, "uploading a voice")
        model.orchestrator.voice_store.check_can_add(name)
        return model, name, upload_reference(fields, self.limits, reference_rate(model))

    async def upload_voice(self, raw: bytes, content_type: str | None, query_model: str | None) -> Response:
        model, name, reference = await self.parsing.run(self._prepare_upload, raw, content_type, query_model)
        entry = await model.orchestrator.add_voice(name, reference)  # encoded once by the reference stage
        return JSONResponse(voice_created(entry, model.name))

    async def list_voices(self, query_model: str | None) -> Response:
        """A cloning model's stored voices; another model's built-in speakers (none for VoiceDesign)."""
        model = voice_model(self.models, query_model)
        if clones_voices(model):
            voices = [voice_object(entry, model.name) for entry in await model.orchestrator.list_voices()]
        else:
            voices = [speaker_object(name, model.name) for name in model.orchestrator.voices]
        return JSONResponse(voice_list(voices))

    async def delete_voice(self, name: str, query_model: str | None) -> Response:
        model = voice_model(self.models, query_model)
        require_cloning(model, "deleting a voice")
        await model.orchestrator.delete_voice(name)
        return JSONResponse(voice_deleted(name, model.name))

    # ---- service -------------------------------------------------------------------------------------------
    async def ready(self) -> Response:
        snapshot: dict[str, dict[str, Any]] = await self.board.snapshot.remote(READY_AFTER_S)
        present = {str(s.get("deployment") or s.get("stage")) for s in snapshot.values()}
        missing = [name for model in self.models.values() for name in model.deployments if name not in present]
        if missing:
            return JSONResponse({"status": "not ready", "missing_stages": missing}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse({"status": "ready", "replicas": len(snapshot)})

    async def metrics_text(self) -> Response:
        snapshot = await self.board.snapshot.remote()
        peers = [s["reply_samples"] for rid, s in snapshot.items() if s.get("stage") == "ingress" and rid != self.replica_id]
        return Response(self.metrics.render(snapshot, peers), media_type="text/plain; version=0.0.4")
