"""Where a Qwen3-TTS deployment's files come from: a checkpoint, the tiny default of a variant, or full-size random
weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_ray.config import ModelSource
from omni_ray.models.qwen3_tts.checkpoint import DEFAULT_SEED, ensure_tiny_checkpoint
from omni_ray.models.qwen3_tts.talker_model import TTSModelConfig

DEFAULT_VARIANT = "custom_voice"
CONFIGS = Path(__file__).resolve().parent / "configs"
FULL_SIZE_CONFIG = CONFIGS / "qwen3_tts_12hz_1b7_custom_voice.json"
SPEECH_TOKENIZER_CONFIG = CONFIGS / "speech_tokenizer_12hz.json"
# the text-tokenizer ids of a config, which random weights take from the tiny checkpoint's tokenizer
TOKEN_ID_KEYS = ("tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id", "im_start_token_id", "im_end_token_id",
                 "assistant_token_id")


@dataclass(frozen=True)
class TTSModelFiles:
    """The tokenizer's directory, the weights' checkpoint (None: random weights), the model's config and its speech
    tokenizer's (`speech_tokenizer/config.json`)."""

    directory: Path
    weights: Path | None
    config: TTSModelConfig
    speech_tokenizer: dict[str, Any]


def resolve_model(source: ModelSource) -> TTSModelFiles:
    """A checkpoint as is; the tiny checkpoint of `source.variant` (made on first use); or, with `random_weights`, the
    full-size shapes of `source.config` (default: 1.7B CustomVoice) with the tiny checkpoint of that config's variant
    for the tokenizer, whose special-token ids replace the config's."""
    if source.random_weights:
        raw = json.loads(Path(source.config or FULL_SIZE_CONFIG).read_text())
        tiny = ensure_tiny_checkpoint(str(raw.get("tts_model_type", DEFAULT_VARIANT)), source.tiny_seed or DEFAULT_SEED)
        ids = json.loads((tiny / "config.json").read_text())
        raw.update({key: ids[key] for key in TOKEN_ID_KEYS if key in ids})
        speech = json.loads(SPEECH_TOKENIZER_CONFIG.read_text())
        return TTSModelFiles(tiny, None, TTSModelConfig.from_dict(raw), speech)
    if source.path is not None:
        directory = Path(source.path)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory} has no config.json: not a Qwen3-TTS checkpoint")
    else:
        directory = ensure_tiny_checkpoint(source.variant or DEFAULT_VARIANT, source.tiny_seed or DEFAULT_SEED)
    speech = json.loads((directory / "speech_tokenizer" / "config.json").read_text())
    return TTSModelFiles(directory, directory, TTSModelConfig.from_checkpoint(directory), speech)


def load_tokenizer(directory: Path) -> Any:
    """The checkpoint's Qwen2 byte-level BPE tokenizer."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(str(directory))
