"""Qwen3-TTS's 12 Hz codec decoder: a split-RVQ front on transformers' Code2Wav modules, loaded from the speech
tokenizer's checkpoint, and the streaming codec the shared vocoder serves it through.

Geometry (the official ``Qwen3TTSTokenizerV2Decoder``): 16 codebooks (1 semantic + 15 acoustic), each a table
``embedding_sum / cluster_usage`` of ``codebook_dim / 2`` wide rows; each half's rows are summed, projected
(1×1 convolution, no bias) to ``codebook_dim`` and the halves added; a causal kernel-3 convolution to ``latent_dim``;
the pre-transformer (``input_proj`` to its width, sliding-window layers, ``norm``, ``output_proj`` back); then the
same upsampling and decoder as Qwen3-Omni's Code2Wav, except that its transposed convolutions cut their overlap on
the right only. So the decoder is strictly causal: T frames give exactly ``T * 1920`` final samples (trim 0).

Parameter names are the checkpoint's under ``decoder.`` (``speech_tokenizer/model.safetensors``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavTransformerModel,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
)

from omni_ray.vocoder.code2wav import Code2WavCodec
from omni_ray.vocoder.code2wav_state import StatefulCode2Wav, StateWalk
from omni_ray.weights import load_module, random_module, read_tensors

__all__ = [
    "CodecDecoderConfig",
    "Qwen3TTSCodecDecoder",
    "StatefulTTSCodecDecoder",
    "clone_cut_samples",
    "clone_lead_in",
    "codec_decoder_config",
    "load_codec_decoder",
    "make_codec",
]

SPEECH_TOKENIZER_DIR = "speech_tokenizer"
OFFLINE_CHUNK_FRAMES = 300  # the official offline decode: chunks of 300 frames ...
OFFLINE_LEFT_CONTEXT = 25  # ... each decoded after 25 frames of left context


@dataclass(frozen=True)
class CodecDecoderConfig:
    """The speech tokenizer's ``decoder_config``; a key the file leaves out takes the official config class's
    default (``codebook_dim`` has none)."""

    codebook_dim: int
    codebook_size: int = 2048
    hidden_size: int = 1024
    latent_dim: int = 1024
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CodecDecoderConfig:
        scaling = values.get("rope_scaling")
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise ValueError(f"the codec decoder supports default RoPE only, got rope_scaling={scaling}")
        known = {field.name for field in fields(cls)}
        kept = {key: value for key, value in values.items() if key in known}
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in kept:
                kept[key] = tuple(int(v) for v in kept[key])
        return cls(**kept)

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    def code2wav_config(self) -> Qwen3OmniMoeCode2WavConfig:
        """The pre-transformer and decoder blocks' config, in the terms of transformers' Code2Wav modules."""
        return Qwen3OmniMoeCode2WavConfig(
            codebook_size=self.codebook_size, hidden_size=self.hidden_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": float(self.rope_theta)},
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            attention_bias=self.attention_bias, sliding_window=self.sliding_window,
            intermediate_size=self.intermediate_size, hidden_act=self.hidden_act,
            layer_scale_initial_scale=self.layer_scale_initial_scale, rms_norm_eps=self.rms_norm_eps,
            num_hidden_layers=self.num_hidden_layers, num_quantizers=self.num_quantizers,
            upsample_rates=list(self.upsample_rates), upsampling_ratios=list(self.upsampling_ratios),
            decoder_dim=self.decoder_dim,
        )


# ---- the split residual codebooks -------------------------------------------------------------------------------
class _Codebook(nn.Module):
    """One codebook's running statistics; its rows are ``embedding_sum / cluster_usage``."""

    def __init__(self, size: int, dim: int, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.epsilon = epsilon
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] → [B, T, dim]: only the rows used are divided (the same quotients as the whole table's)."""
        usage = F.embedding(codes, self.cluster_usage[:, None]).clamp(min=self.epsilon)
        return F.embedding(codes, self.embedding_sum) / usage


class _Quantizer(nn.Module):
    """Holds a codebook under the checkpoint's ``_codebook`` name."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _QuantizerStack(nn.Module):
    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Quantizer(size, dim) for _ in range(count))


class ResidualCodebooks(nn.Module):
    """A group of residual codebooks: each one's rows summed, then ``output_proj`` (``input_proj`` is the encoder
    side's; it is in the checkpoint and unused here)."""

    def __init__(self, count: int, size: int, dim: int, outer_dim: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(outer_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, outer_dim, 1, bias=False)
        self.vq = _QuantizerStack(count, size, dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, count, T] → [B, outer_dim, T]."""
        summed = self.vq.layers[0]._codebook.rows(codes[:, 0])
        for index in range(1, len(self.vq.layers)):
            summed = summed + self.vq.layers[index]._codebook.rows(codes[:, index])
        return self.output_proj(summed.transpose(1, 2))


class SplitCodebooks(nn.Module):
    """The first (semantic) codebook and the other 15 as two groups, their projections added."""

    def __init__(self, config: CodecDecoderConfig, semantic: int = 1) -> None:
        super().__init__()
        self.semantic = semantic
        half = config.codebook_dim // 2
        self.rvq_first = ResidualCodebooks(semantic, config.codebook_size, half, config.codebook_dim)
        self.rvq_rest = ResidualCodebooks(config.num_quantizers - semantic, config.codebook_size, half,
                                          config.codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] → [B, codebook_dim, T]."""
        return self.rvq_first.decode(codes[:, : self.semantic]) + self.rvq_rest.decode(codes[:, self.semantic :])


# ---- the decoder -------------------------------------------------------------------------------------------------
class _PreTransformer(Qwen3OmniMoeCode2WavTransformerModel):
    """Code2Wav's sliding-window transformer between ``input_proj`` (latent → its width) and ``output_proj`` back."""

    def __init__(self, config: Qwen3OmniMoeCode2WavConfig, latent_dim: int) -> None:
        super().__init__(config)
        self.input_proj = nn.Linear(latent_dim, config.hidden_size)
        self.output_proj = nn.Linear(config.hidden_size, latent_dim)

    def project(self, latent: torch.Tensor) -> torch.Tensor:
        """[B, T, latent] → [B, T, latent] through the projections and the layers."""
        hidden = super().forward(inputs_embeds=self.input_proj(latent)).last_hidden_state
        return self.output_proj(hidden)


def _right_trimmed(block: Qwen3OmniMoeCode2WavDecoderBlock) -> Qwen3OmniMoeCode2WavDecoderBlock:
    """The block's transposed convolution cuts its whole overlap on the right (Code2Wav's cuts it on both sides)."""
    for part in block.block:
        if isinstance(part, Qwen3OmniMoeCausalTransConvNet):
            part.left_pad = 0
            part.right_pad = part.conv.kernel_size[0] - part.conv.stride[0]
    return block


class Qwen3TTSCodecDecoder(nn.Module):
    """codes ``[B, 16, T]`` → waveform ``[B, 1, T * 1920]`` in [-1, 1] (``forward``: one pass over every frame)."""

    def __init__(self, config: CodecDecoderConfig) -> None:
        super().__init__()
        self.decoder_config = config
        self.config = config.code2wav_config()  # what the shared Code2Wav codec and stateful decoder read
        self.total_upsample = config.samples_per_frame
        latent = config.latent_dim
        self.quantizer = SplitCodebooks(config)
        self.pre_conv = Qwen3OmniMoeCausalConvNet(config.codebook_dim, latent, kernel_size=3)
        self.pre_transformer = _PreTransformer(self.config, latent)
        self.upsample = nn.ModuleList(
            nn.ModuleList([Qwen3OmniMoeCausalTransConvNet(latent, latent, factor, factor),
                           Qwen3OmniMoeConvNeXtBlock(latent)])
            for factor in config.upsampling_ratios
        )
        blocks = [_right_trimmed(Qwen3OmniMoeCode2WavDecoderBlock(self.config, i))
                  for i in range(len(config.upsample_rates))]
        out_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        self.decoder = nn.ModuleList([
            Qwen3OmniMoeCausalConvNet(latent, config.decoder_dim, 7), *blocks,
            Qwen3OmniMoeSnakeBeta(out_dim), Qwen3OmniMoeCausalConvNet(out_dim, 1, 7),
        ])

    def latent(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] → the pre-convolution's output [B, latent, T]."""
        return self.pre_conv(self.quantizer.decode(codes))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3 or codes.shape[1] != self.decoder_config.num_quantizers:
            raise ValueError(f"codes must be [B, {self.decoder_config.num_quantizers}, T], got {tuple(codes.shape)}")
        hidden = self.pre_transformer.project(self.latent(codes).transpose(1, 2)).transpose(1, 2)
        for upsample, convnext in self.upsample:
            hidden = convnext(upsample(hidden))
        for part in self.decoder:
            hidden = part(hidden)
        return hidden.clamp(min=-1, max=1)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, chunk_frames: int = OFFLINE_CHUNK_FRAMES,
               left_context: int = OFFLINE_LEFT_CONTEXT) -> torch.Tensor:
        """The official offline decode: codes ``[T, Q]`` (or ``[B, T, Q]``) → float32 waveform ``[T * 1920]`` (or
        ``[B, T * 1920]``), decoded ``chunk_frames`` at a time after ``left_context`` frames of context (one pass
        for T ≤ ``chunk_frames``)."""
        single = codes.dim() == 2
        batch = (codes[None] if single else codes).transpose(1, 2).long().to(next(self.parameters()).device)
        pieces, start, total = [], 0, batch.shape[-1]
        while start < total:
            end = min(start + chunk_frames, total)
            context = min(left_context, start)
            wav = self(batch[..., start - context : end])[:, 0]
            pieces.append(wav[:, context * self.total_upsample :])
            start = end
        wav = torch.cat(pieces, dim=-1).float().cpu() if pieces else torch.zeros(batch.shape[0], 0)
        return wav[0] if single else wav


# ---- the stateful decoder ----------------------------------------------------------------------------------------
class StatefulTTSCodecDecoder(StatefulCode2Wav):
    """`StatefulCode2Wav` over a `Qwen3TTSCodecDecoder`: the codebooks' sum, the pre-convolution (carrying its last
    two input frames), ``input_proj``, the shared sliding-window transformer and convolutions, then ``output_proj``."""

    def _embed(self, codes: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        module = self.module
        latent = self._causal_conv(module.pre_conv, module.quantizer.decode(codes), walk)
        return module.pre_transformer.input_proj(latent.transpose(1, 2))

    def _leave_transformer(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module.pre_transformer.output_proj(hidden)


def make_codec(module: Qwen3TTSCodecDecoder, sample_rate: int = 24000, cuda_graphs: bool = True,
               max_streams: int = 0) -> Code2WavCodec:
    """The shared vocoder's batched window and stateful codec over this decoder (trim measured: 0)."""
    return Code2WavCodec(module, sample_rate=sample_rate, cuda_graphs=cuda_graphs, max_streams=max_streams,
                         stateful_class=StatefulTTSCodecDecoder)


# ---- loading -----------------------------------------------------------------------------------------------------
def _speech_tokenizer_dir(checkpoint: Path) -> Path:
    """A model checkpoint's ``speech_tokenizer/`` (or the speech tokenizer's own directory)."""
    checkpoint = Path(checkpoint)
    nested = checkpoint / SPEECH_TOKENIZER_DIR
    return nested if (nested / "config.json").is_file() else checkpoint


def codec_decoder_config(checkpoint: Path) -> CodecDecoderConfig:
    """The ``decoder_config`` of a checkpoint's speech tokenizer."""
    config = json.loads((_speech_tokenizer_dir(checkpoint) / "config.json").read_text(encoding="utf-8"))
    return CodecDecoderConfig.from_dict(config["decoder_config"])


def load_codec_decoder(checkpoint: Path | None, device: str = "cpu", dtype: torch.dtype = torch.float32,
                       config: CodecDecoderConfig | None = None) -> Qwen3TTSCodecDecoder:
    """The decoder with the speech tokenizer's ``decoder.*`` weights (strict), or random weights (``config``
    required) when no checkpoint."""
    if checkpoint is None:
        if config is None:
            raise ValueError("random weights need a CodecDecoderConfig")
        return random_module(lambda: Qwen3TTSCodecDecoder(config), device, dtype)  # type: ignore[return-value]
    directory = _speech_tokenizer_dir(checkpoint)
    module = Qwen3TTSCodecDecoder(config or codec_decoder_config(directory))
    load_module(module, read_tensors(directory, "decoder."))
    return module.to(device=device, dtype=dtype).eval()


# ---- voice clone ---------------------------------------------------------------------------------------------------
def clone_cut_samples(reference_frames: int, total_frames: int, samples_per_frame: int = 1920) -> int:
    """How many leading samples the official voice clone cuts from its decode of [reference + generated] frames:
    ``int(ref / total * len)`` in float arithmetic, one short of ``ref * spf`` for some length pairs."""
    return int(reference_frames / max(total_frames, 1) * (total_frames * samples_per_frame))


def clone_lead_in(decoder: Any, generated_frames: int) -> torch.Tensor:
    """The samples the official clone output has before a stream's first (those of the reference's audio that its
    cut keeps: none, or one for some lengths), once the stream has `generated_frames` frames in all. A stream's
    chunks start at the first generated frame; a whole response prepends these to match the official output."""
    reference = int(decoder.reference_frames)
    spf = int(decoder.codec.samples_per_frame)
    count = reference * spf - clone_cut_samples(reference, reference + generated_frames, spf)
    return decoder.reference_tail(count)
