"""S2 Pro's Dual-AR modules on the shared decoder stack: the slow AR with multi-codebook fusion at its input, the fast
AR that completes each frame's codebooks, their config and loading from the official checkpoint layout."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.weights import load_module, random_module, read_tensors

MODEL_TYPE = "fish_qwen3_omni"
# The published checkpoint's `config.json` (configs/README.md says where each value comes from): the shape of the
# full-size random checkpoints the GPU benchmarks build.
PUBLISHED_CONFIG = Path(__file__).parent / "configs" / "s2_pro.json"
# The official attention rotates interleaved pairs (2i, 2i+1) with cos/sin tables rounded to bfloat16. The shared
# stack rotates halves (i, i + D/2): the loader reorders each query and key head's rows (and their norms) so that pair
# i lands on (i, i + D/2), which leaves every attention score as it was.
ROPE_TABLE_DTYPE = torch.bfloat16


def _section_spec(section: dict[str, Any], qk_norm: bool, eps: float, rope_base: float) -> DecoderSpec:
    heads = int(section["n_head"])
    kv_heads = int(section.get("n_local_heads") or -1)
    dim = int(section["dim"])
    return DecoderSpec(
        num_layers=int(section["n_layer"]), hidden_size=dim, num_heads=heads,
        num_kv_heads=heads if kv_heads == -1 else kv_heads,
        head_dim=int(section.get("head_dim") or dim // heads), rms_norm_eps=eps, rope_theta=rope_base,
        mrope_section=None, intermediate_size=int(section["intermediate_size"]), qk_norm=qk_norm,
        rope_table_dtype=ROPE_TABLE_DTYPE,
    )


@dataclass(frozen=True)
class S2ProConfig:
    """What serving reads from an S2 Pro `config.json` (`model_type` fish_qwen3_omni): the slow and fast stacks'
    shapes, the codebooks and the semantic token range."""

    slow: DecoderSpec
    fast: DecoderSpec
    vocab_size: int
    codebook_size: int
    num_codebooks: int
    semantic_begin: int  # the first <|semantic:i|> token id (i = 0)
    semantic_end: int  # the last one
    tie_word_embeddings: bool
    max_seq_len: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "S2ProConfig":
        if raw.get("model_type") != MODEL_TYPE:
            raise ValueError(f"not an S2 Pro config: model_type {raw.get('model_type')!r} (expected {MODEL_TYPE})")
        text, audio = raw["text_config"], raw["audio_decoder_config"]
        eps, rope_base = float(text.get("norm_eps", 1e-5)), float(text.get("rope_base", 10000))
        qk_norm = bool(text.get("attention_qk_norm", False))
        fast_qk_norm = audio.get("attention_qk_norm")  # absent: the slow model's setting, as the official loader reads it
        if any(text.get(key) or audio.get(key) for key in ("attention_qkv_bias", "attention_o_bias")):
            raise ValueError("S2 Pro attention with biases is not supported")
        fast = {"dim": text["dim"], "n_head": text["n_head"], "n_local_heads": text.get("n_local_heads", -1),
                "head_dim": text.get("head_dim"), "intermediate_size": text["intermediate_size"],
                **{key: value for key, value in audio.items() if value is not None}}
        return cls(
            slow=_section_spec(text, qk_norm, eps, rope_base),
            fast=_section_spec(fast, qk_norm if fast_qk_norm is None else bool(fast_qk_norm), eps, rope_base),
            vocab_size=int(text["vocab_size"]), codebook_size=int(audio["vocab_size"]),
            num_codebooks=int(audio["num_codebooks"]), semantic_begin=int(raw["semantic_start_token_id"]),
            semantic_end=int(raw["semantic_end_token_id"]),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", True)), max_seq_len=int(text.get("max_seq_len", 2048)),
        )

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> "S2ProConfig":
        return cls.from_dict(json.loads((Path(checkpoint) / "config.json").read_text()))


class DualARModel(nn.Module):
    """The slow AR (token embeddings, codebook embeddings, decoder stack, tied or own output) and the fast AR (its code
    embeddings, stack, norm and output; an input projection where the widths differ)."""

    def __init__(self, config: S2ProConfig) -> None:
        super().__init__()
        self.config = config
        self.slow = DecoderStack(config.slow)
        self.embeddings = nn.Embedding(config.vocab_size, config.slow.hidden_size)
        self.codebook_embeddings = nn.Embedding(config.codebook_size * config.num_codebooks, config.slow.hidden_size)
        self.output = None if config.tie_word_embeddings else nn.Linear(config.slow.hidden_size, config.vocab_size, bias=False)
        self.fast = DecoderStack(config.fast)
        self.fast_embeddings = nn.Embedding(config.codebook_size, config.fast.hidden_size)
        self.fast_output = nn.Linear(config.fast.hidden_size, config.codebook_size, bias=False)
        widths_differ = config.fast.hidden_size != config.slow.hidden_size
        self.fast_project_in = nn.Linear(config.slow.hidden_size, config.fast.hidden_size) if widths_differ else None

    def input_embeddings(self, tokens: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """tokens [..., T] and their codes [..., num_codebooks, T] → the slow AR's input [..., T, dim]. A semantic
        token's position fuses its codebooks: (its embedding + each codebook's) / sqrt(num_codebooks + 1); any other
        position is its token's embedding (its codes are not read)."""
        config = self.config
        offsets = torch.arange(config.num_codebooks, device=codes.device)[:, None] * config.codebook_size
        fused = self.codebook_embeddings(codes + offsets).sum(-3)
        semantic = ((tokens >= config.semantic_begin) & (tokens <= config.semantic_end))[..., None]
        embedded = self.embeddings(tokens)
        return torch.where(semantic, (embedded + fused) / math.sqrt(config.num_codebooks + 1), embedded)

    def token_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The slow AR's normed hidden states → token logits (through the token embeddings when tied)."""
        if self.output is None:
            return normed @ self.embeddings.weight.T
        return self.output(normed)

    def fast_input(self, normed: torch.Tensor) -> torch.Tensor:
        """The slow AR's normed hidden state → the fast AR's first position."""
        return normed if self.fast_project_in is None else self.fast_project_in(normed)


def interleaved_to_halves(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a query or key projection ([heads * head_dim, ...]) or a head norm ([head_dim], heads=1) reordered from
    interleaved rotary pairs (2i, 2i+1) to halves (i, i + head_dim/2)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return weight.reshape(heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)


def _stack_tensors(raw: dict[str, torch.Tensor], spec: DecoderSpec) -> dict[str, torch.Tensor]:
    """One stack's official keys (`layers.N.attention.wqkv`, `feed_forward.w1`, ...; `norm`) → the shared stack's."""
    q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out: dict[str, torch.Tensor] = {"norm.weight": raw["norm.weight"]}
    for n in range(spec.num_layers):
        src, dst = f"layers.{n}.", f"layers.{n}."
        q, k, v = raw[f"{src}attention.wqkv.weight"].split([q_rows, kv_rows, kv_rows])
        out[f"{dst}self_attn.q_proj.weight"] = interleaved_to_halves(q, spec.num_heads, spec.head_dim)
        out[f"{dst}self_attn.k_proj.weight"] = interleaved_to_halves(k, spec.num_kv_heads, spec.head_dim)
        out[f"{dst}self_attn.v_proj.weight"] = v
        out[f"{dst}self_attn.o_proj.weight"] = raw[f"{src}attention.wo.weight"]
        if spec.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{dst}self_attn.{name}.weight"] = interleaved_to_halves(
                    raw[f"{src}attention.{name}.weight"], 1, spec.head_dim)
        out[f"{dst}input_layernorm.weight"] = raw[f"{src}attention_norm.weight"]
        out[f"{dst}post_attention_layernorm.weight"] = raw[f"{src}ffn_norm.weight"]
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            out[f"{dst}mlp.{ours}.weight"] = raw[f"{src}feed_forward.{theirs}.weight"]
    return out


def dual_ar_tensors(slow: dict[str, torch.Tensor], audio: dict[str, torch.Tensor],
                    config: S2ProConfig) -> dict[str, torch.Tensor]:
    """The official checkpoint's `text_model.model.*` (`slow`) and `audio_decoder.*` (`audio`) tensors, prefixes
    stripped → `DualARModel`'s state dict."""
    out = {f"slow.{k}": v for k, v in _stack_tensors(slow, config.slow).items()}
    out["embeddings.weight"] = slow["embeddings.weight"]
    if not config.tie_word_embeddings:
        out["output.weight"] = slow["output.weight"]
    out["codebook_embeddings.weight"] = audio["codebook_embeddings.weight"]
    out.update({f"fast.{k}": v for k, v in _stack_tensors(audio, config.fast).items()})
    out["fast_embeddings.weight"] = audio["embeddings.weight"]
    out["fast_output.weight"] = audio["output.weight"]
    if config.fast.hidden_size != config.slow.hidden_size:
        out["fast_project_in.weight"], out["fast_project_in.bias"] = audio["project_in.weight"], audio["project_in.bias"]
    return out


def load_dual_ar(checkpoint: Path | None, config: S2ProConfig, device: str, dtype: torch.dtype) -> DualARModel:
    """The Dual-AR model from an official-layout checkpoint (random weights when there is none)."""
    if checkpoint is None:
        return random_module(lambda: DualARModel(config), device, dtype)  # type: ignore[return-value]
    model = DualARModel(config)
    tensors = dual_ar_tensors(read_tensors(checkpoint, "text_model.model."), read_tensors(checkpoint, "audio_decoder."),
                              config)
    load_module(model, tensors)
    return model.to(device=device, dtype=dtype).eval()
