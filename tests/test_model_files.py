"""Model sources: a checkpoint, the tiny default, or full-size random weights with the tiny tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_ray.config import ModelSource
from omni_ray.models.qwen3_omni.model_files import FULL_SIZE_CONFIG, resolve_model


def test_tiny_default_is_its_own_weights_and_tokenizer(tiny_checkpoint: Path) -> None:
    files = resolve_model(ModelSource())
    assert files.weights == files.tokenizer_dir
    assert files.config.thinker_config.text_config.num_hidden_layers == 3


def test_random_weights_take_full_size_shapes_and_the_tokenizer_ids(tiny_checkpoint: Path) -> None:
    files = resolve_model(ModelSource(random_weights=True))
    tiny = json.loads((files.tokenizer_dir / "config.json").read_text())
    full = json.loads(FULL_SIZE_CONFIG.read_text())
    assert files.weights is None
    text = files.config.thinker_config.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_experts) == (48, 2048, 128)  # the 30B-A3B shapes
    # special-token ids follow the tokenizer that will encode the prompts, not the released vocabulary
    assert files.config.im_start_token_id == tiny["im_start_token_id"] != full["im_start_token_id"]
    assert files.config.thinker_config.audio_token_id == tiny["thinker_config"]["audio_token_id"]
    assert files.config.talker_config.codec_eos_token_id == full["talker_config"]["codec_eos_token_id"]


def test_model_source_rejects_mixed_sources(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="exclusive"):
        ModelSource(random_weights=True, path=tmp_path)
    with pytest.raises(ValidationError, match="only read with random_weights"):
        ModelSource(config=tmp_path / "config.json")
