"""Tests for omni_ray.audio: decoding, encoding, and Qwen3-Omni feature extraction."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeProcessorKwargs,
)

from omni_ray.audio import (
    PROCESSOR_AUDIO_KWARGS,
    AudioDecodeError,
    AudioFeatureExtractor,
    AudioTooLongError,
    audio_duration_seconds,
    decode_audio,
    encode_audio,
    encode_wav,
    num_audio_tokens,
    writable_formats,
)

FREQ = 1000.0


def _signal(sr: int, seconds: float, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(round(sr * seconds))
    sine = 0.5 * np.sin(2 * np.pi * FREQ * np.arange(n) / sr)
    x = np.stack([sine + 0.01 * rng.standard_normal(n) for _ in range(channels)], axis=1)
    return x.astype(np.float32) if channels > 1 else x[:, 0].astype(np.float32)


def _write(x: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def _peak_hz(x: np.ndarray, sr: int = 16000) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1.0 / sr)[np.argmax(spec)])


@pytest.mark.parametrize("sr", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("channels", [1, 2])
def test_wav_roundtrip_resamples_to_16k_mono(sr: int, channels: int) -> None:
    x = _signal(sr, 1.3, channels)
    y = decode_audio(_write(x, sr, "WAV", "PCM_16"))
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - x.shape[0] * 16000 / sr) <= 1
    assert abs(_peak_hz(y) - FREQ) <= 2.0
    assert 0.3 < np.abs(y).max() < 0.6


def test_flac_decodes() -> None:
    x = _signal(44100, 1.0, 2)
    y = decode_audio(_write(x, 44100, "FLAC"))
    assert abs(len(y) - 16000) <= 1
    assert abs(_peak_hz(y) - FREQ) <= 2.0


@pytest.mark.parametrize("fmt,subtype", [("MP3", "MPEG_LAYER_III"), ("OGG", "VORBIS")])
def test_lossy_inputs_decode(fmt: str, subtype: str) -> None:
    if fmt not in sf.available_formats() or subtype not in sf.available_subtypes(fmt):
        pytest.skip(f"libsndfile here cannot handle {fmt}/{subtype}")
    x = _signal(44100, 1.0, 2)
    try:
        data = _write(x, 44100, fmt, subtype)
    except sf.LibsndfileError as e:
        pytest.skip(f"libsndfile cannot write {fmt}/{subtype}: {e}")
    y = decode_audio(data)
    assert abs(len(y) - 16000) <= 1152  # allow one codec frame of encoder padding
    assert abs(_peak_hz(y) - FREQ) <= 3.0


def test_undecodable_inputs_raise() -> None:
    with pytest.raises(AudioDecodeError, match="empty"):
        decode_audio(b"")
    with pytest.raises(AudioDecodeError):
        decode_audio(b"this is definitely not audio data " * 50)
    header_only = _write(np.zeros(0, dtype=np.int16), 16000, "WAV", "PCM_16")
    assert len(header_only) == 44
    with pytest.raises(AudioDecodeError):
        decode_audio(header_only)
    with pytest.raises(AudioDecodeError):
        decode_audio(header_only[:20])
    assert issubclass(AudioDecodeError, ValueError)


def test_nan_samples_raise() -> None:
    x = _signal(16000, 0.5)
    x[100] = np.nan
    with pytest.raises(AudioDecodeError, match="NaN"):
        decode_audio(_write(x, 16000, "WAV", "FLOAT"))


def test_max_seconds() -> None:
    data = _write(_signal(22050, 2.0, 2), 22050, "WAV", "PCM_16")
    assert audio_duration_seconds(data) == pytest.approx(2.0)
    assert len(decode_audio(data, max_seconds=2.5)) == 32000
    with pytest.raises(AudioTooLongError, match="exceeding"):
        decode_audio(data, max_seconds=1.5)
    assert issubclass(AudioTooLongError, AudioDecodeError)


def test_encode_wav_flac_roundtrip() -> None:
    x = _signal(24000, 0.5)
    x[:10] = 2.0  # clipped
    for data in (encode_wav(x, 24000), encode_audio(x, 24000, "flac")):
        y, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert sr == 24000 and y.shape == x.shape
        np.testing.assert_allclose(y[:10], 32767 / 32768, atol=1e-6)
        np.testing.assert_allclose(y[10:], x[10:], atol=1.0 / 16000)
    assert sf.info(io.BytesIO(encode_wav(x, 24000))).subtype == "PCM_16"


def test_encode_pcm16() -> None:
    x = _signal(24000, 0.25)
    data = encode_audio(x, 24000, "pcm16")
    assert len(data) == 2 * len(x)
    pcm = np.frombuffer(data, dtype="<i2")
    np.testing.assert_array_equal(pcm, np.round(np.clip(x, -1, 1) * 32767).astype(np.int16))


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_encode_lossy(fmt: str) -> None:
    if fmt not in writable_formats():
        with pytest.raises(ValueError, match="not supported"):
            encode_audio(_signal(24000, 0.5), 24000, fmt)
        return
    for sr in (24000, 44100):  # 44.1 kHz is not an Opus rate: resampled to 48 kHz
        y = decode_audio(encode_audio(_signal(sr, 1.0), sr, fmt))
        assert abs(len(y) - 16000) <= 1152 and abs(_peak_hz(y) - FREQ) <= 3.0


def test_encode_unknown_format() -> None:
    with pytest.raises(ValueError, match="unsupported audio format"):
        encode_audio(np.zeros(10, dtype=np.float32), 16000, "aac")


@pytest.fixture(scope="module")
def extractor() -> AudioFeatureExtractor:
    return AudioFeatureExtractor()


def _processor_audio_defaults() -> tuple[dict[str, object], int]:
    """The feature-extractor kwargs and `n_window` that Qwen3OmniMoeProcessor applies by default, layered as its
    `_merge_kwargs` layers them: the processor's class attributes (`audio_kwargs`, `n_window`, as in transformers 5.25),
    then the kwargs TypedDict's `_defaults["audio_kwargs"]` on top (where older releases keep them, `n_window` inside).
    Raises if neither layout holds them, so a further move in transformers fails here instead of comparing nothing."""
    kwargs: dict[str, object] = dict(getattr(Qwen3OmniMoeProcessor, "audio_kwargs", None) or {})
    kwargs.update((getattr(Qwen3OmniMoeProcessorKwargs, "_defaults", None) or {}).get("audio_kwargs", {}))
    n_window = kwargs.pop("n_window", getattr(Qwen3OmniMoeProcessor, "n_window", None))
    if not kwargs or not isinstance(n_window, int):
        raise LookupError("transformers' Qwen3OmniMoeProcessor audio defaults are in neither known layout")
    return kwargs, n_window


def test_processor_kwargs_match_transformers() -> None:
    defaults, n_window = _processor_audio_defaults()
    assert n_window == 50
    assert defaults == PROCESSOR_AUDIO_KWARGS


@pytest.mark.parametrize("n", [201, 1600, 16000, 16123, 16000 * 7 + 37])
def test_features_match_processor_path(extractor: AudioFeatureExtractor, n: int) -> None:
    audio = _signal(16000, n / 16000)[:n]
    feats, t = extractor(audio)
    assert t == n // 160
    assert feats.shape == (128, t) and feats.dtype == torch.float32

    # Reference: what Qwen3OmniMoeProcessor.__call__ does with the audio (defaults, n_window popped).
    ref_fe = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
        chunk_length=300, padding_value=0.0, return_attention_mask=True,
    )
    kwargs, _ = _processor_audio_defaults()
    ref = ref_fe([audio], return_tensors="pt", **kwargs)
    mask = ref["attention_mask"]
    assert int(mask.sum()) == t
    torch.testing.assert_close(feats, ref["input_features"][0][:, mask[0].bool()])
    expected_tokens = int(_get_feat_extract_output_lengths(mask.sum(-1), 50)[0])
    assert extractor.num_audio_tokens(t) == expected_tokens


def test_long_audio_not_truncated(extractor: AudioFeatureExtractor) -> None:
    feats, t = extractor(_signal(16000, 31.0))  # beyond Whisper's 30 s window
    assert t == 3100 and feats.shape == (128, 3100)


def test_too_short_audio_raises(extractor: AudioFeatureExtractor) -> None:
    with pytest.raises(AudioDecodeError, match="too short"):
        extractor(np.zeros(100, dtype=np.float32))


def test_from_pretrained_dir(tmp_path: Path, extractor: AudioFeatureExtractor) -> None:
    extractor.extractor.save_pretrained(tmp_path)
    assert (tmp_path / "preprocessor_config.json").exists()
    loaded = AudioFeatureExtractor(tmp_path)
    audio = _signal(16000, 0.8)
    torch.testing.assert_close(loaded(audio)[0], extractor(audio)[0])


def test_num_audio_tokens_matches_transformers() -> None:
    lengths = torch.arange(0, 2000)
    ref = _get_feat_extract_output_lengths(lengths, 50)
    assert [num_audio_tokens(int(n)) for n in lengths] == ref.tolist()
    ref25 = _get_feat_extract_output_lengths(lengths, 25)
    assert [num_audio_tokens(int(n), n_window=25) for n in lengths] == ref25.tolist()
    assert num_audio_tokens(100) == 13 and num_audio_tokens(3000) == 390
