"""Qwen3-TTS's voices on the shared voice store: an x-vector, and in context the reference codes and transcript."""

from __future__ import annotations

from typing import Any

from omni_ray.models.qwen3_tts.prompt import VoiceReference
from omni_ray.voice_store import (  # noqa: F401 - re-exported: Qwen3-TTS's callers name the store's errors here
    DEFAULT_MAX_VOICES, VOICE_NAME, InvalidVoiceNameError, TooManyVoicesError, VoiceExistsError, VoiceNotFoundError,
    VoiceStoreError, check_voice_name, default_voices_dir, model_voices_id,
)
from omni_ray.voice_store import VoiceStore as SharedVoiceStore


class VoiceStore(SharedVoiceStore):
    """The shared store holding Qwen3-TTS voices: tensors `x_vector` [enc_dim] and, in context, `codes` [T, G]."""

    def save(self, name: str, voice: VoiceReference, sample_seconds: float,
             extra: dict[str, str] | None = None) -> dict[str, Any]:
        """Store `voice` as `name` (its reference audio lasted `sample_seconds`). Returns its `list()` entry."""
        if voice.in_context and not voice.text:
            raise ValueError("an in-context voice needs its reference transcript")
        tensors = {"x_vector": voice.x_vector}
        if voice.codes is not None:
            tensors["codes"] = voice.codes
        frames = 0 if voice.codes is None else int(voice.codes.shape[0])
        text = voice.text if voice.in_context else None
        return self.save_tensors(name, tensors, text, frames, sample_seconds, extra)

    def load(self, name: str) -> VoiceReference:
        """The stored voice `name`, bit for bit as saved; VoiceNotFoundError if there is none."""
        stored = self.load_tensors(name)
        codes = stored.tensors.get("codes")
        return VoiceReference(stored.tensors["x_vector"], codes, stored.text if codes is not None else None)
