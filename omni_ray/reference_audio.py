"""Reference audio for voice cloning, whatever the family: decoded from file bytes, checked (length, rate, silence,
finite samples) and resampled to the rate the family's encoder takes; the clip a request or an upload carries."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch

from omni_ray.audio import resample

REFERENCE_SAMPLE_RATE = 24000  # Qwen3-TTS's encoder; another family's encoder names its own rate


AudioArray = np.ndarray | torch.Tensor


class ReferenceAudioError(ValueError):
    """Reference audio the encoder refuses; `reason` is one of REASONS. The serving layer answers it with a 400."""

    REASONS = ("undecodable", "empty", "bad_shape", "bad_sample_rate", "too_short", "too_long", "non_finite", "silent")

    def __init__(self, reason: str, message: str) -> None:
        if reason not in self.REASONS:
            raise ValueError(f"unknown reason {reason!r}")
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[type["ReferenceAudioError"], tuple[str, str]]:
        return type(self), (self.reason, str(self))  # survives pickling (a Ray actor's error reaches its caller so)


@dataclass(frozen=True)
class ReferenceLimits:
    """What reference audio is accepted. Durations are of the audio as given, before resampling.

    The official package sets no bounds; these are ours. The lower bound is well above what the networks can take
    (the speaker encoder's reflect padding needs about 0.06 s) because a shorter clip clones no voice worth having;
    the upper bound keeps a request's encoding (and its Talker prefix, 12.5 frames a second) bounded."""

    min_seconds: float = 1.0
    max_seconds: float = 30.0
    silence_peak: float = 1e-3  # a clip whose loudest sample is at or below this (−60 dBFS) counts as silent
    min_sample_rate: int = 8000
    max_sample_rate: int = 192000


def decode_reference_audio(data: bytes, limits: ReferenceLimits = ReferenceLimits()) -> tuple[np.ndarray, int]:
    """Audio file bytes (wav, flac, ogg, mp3: what libsndfile reads) → (float32 [samples, channels], native rate).

    No resampling here: `prepare_reference_audio` (or `ReferenceEncoder.encode`) takes the pair, as the official package
    reads base64 and URL references with soundfile at their own rate. A file longer than the limit is refused from its
    header, before decoding. Raises ReferenceAudioError ("undecodable", "empty", "too_long")."""
    if not data:
        raise ReferenceAudioError("empty", "reference audio is empty")
    try:
        with sf.SoundFile(io.BytesIO(data)) as audio_file:
            rate, frames = int(audio_file.samplerate), int(audio_file.frames)
            if rate > 0 and frames / rate > limits.max_seconds:
                raise ReferenceAudioError(
                    "too_long", f"reference audio is {frames / rate:.2f} s; at most {limits.max_seconds:g} s is accepted"
                )
            samples = audio_file.read(dtype="float32", always_2d=True)
    except ReferenceAudioError:
        raise
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        detail = getattr(error, "error_string", None) or error
        raise ReferenceAudioError("undecodable", f"reference audio could not be decoded ({len(data)} bytes): {detail}") from error
    if samples.shape[0] == 0:
        raise ReferenceAudioError("empty", "reference audio has no samples")
    return samples, rate


def prepare_reference_audio(audio: AudioArray, sample_rate: int, limits: ReferenceLimits = ReferenceLimits(),
                            target_rate: int = REFERENCE_SAMPLE_RATE) -> np.ndarray:
    """Validate one reference clip and return it mono, float32, at `target_rate` (24 kHz: this encoder's; another
    family's encoder names its own).

    `audio` is [samples] or [samples, channels] (soundfile's layout; channels are averaged, as the official package
    does). Integer PCM is scaled to [-1, 1). Raises ReferenceAudioError."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise ReferenceAudioError("bad_sample_rate", f"sample rate must be an integer, got {sample_rate!r}")
    sample_rate = int(sample_rate)
    if not limits.min_sample_rate <= sample_rate <= limits.max_sample_rate:
        raise ReferenceAudioError(
            "bad_sample_rate",
            f"reference sample rate {sample_rate} Hz is outside {limits.min_sample_rate}-{limits.max_sample_rate} Hz",
        )
    samples = audio.detach().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    if samples.ndim not in (1, 2):
        raise ReferenceAudioError("bad_shape", f"reference audio must be [samples] or [samples, channels], got {samples.shape}")
    if samples.size == 0:
        raise ReferenceAudioError("empty", "reference audio has no samples")
    if np.issubdtype(samples.dtype, np.integer):
        samples = samples.astype(np.float64) / float(np.iinfo(samples.dtype).max + 1)
    elif not np.issubdtype(samples.dtype, np.floating):
        raise ReferenceAudioError("bad_shape", f"reference audio must be numeric, got {samples.dtype}")
    samples = samples.astype(np.float32, copy=False)
    if samples.ndim == 2:
        samples = samples.mean(axis=-1)
    seconds = samples.size / sample_rate
    if seconds < limits.min_seconds:
        raise ReferenceAudioError("too_short", f"reference audio is {seconds:.2f} s; at least {limits.min_seconds:g} s is needed")
    if seconds > limits.max_seconds:
        raise ReferenceAudioError("too_long", f"reference audio is {seconds:.2f} s; at most {limits.max_seconds:g} s is accepted")
    if not np.isfinite(samples).all():
        raise ReferenceAudioError("non_finite", "reference audio has NaN or infinite samples")
    if float(np.abs(samples).max()) <= limits.silence_peak:
        raise ReferenceAudioError("silent", "reference audio is silent")
    return resample_to_reference_rate(samples, sample_rate, target_rate)


def resample_to_reference_rate(samples: np.ndarray, sample_rate: int,
                               target_rate: int = REFERENCE_SAMPLE_RATE) -> np.ndarray:
    """float32 mono → `target_rate` (24 kHz by default), ceil(N × target_rate / rate) samples long.

    The official package resamples with libsoxr's high-quality preset (librosa's default) and trims or zero-pads the
    result to that length. We do the same when the `soxr` package is installed, and so match its codes exactly; without
    it, scipy's polyphase filter stands in (same length, slightly different samples, so codes may differ)."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if sample_rate == target_rate:
        return samples
    target_length = int(np.ceil(samples.size * (float(target_rate) / sample_rate)))
    try:
        import soxr
    except ImportError:
        converted = resample(samples, sample_rate, target_rate)
    else:
        converted = soxr.resample(samples, sample_rate, target_rate, quality="soxr_hq")
    fitted = np.zeros(target_length, dtype=np.float32)
    kept = min(target_length, converted.size)
    fitted[:kept] = converted[:kept]
    return fitted


@dataclass
class ReferenceAudio:
    """Reference speech to clone a voice from: samples at `sample_rate`, and its transcript (Qwen3-TTS: for in-context
    cloning, without which, or with `x_vector_only`, only the speaker embedding is used; S2 Pro: required)."""

    samples: np.ndarray
    sample_rate: int
    text: str | None = None
    x_vector_only: bool = False
