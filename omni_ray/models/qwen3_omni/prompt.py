"""Chat messages → Thinker prompt ids (chat template, audio placeholders expanded) and 16 kHz input clips."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from omni_ray.audio import AudioDecodeError, decode_audio, num_audio_tokens
from omni_ray.errors import InvalidRequestError

AUDIO_PART_TYPES = frozenset({"input_audio", "audio"})
SAMPLES_PER_FEATURE_FRAME = 160  # 10 ms hop at 16 kHz


class PromptError(InvalidRequestError):
    """The messages cannot be turned into a prompt (client error)."""


@dataclass
class Prompt:
    ids: list[int]
    clips: list[np.ndarray]  # 16 kHz mono float32, in placeholder order
    audio_tokens: int


def _audio_bytes(part: dict[str, Any]) -> bytes:
    if part["type"] == "input_audio":
        payload = part.get("input_audio") or {}
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, str):
            raise PromptError("input_audio.data must be a base64 string")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PromptError(f"input_audio.data is not valid base64: {exc}") from exc
    audio = part.get("audio")
    if not isinstance(audio, (bytes, bytearray)):
        raise PromptError("an 'audio' part must carry raw audio bytes")
    return bytes(audio)


class PromptBuilder:
    """Renders messages with the checkpoint's chat template and expands each audio placeholder to its token count."""

    def __init__(self, checkpoint: str, audio_token_id: int, max_audio_seconds: float = 600.0) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.audio_token_id = audio_token_id
        self.max_audio_seconds = max_audio_seconds

    def build(self, messages: list[dict[str, Any]]) -> Prompt:
        if not messages:
            raise PromptError("messages must not be empty")
        rendered: list[dict[str, Any]] = []
        clips: list[np.ndarray] = []
        for message in messages:
            role, content = message.get("role"), message.get("content")
            if role not in ("system", "user", "assistant"):
                raise PromptError(f"unsupported role {role!r}")
            if isinstance(content, list):
                parts = []
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text":
                        parts.append({"type": "text", "text": str(part.get("text", ""))})
                    elif kind in AUDIO_PART_TYPES:
                        try:
                            clips.append(decode_audio(_audio_bytes(part), max_seconds=self.max_audio_seconds))
                        except AudioDecodeError as exc:
                            raise PromptError(str(exc)) from exc
                        parts.append({"type": "audio"})
                    else:
                        raise PromptError(f"unsupported content part type {kind!r}")
                rendered.append({"role": role, "content": parts})
            elif isinstance(content, str):
                rendered.append({"role": role, "content": content})
            else:
                raise PromptError("message content must be a string or a list of parts")
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        counts = [num_audio_tokens(len(c) // SAMPLES_PER_FEATURE_FRAME) for c in clips]
        if ids.count(self.audio_token_id) != len(clips):
            raise PromptError("audio placeholders do not match the audio parts")
        expanded: list[int] = []
        index = 0
        for token in ids:
            if token == self.audio_token_id:
                expanded.extend([token] * counts[index])
                index += 1
            else:
                expanded.append(token)
        return Prompt(expanded, clips, sum(counts))
