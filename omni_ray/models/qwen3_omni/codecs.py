"""Qwen3-Omni's encoder (AuT) and vocoder (Code2Wav) modules, reused from transformers, loaded by our loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    Qwen3OmniMoeCode2Wav,
)

from omni_ray.weights import load_module, random_module, read_tensors


def load_audio_encoder(checkpoint: Path | None, config: Any, device: str, dtype: torch.dtype) -> Qwen3OmniMoeAudioEncoder:
    """The AuT audio tower: only `thinker.audio_tower.*` is read; random weights when no checkpoint."""
    factory = lambda: Qwen3OmniMoeAudioEncoder._from_config(config.thinker_config.audio_config)  # noqa: E731
    if checkpoint is None:
        return random_module(factory, device, dtype)  # type: ignore[return-value]
    module = factory()
    load_module(module, read_tensors(checkpoint, "thinker.audio_tower."))
    return module.to(device=device, dtype=dtype).eval()


@torch.inference_mode()
def encode_audio_features(encoder: Qwen3OmniMoeAudioEncoder, features: list[torch.Tensor]) -> torch.Tensor:
    """features: per clip [num_mel_bins, T]. Returns the concatenated AuT embeddings [sum(tokens), hidden]."""
    param = next(encoder.parameters())
    stacked = torch.cat(features, dim=1).to(param.device, param.dtype)
    lengths = torch.tensor([f.shape[1] for f in features], device=param.device)
    return encoder(stacked, feature_lens=lengths).last_hidden_state


def load_code2wav(checkpoint: Path | None, config: Any, device: str, dtype: torch.dtype) -> Qwen3OmniMoeCode2Wav:
    """The Code2Wav vocoder: only `code2wav.*` is read; random weights when no checkpoint."""
    factory = lambda: Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config)  # noqa: E731
    if checkpoint is None:
        return random_module(factory, device, dtype)  # type: ignore[return-value]
    module = factory()
    load_module(module, read_tensors(checkpoint, "code2wav."))
    return module.to(device=device, dtype=dtype).eval()
