"""Qwen3-TTS Base speaker encoder: the 24 kHz log-mel front end and the ECAPA-TDNN that turns it into an x-vector."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.weights import load_module, random_module, read_tensors

# The mel front end is fixed by the official package, whatever the speaker encoder's config says.
MEL_SAMPLE_RATE = 24000
MEL_BINS = 128
MEL_N_FFT = 1024
MEL_HOP = 256
MEL_FMAX = 12000.0
MEL_LOG_FLOOR = 1e-5
MAGNITUDE_EPS = 1e-9


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of a Base checkpoint's config.json (defaults are the official class's)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SpeakerEncoderConfig":
        known = {name for name in cls.__dataclass_fields__ if name != "extra"}
        values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in known}
        config = cls(**values, extra={k: v for k, v in raw.items() if k not in known})
        if not len(config.enc_channels) == len(config.enc_kernel_sizes) == len(config.enc_dilations):
            raise ValueError("speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations differ in length")
        if config.mel_dim != MEL_BINS:
            raise ValueError(f"speaker_encoder_config.mel_dim is {config.mel_dim}; the mel front end gives {MEL_BINS} bins")
        return config

    @classmethod
    def from_checkpoint(cls, checkpoint: Path) -> "SpeakerEncoderConfig":
        raw = json.loads((Path(checkpoint) / "config.json").read_text())
        if raw.get("tts_model_type") not in (None, "base") or "speaker_encoder_config" not in raw:
            raise ValueError(f"{checkpoint} is not a Base checkpoint: it has no speaker encoder")
        return cls.from_dict(raw["speaker_encoder_config"])


# ---------------------------------------------------------------------------------------------------------------------
# Log-mel front end
# ---------------------------------------------------------------------------------------------------------------------


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above (27 mels per octave×ln(6.4))."""
    hz = np.asarray(hz, dtype=np.float64)
    linear_step = 200.0 / 3
    break_hz = 1000.0
    break_mel = break_hz / linear_step
    log_step = np.log(6.4) / 27.0
    return np.where(hz >= break_hz, break_mel + np.log(np.maximum(hz, 1e-10) / break_hz) / log_step, hz / linear_step)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    linear_step = 200.0 / 3
    break_hz = 1000.0
    break_mel = break_hz / linear_step
    log_step = np.log(6.4) / 27.0
    return np.where(mel >= break_mel, break_hz * np.exp(log_step * (mel - break_mel)), mel * linear_step)


def slaney_mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """[n_mels, n_fft//2+1] triangular filters on Slaney's mel scale, each scaled to unit area (Slaney norm).

    The triangles are evaluated in float64, stored as float32, then scaled in float64 and stored as float32 again,
    which reproduces the usual librosa filter bank bit for bit."""
    fft_hz = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    edges_hz = _slaney_mel_to_hz(np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2))
    widths = np.diff(edges_hz)
    offsets = edges_hz[:, None] - fft_hz[None, :]
    filters = np.zeros((n_mels, fft_hz.size), dtype=np.float32)
    for band in range(n_mels):
        rising = -offsets[band] / widths[band]
        falling = offsets[band + 2] / widths[band + 1]
        filters[band] = np.maximum(0.0, np.minimum(rising, falling))
    area_norm = 2.0 / (edges_hz[2 : n_mels + 2] - edges_hz[:n_mels])
    filters *= area_norm[:, None]
    return filters


@lru_cache(maxsize=8)
def _mel_filter_tensor(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(slaney_mel_filters(MEL_SAMPLE_RATE, MEL_N_FFT, MEL_BINS, 0.0, MEL_FMAX)).to(device)


def log_mel_spectrogram(waves: torch.Tensor) -> torch.Tensor:
    """waves [B, N] at 24 kHz → natural-log mel magnitudes [B, frames, 128], frames = (N - 256) // 256 + 1.

    Reflect-padded by (n_fft - hop) / 2 on both sides, uncentred periodic-Hann STFT, magnitude with a 1e-9 floor under
    the root, Slaney mel filters up to 12 kHz, log clamped at 1e-5. Computed in float32 whatever the input dtype."""
    waves = waves.to(torch.float32)
    pad = (MEL_N_FFT - MEL_HOP) // 2
    if waves.shape[-1] <= pad:
        raise ValueError(f"{waves.shape[-1]} samples are too few for the mel front end (needs more than {pad})")
    padded = F.pad(waves.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(MEL_N_FFT, device=waves.device, dtype=torch.float32)
    spectrum = torch.stft(
        padded, MEL_N_FFT, hop_length=MEL_HOP, win_length=MEL_N_FFT, window=window,
        center=False, normalized=False, onesided=True, return_complex=True,
    )
    magnitude = torch.sqrt(torch.view_as_real(spectrum).pow(2).sum(-1) + MAGNITUDE_EPS)
    filters = _mel_filter_tensor(waves.device)
    mel = torch.matmul(filters, magnitude)
    return torch.log(torch.clamp(mel, min=MEL_LOG_FLOOR)).transpose(1, 2)


# ---------------------------------------------------------------------------------------------------------------------
# ECAPA-TDNN
# ---------------------------------------------------------------------------------------------------------------------


def _same_conv(in_channels: int, out_channels: int, kernel_size: int = 1, dilation: int = 1) -> nn.Conv1d:
    """Conv1d keeping the length, reflect-padded (the checkpoint's convolutions all are)."""
    return nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayLayer(nn.Module):
    """Dilated 1-D convolution then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.conv = _same_conv(in_channels, out_channels, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetLayer(nn.Module):
    """Splits the channels into `scale` groups; group i (i ≥ 1) is convolved together with group i-1's output."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TimeDelayLayer(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = torch.chunk(x, self.scale, dim=1)
        outputs = [groups[0]]
        previous: torch.Tensor | None = None
        for block, group in zip(self.blocks, groups[1:]):
            previous = block(group if previous is None else group + previous)
            outputs.append(previous)
        return torch.cat(outputs, dim=1)


class SqueezeExcitation(nn.Module):
    """Channel gates from the time-averaged activations."""

    def __init__(self, channels: int, bottleneck: int) -> None:
        super().__init__()
        self.conv1 = _same_conv(channels, bottleneck)
        self.conv2 = _same_conv(bottleneck, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))
        return x * gates


class SERes2NetBlock(nn.Module):
    """1×1 TDNN → Res2Net → 1×1 TDNN → squeeze-excitation, with a residual connection."""

    def __init__(self, in_channels: int, channels: int, scale: int, se_channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TimeDelayLayer(in_channels, channels, 1, 1)
        self.res2net_block = Res2NetLayer(channels, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayLayer(channels, channels, 1, 1)
        self.se_block = SqueezeExcitation(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_mean_std(x: torch.Tensor, weights: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(dim=2)
    variance = (weights * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, torch.sqrt(variance.clamp(min=eps))


class AttentiveStatsPooling(nn.Module):
    """Attention over time (conditioned on the utterance's global mean and std), then the weighted mean and std."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TimeDelayLayer(channels * 3, attention_channels, 1, 1)
        self.conv = _same_conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        present = torch.ones(1, 1, frames, dtype=x.dtype, device=x.device)
        # The frame count is summed in the activations' dtype: in bfloat16 it rounds (281 → 280), as upstream.
        mean, std = _weighted_mean_std(x, present / present.sum(dim=2, keepdim=True), self.eps)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, frames), std.unsqueeze(2).expand(-1, -1, frames)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _weighted_mean_std(x, attention, self.eps)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN: log-mel [B, frames, 128] → x-vector [B, enc_dim]. Parameter names are the checkpoint's
    `speaker_encoder.*` keys with that prefix removed."""

    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.config = config
        channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.blocks = nn.ModuleList([TimeDelayLayer(config.mel_dim, channels[0], kernels[0], dilations[0])])
        for i in range(1, len(channels) - 1):
            self.blocks.append(
                SERes2NetBlock(channels[i - 1], channels[i], config.enc_res2net_scale, config.enc_se_channels,
                               kernels[i], dilations[i])
            )
        self.mfa = TimeDelayLayer(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatsPooling(channels[-1], config.enc_attention_channels)
        self.fc = _same_conv(channels[-1] * 2, config.enc_dim)

    def min_frames(self) -> int:
        """Fewest mel frames the reflect-padded convolutions accept (reflect padding must be shorter than the input)."""
        widest = max((k - 1) * d for k, d in zip(self.config.enc_kernel_sizes, self.config.enc_dilations))
        return widest - widest // 2 + 1

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)
        per_block: list[torch.Tensor] = []
        for block in self.blocks:
            x = block(x)
            per_block.append(x)
        x = self.mfa(torch.cat(per_block[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    @torch.inference_mode()
    def embed(self, wave_24k: torch.Tensor) -> torch.Tensor:
        """One 24 kHz waveform [N] → its x-vector [enc_dim] (in the module's dtype, on its device)."""
        param = next(self.parameters())
        mels = log_mel_spectrogram(wave_24k.to(param.device).unsqueeze(0))
        if mels.shape[1] < self.min_frames():
            raise ValueError(f"{mels.shape[1]} mel frames are too few for the speaker encoder (needs {self.min_frames()})")
        return self(mels.to(param.dtype))[0]


def load_speaker_encoder(checkpoint: Path | None, config: SpeakerEncoderConfig | None, device: str | torch.device,
                         dtype: torch.dtype) -> SpeakerEncoder:
    """The speaker encoder from `model.safetensors` (`speaker_encoder.*` only); random weights without a checkpoint."""
    if config is None:
        if checkpoint is None:
            raise ValueError("a config or a checkpoint is needed")
        config = SpeakerEncoderConfig.from_checkpoint(checkpoint)
    if checkpoint is None:
        return random_module(lambda: SpeakerEncoder(config), str(device), dtype)  # type: ignore[return-value]
    module = SpeakerEncoder(config)
    load_module(module, read_tensors(Path(checkpoint), "speaker_encoder."))
    return module.to(device=device, dtype=dtype).eval()
