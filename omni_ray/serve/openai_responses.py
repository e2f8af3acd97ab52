"""OpenAI response shapes: chat completions and chunks, SSE framing, audio payloads, usage, the model list."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import numpy as np

from omni_ray.audio import encode_audio

OUTPUT_SAMPLE_RATE = 24000
AUDIO_EXPIRY_S = 3600


def usage_dict(prompt_tokens: int, completion_tokens: int, audio_frames: int | None = None) -> dict[str, Any]:
    """Text tokens; audio codec frames go to completion_tokens_details.audio_tokens, not into the totals."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if audio_frames is not None:
        usage["completion_tokens_details"] = {"audio_tokens": audio_frames}
    return usage


def chat_chunk(request_id: str, model: str, created: int, delta: dict[str, Any] | None,
               finish_reason: str | None = None, usage: dict[str, Any] | None = None,
               audio_finish_reason: str | None = None) -> dict[str, Any]:
    """One chat.completion.chunk; delta None gives the final usage-only chunk (choices []). `audio_finish_reason`
    (an extension, in the final chunk of a reply with audio): why the speech ended, `length` when it was cut short."""
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    if audio_finish_reason is not None:
        choice["audio_finish_reason"] = audio_finish_reason
    chunk["choices"] = [] if delta is None else [choice]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event, `data: <json>\\n\\n`; a string (e.g. "[DONE]") goes as is, one data line per line."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":")) if isinstance(data, dict) else data
    return "".join(f"data: {line}\n" for line in text.split("\n")).encode() + b"\n"


SSE_DONE = sse("[DONE]")


def audio_delta(audio_id: str, pcm: np.ndarray | None, transcript_delta: str = "") -> dict[str, Any]:
    """A streaming delta {"audio": {id, data: base64 PCM16 LE mono 24 kHz, transcript}}; pcm None omits data."""
    audio: dict[str, Any] = {"id": audio_id}
    if pcm is not None:
        raw = encode_audio(np.asarray(pcm, dtype=np.float32), OUTPUT_SAMPLE_RATE, "pcm16")
        audio["data"] = base64.b64encode(raw).decode()
    audio["transcript"] = transcript_delta
    return {"audio": audio}


def audio_message(audio_id: str, pcm: np.ndarray, fmt: str, transcript: str, created: int,
                  sample_rate: int = OUTPUT_SAMPLE_RATE) -> dict[str, Any]:
    """The non-streaming message.audio: the whole reply encoded as `fmt` (encode_audio's names; pcm16 = raw)."""
    data = encode_audio(np.asarray(pcm, dtype=np.float32), sample_rate, fmt)
    return {"id": audio_id, "data": base64.b64encode(data).decode(), "transcript": transcript,
            "expires_at": created + AUDIO_EXPIRY_S}


def chat_completion(request_id: str, model: str, created: int, text: str, finish_reason: str,
                    usage: dict[str, Any], audio: dict[str, Any] | None = None,
                    audio_finish_reason: str | None = None) -> dict[str, Any]:
    """A chat.completion; the text is also the audio's transcript. `audio_finish_reason` (an extension, with audio):
    why the speech ended, `length` when it was cut short."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if audio is not None:
        message["audio"] = audio
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if audio_finish_reason is not None:
        choice["audio_finish_reason"] = audio_finish_reason
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage}


def speech_audio_delta(audio: bytes) -> dict[str, Any]:
    """A `stream_format: sse` speech event: the next bytes of the audio, base64."""
    return {"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode()}


def speech_audio_done(input_tokens: int, output_tokens: int, finish_reason: str | None = None) -> dict[str, Any]:
    """The last `stream_format: sse` speech event: usage (text tokens read, codec frames made) and, an extension,
    why the speech ended (`stop`: the model's end of speech; `length`: a frame cap cut it short)."""
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
    done: dict[str, Any] = {"type": "speech.audio.done", "usage": usage}
    if finish_reason is not None:
        done["finish_reason"] = finish_reason
    return done


def models_list(model_ids: list[str], created: int | None = None) -> dict[str, Any]:
    stamp = int(time.time()) if created is None else created
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": stamp, "owned_by": "omni-ray"} for m in model_ids]}
