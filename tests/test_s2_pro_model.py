"""S2 Pro's Dual-AR modules: the config's shapes, the interleaved rotary pairs run as the shared stack's halves, and the
multi-codebook fusion at the slow AR's input (tiny random checkpoint in the official layout, CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from omni_ray.layers.basic import RotaryEmbedding, apply_rotary
from omni_ray.models.s2_pro.checkpoint import tiny_config, weight_layout, write_tiny_checkpoint
from omni_ray.models.s2_pro.dual_ar_model import PUBLISHED_CONFIG, S2ProConfig, interleaved_to_halves, load_dual_ar


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("s2_pro"), seed=0)


def test_the_config_gives_each_stack_its_shape_and_q_k_norms() -> None:
    raw = tiny_config(semantic_begin=1024, vocab_size=1088)
    config = S2ProConfig.from_dict(raw)
    assert (config.slow.num_layers, config.slow.num_heads, config.slow.num_kv_heads, config.slow.head_dim) == (2, 4, 2, 16)
    assert config.slow.qk_norm and not config.fast.qk_norm  # as published: q/k norms in the slow AR only
    assert (config.num_codebooks, config.codebook_size, config.semantic_begin, config.semantic_end) == (10, 64, 1024, 1087)
    del raw["audio_decoder_config"]["attention_qk_norm"]  # absent: the fast AR follows the slow AR
    assert S2ProConfig.from_dict(raw).fast.qk_norm
    with pytest.raises(ValueError, match="not an S2 Pro config"):
        S2ProConfig.from_dict({**raw, "model_type": "qwen3"})


def test_the_published_config_has_the_published_sizes_and_token_ids() -> None:
    raw = json.loads(PUBLISHED_CONFIG.read_text())
    config = S2ProConfig.from_dict(raw)
    assert (config.slow.num_layers, config.slow.hidden_size, config.fast.num_layers) == (36, 2560, 4)
    assert config.slow.qk_norm and not config.fast.qk_norm and config.tie_word_embeddings
    assert config.semantic_end - config.semantic_begin + 1 == config.codebook_size == 4096
    sizes = {"text_model.": 0, "audio_decoder.": 0}
    for key, shape in weight_layout(raw).items():
        part = "text_model." if key.startswith("text_model.") or "codebook_embeddings" in key else "audio_decoder."
        sizes[part] += math.prod(shape)
    assert 4.0e9 < sizes["text_model."] < 4.2e9  # about 4 B: the slow AR with the codebook embeddings at its input
    assert 0.40e9 < sizes["audio_decoder."] < 0.44e9  # about 0.42 B: the fast AR


def _interleaved_rotation(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """The official rotation: pairs (2i, 2i+1) turned by position * theta^(-2i/D), cos and sin rounded to bfloat16."""
    dim = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * freqs
    cos, sin = angles.cos().to(torch.bfloat16).float()[:, None], angles.sin().to(torch.bfloat16).float()[:, None]
    pairs = x.float().unflatten(-1, (dim // 2, 2))
    turned = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], -1)
    return turned.flatten(-2)


def test_heads_reordered_to_halves_score_as_the_interleaved_rotation_does() -> None:
    """Queries and keys whose head dimensions the loader reorders, rotated by halves with bfloat16-rounded tables,
    give every query-key score the official interleaved rotation gives."""
    torch.manual_seed(0)
    tokens, heads, dim, theta = 40, 3, 16, 1e6
    q, k = torch.randn(tokens, heads, dim), torch.randn(tokens, heads, dim)
    positions = torch.arange(100, 100 + tokens)
    official = torch.einsum("thd,shd->hts", _interleaved_rotation(q, positions, theta),
                            _interleaved_rotation(k, positions, theta))
    rotary = RotaryEmbedding(dim, theta, table_dtype=torch.bfloat16)
    cos, sin = rotary(positions[None], torch.float32)
    reorder = lambda x: interleaved_to_halves(x.reshape(tokens * heads, dim).T, 1, dim).T.reshape(tokens, heads, dim)  # noqa: E731
    ours = torch.einsum("thd,shd->hts", apply_rotary(reorder(q)[None], cos, sin)[0], apply_rotary(reorder(k)[None], cos, sin)[0])
    torch.testing.assert_close(ours, official, rtol=1e-5, atol=1e-5)
    unrounded, _ = RotaryEmbedding(dim, theta)(positions[None], torch.float32)
    assert not torch.equal(unrounded, cos)  # the rounding is there to match


def test_a_semantic_position_fuses_its_codebooks_and_a_text_position_is_its_token(tiny_dir: Path) -> None:
    config = S2ProConfig.from_checkpoint(tiny_dir)
    model = load_dual_ar(tiny_dir, config, "cpu", torch.float32)
    tokens = torch.tensor([5, config.semantic_begin + 7, 900, config.semantic_end])
    codes = torch.randint(0, config.codebook_size, (config.num_codebooks, 4), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        embedded = model.input_embeddings(tokens, codes)
        table, books = model.embeddings.weight, model.codebook_embeddings.weight
        for position in range(4):
            expected = table[tokens[position]]
            if tokens[position] >= config.semantic_begin:
                rows = codes[:, position] + torch.arange(config.num_codebooks) * config.codebook_size
                expected = (expected + books[rows].sum(0)) / math.sqrt(config.num_codebooks + 1)
            torch.testing.assert_close(embedded[position], expected)


def test_make_tiny_writes_the_official_files(tmp_path: Path) -> None:
    from omni_ray.cli import main

    assert main(["make-tiny", "--family", "s2_pro", "--out", str(tmp_path / "tiny"), "--seed", "3"]) == 0
    names = {path.name for path in (tmp_path / "tiny").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = S2ProConfig.from_checkpoint(tmp_path / "tiny")
    assert config.semantic_end - config.semantic_begin + 1 == config.codebook_size
