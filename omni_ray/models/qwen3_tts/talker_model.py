"""Qwen3-TTS's Talker modules (dense codec backbone, text embedding and projection, code predictor) and their loading."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from omni_ray.engine.codec_talker import CodecTalkerSpec
from omni_ray.engine.sampler import SamplingParams
from omni_ray.layers.basic import ResizeMLP
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.weights import load_module, random_module, read_tensors

VARIANTS: tuple[str, ...] = ("base", "custom_voice", "voice_design")


def _decoder_spec(section: dict[str, Any]) -> DecoderSpec:
    """A dense Qwen3 stack's shape from a config section. The Talker's M-RoPE reads three identical position streams,
    which is plain RoPE, so the stack runs plain RoPE."""
    cfg = SimpleNamespace(**{k: v for k, v in section.items() if k not in ("rope_scaling", "rope_parameters")})
    return DecoderSpec.from_hf(cfg)


@dataclass(frozen=True)
class TTSModelConfig:
    """What serving reads from a Qwen3-TTS `config.json`: the variant, the special ids, the speakers and languages,
    and the Talker's and code predictor's shapes."""

    variant: str  # base | custom_voice | voice_design (`tts_model_type`)
    size: str  # 0b6 | 1b7 (`tts_model_size`)
    talker: dict[str, Any]
    predictor: dict[str, Any]
    tts_bos_token_id: int
    tts_eos_token_id: int
    tts_pad_token_id: int
    speakers: dict[str, int]  # CustomVoice's named speakers → codec ids
    speaker_dialects: dict[str, str | bool]  # a speaker's dialect (a language name), or False
    languages: dict[str, int]  # language name → codec id; "auto" is not among them
    speaker_encoder: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TTSModelConfig":
        talker = dict(raw["talker_config"])
        variant = str(raw.get("tts_model_type", ""))
        if variant not in VARIANTS:
            raise ValueError(f"tts_model_type {variant!r} is not one of {', '.join(VARIANTS)}")
        return cls(
            variant=variant, size=str(raw.get("tts_model_size", "")), talker=talker,
            predictor=dict(talker["code_predictor_config"]),
            tts_bos_token_id=int(raw["tts_bos_token_id"]), tts_eos_token_id=int(raw["tts_eos_token_id"]),
            tts_pad_token_id=int(raw["tts_pad_token_id"]),
            speakers={k.lower(): int(v) for k, v in (talker.get("spk_id") or {}).items()},
            speaker_dialects={k.lower(): v for k, v in (talker.get("spk_is_dialect") or {}).items()},
            languages={k.lower(): int(v) for k, v in (talker.get("codec_language_id") or {}).items()},
            speaker_encoder=dict(raw.get("speaker_encoder_config") or {}),
        )

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> "TTSModelConfig":
        return cls.from_dict(json.loads((Path(checkpoint) / "config.json").read_text()))

    def codec_id(self, name: str) -> int:
        """One of the Talker's codec control ids: pad, bos, think, nothink, think_bos, think_eos (or eos)."""
        return int(self.talker["codec_eos_token_id" if name == "eos" else f"codec_{name}_id"])

    @property
    def num_groups(self) -> int:
        return int(self.talker["num_code_groups"])

    @property
    def takes_instructions(self) -> bool:
        """The official package ignores instructions for the 0.6B CustomVoice model; VoiceDesign needs them."""
        return not (self.variant == "custom_voice" and self.size == "0b6")

    def spec(self, code_sampling: SamplingParams) -> CodecTalkerSpec:
        p = self.predictor
        return CodecTalkerSpec(
            num_groups=self.num_groups, vocab=int(self.talker["vocab_size"]), eos=self.codec_id("eos"),
            bos=self.codec_id("bos"), predictor_layers=int(p["num_hidden_layers"]),
            predictor_kv_heads=int(p["num_key_value_heads"]),
            predictor_head_dim=int(p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"]),
            predictor_vocab=int(p["vocab_size"]), code_sampling=code_sampling,
        )


class CodePredictor(nn.Module):
    """Dense decoder completing code groups 1..G-1 of a frame from [Talker hidden, group-0 embedding]. Its code
    embeddings have the Talker's width; `small_to_mtp_projection` maps that width onto its own where they differ."""

    def __init__(self, config: TTSModelConfig) -> None:
        super().__init__()
        p, width = config.predictor, int(config.talker["hidden_size"])
        self.model = DecoderStack(_decoder_spec(p))
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(int(p["vocab_size"]), width) for _ in range(config.num_groups - 1)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(int(p["hidden_size"]), int(p["vocab_size"]), bias=False) for _ in range(config.num_groups - 1)
        )
        if int(p["hidden_size"]) != width:
            self.small_to_mtp_projection = nn.Linear(width, int(p["hidden_size"]), bias=True)


class TalkerModel(nn.Module):
    """Codec embedding + dense decoder + codec head, the text embedding and its projection, and the code predictor
    (parameter names as in the checkpoint under `talker.`)."""

    def __init__(self, config: TTSModelConfig) -> None:
        super().__init__()
        t = config.talker
        self.model = DecoderStack(_decoder_spec(t))
        self.model.codec_embedding = nn.Embedding(int(t["vocab_size"]), int(t["hidden_size"]))
        self.model.text_embedding = nn.Embedding(int(t["text_vocab_size"]), int(t["text_hidden_size"]))
        self.text_projection = ResizeMLP(int(t["text_hidden_size"]), int(t["text_hidden_size"]), int(t["hidden_size"]))
        self.codec_head = nn.Linear(int(t["hidden_size"]), int(t["vocab_size"]), bias=False)
        self.code_predictor = CodePredictor(config)

    def text(self, ids: torch.Tensor) -> torch.Tensor:
        """Projected text embeddings of token ids: what a text position adds to the Talker's input."""
        return self.text_projection(self.model.text_embedding(ids))

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., G] → every group's embedding summed [..., h] (group 0 from the Talker's table, the others from
        the code predictor's), the way a frame feeds the next step."""
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        return torch.stack([table(codes[..., g]) for g, table in enumerate(tables)], dim=-2).sum(-2)


@dataclass
class TalkerAssets:
    """The Talker model with the projected text rows every request reads (tts_bos, tts_eos, tts_pad)."""

    model: TalkerModel
    config: TTSModelConfig
    tts_bos: torch.Tensor
    tts_eos: torch.Tensor
    tts_pad: torch.Tensor


def load_talker(checkpoint: Path | None, config: TTSModelConfig, device: str, dtype: torch.dtype) -> TalkerAssets:
    """Reads `talker.*` from the checkpoint (random weights when there is none)."""
    if checkpoint is None:
        model: TalkerModel = random_module(lambda: TalkerModel(config), device, dtype)  # type: ignore[assignment]
    else:
        model = TalkerModel(config)
        load_module(model, read_tensors(checkpoint, "talker."))
        model = model.to(device=device, dtype=dtype).eval()
    ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
    with torch.inference_mode():
        bos, eos, pad = model.text(torch.tensor(ids, device=device))
    return TalkerAssets(model, config, bos, eos, pad)
