"""S2 Pro's codec, Fish Audio's modified DAC: 44.1 kHz mono audio to ten codebooks at 2048 samples a frame and back,
causal throughout; loaded from the official `codec.pth`, and the shared streaming vocoder's `Codec`.

- Encoder: a k7 convolution to `encoder_dim` channels, then blocks of three residual units (dilations 1, 3, 9),
  Snake and a strided convolution, doubling the channels at strides 2, 4, 8, 8 (512 samples a step); the last block
  ends in a windowed causal transformer; then Snake and a k3 convolution to the latent (1024).
- Quantizer: the latent downsampled ×2 ×2 (a strided convolution and a ConvNeXt block each: 2048 samples a frame),
  `pre_module` (an 8-layer causal transformer, window 128 frames), a semantic codebook (1 × 4096), then nine residual
  codebooks (1024 each) on what it leaves; every code space is 8 wide.
- Decode: codes clamped (row 0 to 4095, rows 1-9 to 1023, on a copy: the caller's tensor stays as it was), the two
  quantizers' reconstructions summed, `post_module` (like `pre_module`), upsampled ×2 ×2 (transposed convolution and
  ConvNeXt), then the decoder: a k7 convolution to `decoder_dim` (1536), blocks of Snake, a causal transposed
  convolution and three residual units at rates 8, 8, 4, 2 (channels halving to 96), Snake, a k7 convolution to one
  channel, tanh. T frames give exactly T × 2048 samples, each from its frame and earlier ones (trim 0).

The attention masks are built for the length decoded (the official modules keep a 32768² one per transformer).

Streaming: `codec_state.py` decodes each chunk's new frames only, carrying attention and convolution state, exact
at any chunking; the vocoder stage uses it unless `streaming.stateful` is off. Window decoding (the shared
`StreamingDecoder`): the rotary positions count from a window's first frame and their table is rounded to bfloat16
position by position, so attention is not exactly shift-invariant: a window that starts after the stream's first
frame differs from the one-shot decode by about 1e-4 to 1e-3 however long its left context, and equals it (to float
rounding) only when it reaches back to frame 0. Beyond that, what a frame
depends on reaches back through `post_module`'s 8 layers of 128-frame windows (up to 8 × 127 = 1016 frames) and
about 9 frames of convolutions (the upsampler's ConvNeXt blocks and the decoder).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ray.models.s2_pro.codec_blocks import (
    CausalConv,
    CausalConvTranspose,
    ConvNeXtBlock,
    ResidualQuantizer,
    ResidualUnit,
    Snake,
    VectorQuantizer,
    WindowedTransformer,
)

__all__ = ["CODEC_CONFIG_FILE", "CODEC_FILE", "CodecConfig", "S2ProCodec", "TINY_CODEC_CONFIG", "codec_config_for",
           "load_codec", "official_codec_layout", "read_codec_state"]

CODEC_FILE = "codec.pth"
CODEC_CONFIG_FILE = "codec_config.json"  # only beside a tiny codec: the released one is the full-size default
ENCODER_HEAD_WIDTH = 64  # the encoder's transformer has one head per 64 channels (`EncoderBlock`: n_head = dim // 64)
ENCODER_FFN_RATIO = 3  # ... and a feed-forward 3× its width (`EncoderBlock`: intermediate_size = dim * 3)
STALE_BUFFERS = ("causal_mask", "freqs_cis")  # buffers older codec files carry; both are rebuilt, never loaded


@dataclass(frozen=True)
class CodecConfig:
    """The codec's geometry. Defaults are the released codec's, from fish-speech `3dd1f85`'s hydra config
    `fish_speech/configs/modded_dac_vq.yaml` (which `load_codec_model` instantiates) unless noted."""

    sample_rate: int = 44100  # sample_rate
    encoder_dim: int = 64  # encoder_dim
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)  # encoder_rates
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)  # encoder_transformer_layers
    encoder_window: int = 512  # the general config names none, so `EncoderBlock` takes its own default, 512
    decoder_dim: int = 1536  # decoder_dim
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)  # decoder_rates (decoder_transformer_layers build nothing)
    head_dim: int = 64  # transformer_general_config.head_dim (the encoder's transformer)
    rope_base: float = 10000.0  # rope_base of both transformer configs
    norm_eps: float = 1e-5  # norm_eps of both transformer configs
    codebooks: int = 9  # quantizer.n_codebooks (the residual ones)
    codebook_size: int = 1024  # quantizer.codebook_size
    semantic_codebook_size: int = 4096  # quantizer.semantic_codebook_size
    codebook_dim: int = 8  # quantizer.codebook_dim
    downsample_factors: tuple[int, ...] = (2, 2)  # quantizer.downsample_factor
    quantizer_layers: int = 8  # quantizer.post_module (= pre_module) config.n_layer
    quantizer_heads: int = 16  # ... config.n_head (n_local_heads -1: as many key/value heads)
    quantizer_dim: int = 1024  # ... config.dim (its input_dim is 1024 too: no projections)
    quantizer_hidden: int = 3072  # ... config.intermediate_size
    quantizer_head_dim: int = 64  # ... config.head_dim
    quantizer_window: int = 128  # ... window_size, in frames

    @property
    def latent_dim(self) -> int:
        """The encoder's output width (`DAC`: encoder_dim × 2 per encoder block; quantizer.input_dim is the same)."""
        return self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.encoder_rates) * math.prod(self.downsample_factors)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "CodecConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown codec config keys: {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# Small enough that decoding 20 frames on a CPU takes a few milliseconds; the quantizer's transformers' window is
# shorter than the goldens' code matrix, so it is exercised. Its codebooks (semantic and residual) have 64 codes, as
# many as the tiny Dual-AR's (`checkpoint.TINY_CODEBOOK_SIZE`), so that the codes of reference audio fit the Talker.
TINY_CODEC_CONFIG = CodecConfig(encoder_dim=4, encoder_transformer_layers=(0, 0, 0, 1), decoder_dim=32, head_dim=16,
                                codebook_size=64, semantic_codebook_size=64, quantizer_layers=2, quantizer_heads=2,
                                quantizer_dim=32, quantizer_hidden=64, quantizer_head_dim=16, quantizer_window=8)


class EncoderBlock(nn.Module):
    """Three residual units at half the width, Snake, a strided causal convolution doubling the channels, and a
    windowed transformer where the config puts one."""

    def __init__(self, dim: int, stride: int, layers: int, config: CodecConfig) -> None:
        super().__init__()
        half = dim // 2
        parts: list[nn.Module] = [ResidualUnit(half, 1), ResidualUnit(half, 3), ResidualUnit(half, 9), Snake(half),
                                  CausalConv(half, dim, 2 * stride, stride=stride)]
        if layers:
            parts.append(WindowedTransformer(dim, dim, layers, dim // ENCODER_HEAD_WIDTH, config.head_dim,
                                             dim * ENCODER_FFN_RATIO, config.encoder_window, config.rope_base,
                                             config.norm_eps))
        self.block = nn.Sequential(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Encoder(nn.Module):
    """Audio [B, 1, L] → latent [B, latent_dim, L / 512]."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        dim = config.encoder_dim
        parts: list[nn.Module] = [CausalConv(1, dim, 7)]
        for stride, layers in zip(config.encoder_rates, config.encoder_transformer_layers):
            dim *= 2
            parts.append(EncoderBlock(dim, stride, layers, config))
        parts += [Snake(dim), CausalConv(dim, config.latent_dim, 3)]
        self.block = nn.Sequential(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class DecoderBlock(nn.Module):
    """Snake, a causal transposed convolution (×stride, channels halved), three residual units."""

    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(Snake(in_dim), CausalConvTranspose(in_dim, out_dim, 2 * stride, stride),
                                   ResidualUnit(out_dim, 1), ResidualUnit(out_dim, 3), ResidualUnit(out_dim, 9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Decoder(nn.Module):
    """Latent [B, latent_dim, T'] → audio [B, 1, T' × 512] in (-1, 1)."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        dim = config.decoder_dim
        parts: list[nn.Module] = [CausalConv(config.latent_dim, dim, 7)]
        for stride in config.decoder_rates:
            parts.append(DecoderBlock(dim, dim // 2, stride))
            dim //= 2
        parts += [Snake(dim), CausalConv(dim, 1, 7), nn.Tanh()]
        self.model = nn.Sequential(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class DownsampleQuantizer(nn.Module):
    """Between encoder and decoder: frames of 4 latent steps, the transformers around the codebooks."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        dim = config.latent_dim
        self.semantic_quantizer = ResidualQuantizer(dim, 1, config.semantic_codebook_size, config.codebook_dim)
        self.quantizer = ResidualQuantizer(dim, config.codebooks, config.codebook_size, config.codebook_dim)
        self.downsample = nn.Sequential(*(
            nn.Sequential(CausalConv(dim, dim, factor, stride=factor, weight_normed=False), ConvNeXtBlock(dim))
            for factor in config.downsample_factors))
        self.upsample = nn.Sequential(*(
            nn.Sequential(CausalConvTranspose(dim, dim, factor, factor, weight_normed=False), ConvNeXtBlock(dim))
            for factor in reversed(config.downsample_factors)))

        def transformer() -> WindowedTransformer:
            return WindowedTransformer(dim, config.quantizer_dim, config.quantizer_layers, config.quantizer_heads,
                                       config.quantizer_head_dim, config.quantizer_hidden, config.quantizer_window,
                                       config.rope_base, config.norm_eps)

        self.pre_module = transformer()
        self.post_module = transformer()

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent [B, C, 4T] → codes [B, 1 + codebooks, T]."""
        z = self.pre_module(self.downsample(latent))
        semantic_codes, semantic = self.semantic_quantizer.encode(z)
        residual_codes, _ = self.quantizer.encode(z - semantic)
        return torch.cat([semantic_codes, residual_codes], dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, 1 + codebooks, T] (in range) → latent [B, C, 4T]."""
        z = self.semantic_quantizer.decode(codes[:, :1]) + self.quantizer.decode(codes[:, 1:])
        return self.upsample(self.post_module(z))


class S2ProCodec(nn.Module):
    """The whole codec, and the shared vocoder's `Codec`: `decode(codes [10, T])` → T × 2048 samples (trim 0)."""

    trim = 0

    def __init__(self, config: CodecConfig = CodecConfig()) -> None:
        super().__init__()
        if len(config.encoder_transformer_layers) != len(config.encoder_rates):
            raise ValueError("encoder_transformer_layers needs one entry per encoder rate")
        self.config = config
        self.encoder = Encoder(config)
        self.quantizer = DownsampleQuantizer(config)
        self.decoder = Decoder(config)
        self.num_quantizers = 1 + config.codebooks
        self.samples_per_frame = config.samples_per_frame
        self.sample_rate = config.sample_rate

    @property
    def _anchor(self) -> torch.Tensor:
        return self.decoder.model[0].conv.weight

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """Mono audio [samples] at `sample_rate` → codes [10, T], T = ceil(samples / 2048): the audio is zero-padded
        on the right to whole frames first, as the official encoder does."""
        if audio.dim() != 1:
            raise ValueError(f"audio must be 1-D [samples], got {tuple(audio.shape)}")
        pad = (-audio.shape[0]) % self.samples_per_frame
        x = torch.nn.functional.pad(audio.to(self._anchor), (0, pad))[None, None]
        return self.quantizer.encode(self.encoder(x))[0]

    def clamped(self, codes: torch.Tensor) -> torch.Tensor:
        """A copy of codes [..., 10, T] on the codec's device with each row within its codebook (row 0 at most
        semantic_codebook_size - 1, the others at most codebook_size - 1: 4095 and 1023 for the released codec;
        negatives to 0): generated residual codes often exceed the residual codebooks."""
        limits = torch.tensor([self.config.semantic_codebook_size - 1] + [self.config.codebook_size - 1]
                              * self.config.codebooks, device=self._anchor.device)
        codes = codes.to(device=self._anchor.device, dtype=torch.long)
        return torch.minimum(codes.clamp(min=0), limits[:, None])

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [10, T] → waveform [T × 2048] (or [B, 10, T] → [B, T × 2048]); the caller's codes are not
        changed."""
        if codes.dim() not in (2, 3) or codes.shape[-2] != self.num_quantizers:
            raise ValueError(f"codes must be [{self.num_quantizers}, T] or [B, {self.num_quantizers}, T], "
                             f"got {tuple(codes.shape)}")
        batched = self.clamped(codes if codes.dim() == 3 else codes[None])
        audio = self.decoder(self.quantizer.decode(batched))[:, 0]
        return audio if codes.dim() == 3 else audio[0]


def official_codec_layout(config: CodecConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor of the official `codec.pth` for `config` (its `generator.` prefix left off): key → (our
    parameter it folds into, its shape). The encoder's and decoder's convolutions store weight norms as
    parametrizations (`conv.parametrizations.weight.original0` the magnitude, `original1` the direction), the
    quantizers' projections in the older `weight_g`/`weight_v` form; the quantizer's resampling convolutions
    have none."""
    with torch.device("meta"):
        codec = S2ProCodec(config)
    normed: dict[str, str] = {}  # our weight key → the official keys' stem and form
    for name, module in codec.named_modules():
        if isinstance(module, (CausalConv, CausalConvTranspose)) and module.weight_normed:
            normed[f"{name}.conv.weight"] = "parametrizations"
        elif isinstance(module, VectorQuantizer):
            normed[f"{name}.in_proj.weight"] = normed[f"{name}.out_proj.weight"] = "weight_g"
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, tensor in codec.state_dict().items():
        shape = tuple(tensor.shape)
        magnitude = (shape[0],) + (1,) * (len(shape) - 1)
        form = normed.get(key)
        if form == "parametrizations":
            stem = key[: -len("weight")]
            layout[f"{stem}parametrizations.weight.original0"] = (key, magnitude)
            layout[f"{stem}parametrizations.weight.original1"] = (key, shape)
        elif form == "weight_g":
            layout[f"{key}_g"] = (key, magnitude)
            layout[f"{key}_v"] = (key, shape)
        else:
            layout[key] = (key, shape)
    return layout


def read_codec_state(path: Path) -> dict[str, torch.Tensor]:
    """The official `codec.pth` as our parameters: unwrapped from `state_dict`, the `generator.` prefix stripped
    (other networks' keys, a discriminator's, dropped), stale `causal_mask`/`freqs_cis` buffers dropped, and weight
    norms folded (w = g · v / ‖v‖ over all but the first dimension) in either stored form."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a file in torch's legacy (not zip) format cannot be mapped
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    if "state_dict" in state:
        state = state["state_dict"]
    if any(key.startswith("generator.") for key in state):
        state = {key[len("generator."):]: value for key, value in state.items() if key.startswith("generator.")}
    state = {key: value for key, value in state.items() if key.rsplit(".", 1)[-1] not in STALE_BUFFERS}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".parametrizations.weight.original0"):
            stem = key[: -len("parametrizations.weight.original0")]
            direction = state[f"{stem}parametrizations.weight.original1"]
            out[f"{stem}weight"] = torch._weight_norm(direction.float(), value.float(), 0)
        elif key.endswith(".weight_g"):
            stem = key[: -len("_g")]
            out[stem] = torch._weight_norm(state[f"{stem}_v"].float(), value.float(), 0)
        elif not key.endswith((".parametrizations.weight.original1", ".weight_v")):
            out[key] = value
    return out


def codec_config_for(checkpoint: Path) -> CodecConfig:
    """A checkpoint directory's codec geometry: `codec_config.json` beside a tiny codec, else the released one."""
    path = Path(checkpoint) / CODEC_CONFIG_FILE
    return CodecConfig.from_dict(json.loads(path.read_text())) if path.is_file() else CodecConfig()


def load_codec(checkpoint: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               config: CodecConfig | None = None) -> S2ProCodec:
    """The codec of a checkpoint directory (its `codec.pth`) or of a `codec.pth` itself, in eval mode. Strict: a
    missing, unexpected or reshaped tensor is an error."""
    checkpoint = Path(checkpoint)
    directory, path = (checkpoint, checkpoint / CODEC_FILE) if checkpoint.is_dir() else (checkpoint.parent, checkpoint)
    config = config if config is not None else codec_config_for(directory)
    with torch.device("meta"):
        codec = S2ProCodec(config)
    state = read_codec_state(path)
    expected = {key: tuple(value.shape) for key, value in codec.state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    reshaped = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    if missing or unexpected or reshaped:
        raise KeyError(f"{path}: missing {missing[:8]}, unexpected {unexpected[:8]}, reshaped {reshaped[:8]}")
    codec.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True, assign=True)
    return codec.to(device=device, dtype=dtype).eval()
