"""Input-audio decoding/encoding and Qwen3-Omni (Whisper-style) log-mel feature extraction."""

from __future__ import annotations

import io
import struct
import os
from math import gcd

import numpy as np
import soundfile as sf
import torch
from transformers import WhisperFeatureExtractor

TARGET_SR: int = 16000
# Arguments Qwen3OmniMoeProcessor passes to the feature extractor by default (its audio kwargs, n_window popped).
# Spelled out rather than read from transformers, which keeps these defaults in different places across releases;
# tests/test_audio.py checks them against the installed release.
PROCESSOR_AUDIO_KWARGS: dict[str, object] = {
    "sampling_rate": TARGET_SR,
    "padding": True,
    "truncation": False,
    "return_attention_mask": True,
}
# Output format name -> (libsndfile major format, subtype).
_SF_WRITE_FORMATS: dict[str, tuple[str, str]] = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
_OPUS_RATES: frozenset[int] = frozenset({8000, 12000, 16000, 24000, 48000})
_MP3_RATES: frozenset[int] = frozenset({8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000})


class AudioDecodeError(ValueError):
    """Input audio bytes could not be turned into a valid waveform."""


class AudioTooLongError(AudioDecodeError):
    """Input audio exceeds the configured maximum duration."""


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Polyphase-resample along axis 0 using the reduced up/down ratio."""
    if orig_sr == target_sr:
        return samples
    from scipy.signal import resample_poly  # here, not at import: scipy.signal takes seconds to import in every replica

    g = gcd(int(orig_sr), int(target_sr))
    return resample_poly(samples, target_sr // g, orig_sr // g, axis=0).astype(np.float32, copy=False)


def _sf_msg(e: Exception) -> str:
    return str(getattr(e, "error_string", None) or e)


def _open(data: bytes) -> sf.SoundFile:
    if not data:
        raise AudioDecodeError("empty audio input")
    try:
        return sf.SoundFile(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        msg = f"could not decode audio ({len(data)} bytes): unsupported or corrupt format ({_sf_msg(e)})"
        raise AudioDecodeError(msg) from e


def audio_duration_seconds(data: bytes) -> float:
    """Duration in seconds read from the container header (no full decode)."""
    with _open(data) as f:
        if f.samplerate <= 0:
            raise AudioDecodeError(f"invalid sample rate {f.samplerate}")
        return float(f.frames) / float(f.samplerate)


def decode_audio(data: bytes, max_seconds: float | None = None) -> np.ndarray:
    """Decode wav/flac/mp3/ogg bytes to float32 mono at 16 kHz."""
    with _open(data) as f:
        sr, frames, fmt = int(f.samplerate), int(f.frames), f.format
        if sr <= 0:
            raise AudioDecodeError(f"invalid sample rate {sr} in {fmt} header")
        if frames == 0:
            raise AudioDecodeError(f"{fmt} audio contains no samples")
        if max_seconds is not None and frames / sr > max_seconds:
            raise AudioTooLongError(f"audio is {frames / sr:.2f}s long, exceeding the limit of {max_seconds:g}s")
        try:
            x = f.read(dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError) as e:
            raise AudioDecodeError(f"failed while decoding {fmt} audio: {_sf_msg(e)}") from e
    if x.shape[0] == 0:
        raise AudioDecodeError(f"{fmt} audio contains no samples")
    if max_seconds is not None and x.shape[0] / sr > max_seconds:
        raise AudioTooLongError(f"audio is {x.shape[0] / sr:.2f}s long, exceeding the limit of {max_seconds:g}s")
    if not np.isfinite(x).all():
        raise AudioDecodeError("audio contains NaN or infinite samples")
    mono = x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]
    return np.ascontiguousarray(resample(mono, sr, TARGET_SR), dtype=np.float32)


def _to_int16(samples: np.ndarray) -> np.ndarray:
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim not in (1, 2):
        raise ValueError(f"samples must be 1-D (mono) or 2-D [frames, channels], got shape {x.shape}")
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """Encode float samples in [-1, 1] as PCM16 WAV bytes (clipped)."""
    return encode_audio(samples, sample_rate, "wav")


def writable_formats() -> list[str]:
    """Output formats supported by this build (pcm16 always; others per libsndfile)."""
    out = ["pcm16"]
    majors = sf.available_formats()
    for name, (major, subtype) in _SF_WRITE_FORMATS.items():
        if major in majors and subtype in sf.available_subtypes(major):
            out.append(name)
    return out


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode float samples as wav | flac | pcm16 (raw LE int16) | mp3 | opus (Ogg) bytes."""
    fmt = fmt.lower()
    if sample_rate <= 0:
        raise ValueError(f"invalid sample rate {sample_rate}")
    if fmt == "pcm16":
        return _to_int16(samples).astype("<i2").tobytes()
    if fmt not in _SF_WRITE_FORMATS:
        raise ValueError(f"unsupported audio format {fmt!r}; expected one of {sorted([*_SF_WRITE_FORMATS, 'pcm16'])}")
    if fmt not in writable_formats():
        major, subtype = _SF_WRITE_FORMATS[fmt]
        raise ValueError(f"audio format {fmt!r} ({major}/{subtype}) is not supported by this libsndfile build")
    major, subtype = _SF_WRITE_FORMATS[fmt]
    if fmt in ("wav", "flac"):
        data: np.ndarray = _to_int16(samples)  # exact PCM16, identical quantisation to "pcm16"
    else:
        data = _to_int16(samples).astype(np.float32) / 32767.0
        allowed = _OPUS_RATES if fmt == "opus" else _MP3_RATES
        if sample_rate not in allowed:
            data, sample_rate = resample(data, sample_rate, 48000), 48000
    buf = io.BytesIO()
    try:
        sf.write(buf, data, sample_rate, format=major, subtype=subtype)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise ValueError(f"failed to encode audio as {fmt!r}: {_sf_msg(e)}") from e
    return buf.getvalue()


def num_audio_tokens(feature_len: int, n_window: int = 50) -> int:
    """Audio-encoder output positions for `feature_len` mel frames (3 stride-2 convs per 2*n_window chunk)."""
    chunk = n_window * 2
    rem = feature_len % chunk
    after = (rem - 1) // 2 + 1
    after = (after - 1) // 2 + 1
    after = (after - 1) // 2 + 1
    return int(after + (feature_len // chunk) * 13)


class AudioFeatureExtractor:
    """Per-clip 128-bin log-mel features exactly as Qwen3OmniMoeProcessor computes them."""

    def __init__(self, path: str | os.PathLike[str] | None = None, n_window: int = 50) -> None:
        if path is not None:
            self.extractor = WhisperFeatureExtractor.from_pretrained(os.fspath(path))
        else:
            self.extractor = WhisperFeatureExtractor(
                feature_size=128,
                sampling_rate=TARGET_SR,
                hop_length=160,
                n_fft=400,
                chunk_length=300,
                padding_value=0.0,
                return_attention_mask=True,
            )
        if self.extractor.sampling_rate != TARGET_SR:
            raise ValueError(f"feature extractor expects {self.extractor.sampling_rate} Hz, not {TARGET_SR} Hz")
        self.n_window = n_window
        self.hop_length: int = int(self.extractor.hop_length)
        self.min_samples: int = int(self.extractor.n_fft) // 2 + 1  # reflect-padded STFT needs > n_fft/2

    def __call__(self, audio_16k: np.ndarray) -> tuple[torch.Tensor, int]:
        """Return (input_features [n_mels, T] float32, T) for one 16 kHz mono clip."""
        x = np.asarray(audio_16k, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"expected 1-D mono audio, got shape {x.shape}")
        if x.shape[0] < self.min_samples:
            raise AudioDecodeError(f"audio too short: {x.shape[0]} samples, need at least {self.min_samples}")
        if not np.isfinite(x).all():
            raise AudioDecodeError("audio contains NaN or infinite samples")
        out = self.extractor(x, return_tensors="pt", **PROCESSOR_AUDIO_KWARGS)
        t = int(out["attention_mask"][0].sum())
        feats = out["input_features"][0, :, :t].to(torch.float32).contiguous()
        return feats, t

    def num_audio_tokens(self, feature_len: int) -> int:
        """Audio-encoder output positions for `feature_len` mel frames."""
        return num_audio_tokens(feature_len, self.n_window)


def wav_stream_header(sample_rate: int) -> bytes:
    """A PCM16 mono WAV header for a stream of unknown length (sizes set to the maximum, as streaming servers do)."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", unknown)
    )
