"""Qwen3-TTS reference encoding: reference audio, checked and resampled to 24 kHz (`omni_ray.reference_audio`), into
the 12 Hz tokenizer's reference codes [T, 16] (Mimi encoder) and the Base model's x-vector (ECAPA speaker encoder)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from transformers import MimiConfig
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiEncoder,
    MimiRotaryEmbedding,
    MimiSplitResidualVectorQuantizer,
    MimiTransformerModel,
)

from omni_ray.models.qwen3_tts.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig, load_speaker_encoder
from omni_ray.reference_audio import REFERENCE_SAMPLE_RATE, AudioArray, ReferenceLimits, prepare_reference_audio
from omni_ray.weights import load_module, random_module, read_tensors

SPEECH_TOKENIZER_DIR = "speech_tokenizer"
# transformers 4.57.3 (the official package's pin) gives Mimi's encoder transformer a plain causal mask and ignores
# `sliding_window`; transformers 5 applies it. A window longer than any reference keeps the official behaviour.
_UNBOUNDED_WINDOW = 1 << 30


def _causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] boolean causal mask. transformers 4.57.3 hands SDPA this explicit mask where transformers 5 would
    pass none and set is_causal; on a GPU the two pick different kernels (flash only without a mask), so we pass the
    same mask and get the official kernel's rounding."""
    batch, frames = hidden.shape[0], hidden.shape[1]
    mask = torch.ones(frames, frames, dtype=torch.bool, device=hidden.device).tril()
    return mask.expand(batch, 1, frames, frames)


@dataclass(frozen=True)
class ReferenceEncoding:
    """A reference's x-vector [enc_dim] (speaker encoder dtype) and, unless x-vector-only, its codes [T, 16] (int64).
    Both are on the encoder's device."""

    x_vector: torch.Tensor
    codes: torch.Tensor | None
    seconds: float


# ---------------------------------------------------------------------------------------------------------------------
# The 12 Hz tokenizer's encoder
# ---------------------------------------------------------------------------------------------------------------------


def speech_tokenizer_encoder_config(checkpoint: Path) -> tuple[MimiConfig, int, int]:
    """(Mimi encoder config, quantizers kept, samples per frame) from `<checkpoint>/speech_tokenizer/config.json`."""
    raw = json.loads((Path(checkpoint) / SPEECH_TOKENIZER_DIR / "config.json").read_text())
    return encoder_config_from(raw, str(checkpoint))


def encoder_config_from(raw: dict[str, Any], where: str = "speech tokenizer") -> tuple[MimiConfig, int, int]:
    """(Mimi encoder config, quantizers kept, samples per frame) from a speech tokenizer's config.json contents."""
    if raw.get("model_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
        raise ValueError(f"{where}: speech tokenizer {raw.get('model_type')!r} is not the 12 Hz one")
    if int(raw.get("input_sample_rate", REFERENCE_SAMPLE_RATE)) != REFERENCE_SAMPLE_RATE:
        raise ValueError(f"{where}: speech tokenizer input rate {raw['input_sample_rate']} is not {REFERENCE_SAMPLE_RATE}")
    encoder = {k: v for k, v in raw.get("encoder_config", {}).items() if k not in ("transformers_version", "architectures")}
    return MimiConfig(**encoder), int(raw.get("encoder_valid_num_quantizers", 16)), int(raw.get("encode_downsample_rate", 1920))


class SpeechTokenizerEncoder(nn.Module):
    """Mimi's encoder path (SEANet → causal transformer → stride-2 downsample → split RVQ), reusing transformers'
    Mimi modules. Attribute names follow the checkpoint's `encoder.*` keys with that prefix removed."""

    def __init__(self, config: MimiConfig, valid_quantizers: int = 16, samples_per_frame: int = 1920) -> None:
        super().__init__()
        config = copy.deepcopy(config)
        config.sliding_window = _UNBOUNDED_WINDOW
        config._attn_implementation = "sdpa"
        if config.frame_rate == config.encodec_frame_rate:
            raise ValueError("the 12 Hz tokenizer's encoder downsamples: frame_rate must differ from the SEANet rate")
        if not config.num_semantic_quantizers <= valid_quantizers <= config.num_quantizers:
            raise ValueError(f"cannot keep {valid_quantizers} of {config.num_quantizers} quantizers")
        self.config = config
        self.valid_quantizers = valid_quantizers
        self.samples_per_frame = samples_per_frame
        self.encoder = MimiEncoder(config)
        self.encoder_transformer = MimiTransformerModel(config)
        self.downsample = MimiConv1d(
            config, config.hidden_size, config.hidden_size,
            kernel_size=2 * int(config.encodec_frame_rate / config.frame_rate), stride=2, bias=False, pad_mode="replicate",
        )
        self.quantizer = MimiSplitResidualVectorQuantizer(config)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Casts keep the rotary frequencies in float32, as the official loader does (a bfloat16 copy shifts the
        angles of late frames enough to change codes)."""
        super()._apply(fn, recurse)
        for rope in self.modules():
            if isinstance(rope, MimiRotaryEmbedding) and rope.inv_freq.dtype != torch.float32:
                device = rope.inv_freq.device
                rope.inv_freq = rope.compute_default_rope_parameters(self.config)[0].to(device)
                rope.original_inv_freq = rope.inv_freq.clone()
        return self

    def frames_for(self, num_samples: int) -> int:
        return math.ceil(num_samples / self.samples_per_frame)

    def forward(self, waves: torch.Tensor) -> torch.Tensor:
        """waves [B, N] → codes [B, ceil(N / 1920), valid_quantizers]."""
        hidden = self.encoder(waves.unsqueeze(1)).transpose(1, 2)
        hidden = self.encoder_transformer(hidden, attention_mask=_causal_mask(hidden), return_dict=True).last_hidden_state
        hidden = self.downsample(hidden.transpose(1, 2))
        return self.quantizer.encode(hidden, self.valid_quantizers).permute(1, 2, 0)

    @torch.inference_mode()
    def encode(self, waves_24k: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """24 kHz clips → their codes, each [ceil(len / 1920), valid_quantizers] int64.

        Clips of equal length share a pass; others run alone. Padding would change a shorter clip's last frame: the
        convolutions pad each layer's activations past the end with zeros (the downsample replicates its last
        frame), which a zero-padded waveform does not reproduce. So a clip's codes never depend on its batch."""
        param = next(self.parameters())
        codes: list[torch.Tensor | None] = [None] * len(waves_24k)
        by_length: dict[int, list[int]] = {}
        for index, wave in enumerate(waves_24k):
            by_length.setdefault(int(wave.shape[-1]), []).append(index)
        for length, indices in by_length.items():
            batch = torch.stack([waves_24k[i].to(device=param.device, dtype=param.dtype) for i in indices])
            for index, clip_codes in zip(indices, self(batch).long()):
                codes[index] = clip_codes[: self.frames_for(length)]
        return codes  # type: ignore[return-value]


def load_speech_tokenizer_encoder(checkpoint: Path | None, device: str | torch.device, dtype: torch.dtype,
                                  config: MimiConfig | None = None, valid_quantizers: int = 16,
                                  samples_per_frame: int = 1920) -> SpeechTokenizerEncoder:
    """The encoder half of `speech_tokenizer/model.safetensors` (`encoder.*` only); random weights without one."""
    if checkpoint is not None:
        config, valid_quantizers, samples_per_frame = speech_tokenizer_encoder_config(checkpoint)
    if config is None:
        raise ValueError("a config or a checkpoint is needed")
    factory = lambda: SpeechTokenizerEncoder(config, valid_quantizers, samples_per_frame)  # noqa: E731
    if checkpoint is None:
        return random_module(factory, str(device), dtype)  # type: ignore[return-value]
    module = factory()
    load_module(module, read_tensors(Path(checkpoint) / SPEECH_TOKENIZER_DIR, "encoder."))
    return module.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------------------------------------------------
# Both together
# ---------------------------------------------------------------------------------------------------------------------


class ReferenceEncoder:
    """Reference audio → x-vector and (unless x-vector-only) reference codes, as the official
    `create_voice_clone_prompt` computes them for one reference. A batch gives each clip what it would get alone:
    codes share a pass only between clips of equal length, x-vectors are per clip (the speaker encoder's pooling
    has no padding mask)."""

    def __init__(self, speaker_encoder: SpeakerEncoder, codec_encoder: SpeechTokenizerEncoder | None,
                 limits: ReferenceLimits = ReferenceLimits()) -> None:
        self.speaker_encoder = speaker_encoder
        self.codec_encoder = codec_encoder
        self.limits = limits

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                        limits: ReferenceLimits = ReferenceLimits(), with_codes: bool = True) -> "ReferenceEncoder":
        """A Base checkpoint's speaker encoder and, with `with_codes`, its speech tokenizer's encoder."""
        speaker = load_speaker_encoder(Path(checkpoint), SpeakerEncoderConfig.from_checkpoint(checkpoint), device, dtype)
        codec = load_speech_tokenizer_encoder(Path(checkpoint), device, dtype) if with_codes else None
        return cls(speaker, codec, limits)

    @classmethod
    def random(cls, speaker_config: dict[str, Any], speech_tokenizer: dict[str, Any], device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, limits: ReferenceLimits = ReferenceLimits()) -> "ReferenceEncoder":
        """Full-size random weights (speed work): shapes from a model config's `speaker_encoder_config` and a speech
        tokenizer's config.json."""
        speaker = load_speaker_encoder(None, SpeakerEncoderConfig.from_dict(speaker_config), device, dtype)
        config, quantizers, samples_per_frame = encoder_config_from(speech_tokenizer)
        codec = load_speech_tokenizer_encoder(None, device, dtype, config, quantizers, samples_per_frame)
        return cls(speaker, codec, limits)

    @property
    def x_vector_dim(self) -> int:
        return self.speaker_encoder.config.enc_dim

    def prepare(self, audio: AudioArray, sample_rate: int) -> np.ndarray:
        """Validate and resample one clip (raises ReferenceAudioError)."""
        return prepare_reference_audio(audio, sample_rate, self.limits)

    def x_vector(self, wave_24k: np.ndarray) -> torch.Tensor:
        return self.speaker_encoder.embed(torch.from_numpy(wave_24k))

    def reference_codes(self, waves_24k: Sequence[np.ndarray]) -> list[torch.Tensor]:
        if self.codec_encoder is None:
            raise RuntimeError("this reference encoder was built without the speech tokenizer's encoder")
        return self.codec_encoder.encode([torch.from_numpy(w) for w in waves_24k])

    def encode(self, audio: AudioArray, sample_rate: int, x_vector_only: bool = False) -> ReferenceEncoding:
        """One clip: validated, resampled to 24 kHz, encoded. Raises ReferenceAudioError for unusable audio."""
        return self.encode_batch([(audio, sample_rate)], x_vector_only)[0]

    def encode_batch(self, clips: Sequence[tuple[AudioArray, int]],
                     x_vector_only: bool | Sequence[bool] = False) -> list[ReferenceEncoding]:
        """Several clips at once (any sample rates). Every clip is validated before any is encoded."""
        flags = [x_vector_only] * len(clips) if isinstance(x_vector_only, bool) else list(x_vector_only)
        if len(flags) != len(clips):
            raise ValueError(f"{len(clips)} clips but {len(flags)} x_vector_only flags")
        waves = [self.prepare(audio, rate) for audio, rate in clips]
        wanted = [i for i, only in enumerate(flags) if not only]
        codes: dict[int, torch.Tensor] = {}
        if wanted:
            codes = dict(zip(wanted, self.reference_codes([waves[i] for i in wanted])))
        return [
            ReferenceEncoding(self.x_vector(wave), codes.get(i), wave.size / REFERENCE_SAMPLE_RATE)
            for i, wave in enumerate(waves)
        ]
