"""Where a Qwen3-TTS deployment's files come from: a checkpoint, or the tiny default of a variant."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_ray.config import ModelSource
from omni_ray.models.qwen3_tts.checkpoint import DEFAULT_SEED, ensure_tiny_checkpoint
from omni_ray.models.qwen3_tts.talker_model import TTSModelConfig

DEFAULT_VARIANT = "custom_voice"


@dataclass(frozen=True)
class TTSModelFiles:
    """The checkpoint directory (tokenizer, speech tokenizer, weights) and its config."""

    directory: Path
    config: TTSModelConfig

    @property
    def weights(self) -> Path:
        return self.directory


def resolve_model(source: ModelSource) -> TTSModelFiles:
    """A checkpoint as is, or the tiny checkpoint of `source.variant` (made on first use)."""
    if source.random_weights:
        raise ValueError("Qwen3-TTS serves checkpoints (a local directory, or the tiny default); "
                         "random full-size weights are for the benchmarks (omni_ray.models.qwen3_tts.configs)")
    if source.path is not None:
        directory = Path(source.path)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory} has no config.json: not a Qwen3-TTS checkpoint")
    else:
        directory = ensure_tiny_checkpoint(source.variant or DEFAULT_VARIANT, source.tiny_seed or DEFAULT_SEED)
    return TTSModelFiles(directory, TTSModelConfig.from_checkpoint(directory))


def load_tokenizer(directory: Path) -> Any:
    """The checkpoint's Qwen2 byte-level BPE tokenizer."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(str(directory))
