"""Where a Qwen3-Omni deployment's files come from: a checkpoint, the tiny default, or full-size random weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import Qwen3OmniMoeConfig

from omni_ray.config import ModelSource
from omni_ray.models.qwen3_omni.checkpoint import ensure_tiny_checkpoint, resolve_checkpoint

FULL_SIZE_CONFIG = Path(__file__).resolve().parents[2] / "assets" / "qwen3_omni_30b_a3b_config.json"
# config sections whose `*_token_id` fields name text-tokenizer ids
_TOKEN_ID_SECTIONS = ((), ("thinker_config",), ("talker_config",))


@dataclass(frozen=True)
class ModelFiles:
    """The tokenizer/processor directory, the weights checkpoint (None: random weights) and the model config."""

    tokenizer_dir: Path
    weights: Path | None
    config: Qwen3OmniMoeConfig


def resolve_model(source: ModelSource) -> ModelFiles:
    """A checkpoint (or the tiny default) as is; or, with `random_weights`, the full-size shapes of `source.config`
    (default: Qwen3-Omni-30B-A3B) with the tiny checkpoint's tokenizer, whose special-token ids replace the config's."""
    if not source.random_weights:
        path = resolve_checkpoint(source.path, source.tiny_seed)
        return ModelFiles(path, path, Qwen3OmniMoeConfig.from_pretrained(path))
    tiny = ensure_tiny_checkpoint(source.tiny_seed)
    full = json.loads(Path(source.config or FULL_SIZE_CONFIG).read_text())
    tokenizer_ids = json.loads((tiny / "config.json").read_text())
    for section in _TOKEN_ID_SECTIONS:
        target, ids = _section(full, section), _section(tokenizer_ids, section)
        target.update({key: value for key, value in ids.items() if key.endswith("_token_id")})
    return ModelFiles(tiny, None, Qwen3OmniMoeConfig.from_dict(full))


def _section(config: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        config = config[key]
    return config
