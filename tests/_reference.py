"""Helpers shared by the end-to-end tests: run a request through the pipeline or through transformers."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf
import torch

from omni_ray.engine.sampler import SamplingParams
from omni_ray.pipeline import AudioChunk, Finished, Pipeline

GREEDY = SamplingParams(temperature=0.0)
# transformers applies the Talker's repetition penalty (1.05) even with talker_do_sample=False.
GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)


@dataclass
class Reply:
    token_ids: list[int]
    codes: torch.Tensor  # [16, frames]
    pcm: np.ndarray
    final: Finished


async def run_pipeline(pipeline: Pipeline, messages: list[dict[str, Any]], max_tokens: int, max_frames: int) -> Reply:
    pcm: list[np.ndarray] = []
    final: Finished | None = None
    async for event in pipeline.generate(
        messages, sampling=GREEDY, max_tokens=max_tokens, talker_sampling=GREEDY_TALKER,
        max_audio_frames=max_frames, stop_token_ids=[pipeline.model_config.im_end_token_id], return_codes=True,
    ):
        if isinstance(event, AudioChunk):
            pcm.append(event.pcm)
        elif isinstance(event, Finished):
            final = event
    assert final is not None and final.codes is not None
    return Reply(final.token_ids, final.codes, np.concatenate(pcm), final)


def run_transformers(
    model: Any, prompt_ids: list[int], max_tokens: int, max_frames: int, features: torch.Tensor | None = None
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy `generate()` of the reference. Returns text ids, codes [16, frames] and the waveform.

    transformers gives `talker_max_new_tokens - 1` frames (the last group-0 token is never completed),
    so `max_frames` frames need `max_frames + 1` new Talker tokens."""
    captured: dict[str, torch.Tensor] = {}
    decode = model.code2wav.chunked_decode

    def record(codes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        captured["codes"] = codes.clone()
        return decode(codes, **kwargs)

    extra: dict[str, Any] = {}
    if features is not None:
        extra = {"input_features": features[None], "feature_attention_mask": torch.ones(1, features.shape[1], dtype=torch.long)}
    model.code2wav.chunked_decode = record
    try:
        sequences, wav = model.generate(
            torch.tensor([prompt_ids]), speaker="ethan", thinker_max_new_tokens=max_tokens,
            talker_max_new_tokens=max_frames + 1, thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False, talker_do_sample=False, **extra,
        )
    finally:
        del model.code2wav.chunked_decode
    return sequences[0, len(prompt_ids) :].tolist(), captured["codes"][0], wav.reshape(-1)


def snr_db(reference: np.ndarray, estimate: np.ndarray) -> float:
    noise = float(np.sum((reference - estimate) ** 2))
    return float(10 * np.log10(float(np.sum(reference**2)) / max(noise, 1e-30)))


def wav_part(seconds: float, sample_rate: int, channels: int, seed: int) -> dict[str, Any]:
    """An input_audio content part holding a synthetic (chirp + noise) wav."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    tone = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.05 * rng.standard_normal(t.size)
    data = np.stack([tone * (0.8 + 0.2 * c) for c in range(channels)], axis=1).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, data, sample_rate, format="WAV", subtype="PCM_16")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"}}
