"""Qwen3-TTS reference encoding: validation, the mel front end, codes and x-vectors, and parity with the official
package (a subprocess in its venv when present; the committed goldens otherwise)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_ray.models.qwen3_tts import checkpoint as ck
from omni_ray.models.qwen3_tts.reference_encoder import ReferenceEncoder
from omni_ray.reference_audio import (
    REFERENCE_SAMPLE_RATE, ReferenceAudioError, ReferenceLimits, decode_reference_audio, prepare_reference_audio,
    resample_to_reference_rate,
)
from omni_ray.models.qwen3_tts.speaker_encoder import MEL_HOP, log_mel_spectrogram, slaney_mel_filters

GOLDENS_DIR = Path(__file__).resolve().parent / "goldens" / "qwen3_tts"
OFFICIAL_SCRIPT = GOLDENS_DIR / "official_reference_encoding.py"
X_VECTOR_RTOL = 1e-4


def official_venv_python() -> Path | None:
    venv = Path(os.environ.get("QWEN_TTS_VENV", "/work/venv-qwen-tts"))
    python = venv / "bin" / "python"
    return python if python.is_file() else None


def has_soxr() -> bool:
    try:
        import soxr  # noqa: F401
    except ImportError:
        return False
    return True


def speech_like(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A voiced, syllable-rate-modulated tone with a gliding pitch plus a little noise: enough structure that codes
    and x-vectors react to it."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 3.1 * t))
    return (0.25 * envelope * voiced + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.make_tiny_checkpoint(tmp_path_factory.mktemp("tts_ref") / "base", variant="base", seed=0)


@pytest.fixture(scope="module")
def encoder(base_checkpoint: Path) -> ReferenceEncoder:
    return ReferenceEncoder.from_checkpoint(base_checkpoint)


# ---------------------------------------------------------------------------------------------------------------------
# Validation and resampling
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("audio", "rate", "reason"),
    [
        (np.zeros(0, np.float32), 24000, "empty"),
        (np.zeros((2, 2, 24000), np.float32), 24000, "bad_shape"),
        (speech_like(2.0, 24000), 0, "bad_sample_rate"),
        (speech_like(2.0, 24000), 24000.0, "bad_sample_rate"),
        (speech_like(2.0, 4000), 4000, "bad_sample_rate"),
        (speech_like(0.5, 24000), 24000, "too_short"),
        (speech_like(31.0, 16000), 16000, "too_long"),
        (np.zeros(48000, np.float32), 24000, "silent"),
        (np.full(48000, 1e-4, np.float32), 24000, "silent"),
    ],
)
def test_unusable_reference_audio_is_refused_with_its_reason(audio: np.ndarray, rate: int, reason: str) -> None:
    with pytest.raises(ReferenceAudioError) as refused:
        prepare_reference_audio(audio, rate)
    assert refused.value.reason == reason
    assert isinstance(refused.value, ValueError) and str(refused.value)


def _file_bytes(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    import io

    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", "PCM_16")])
def test_audio_files_decode_at_their_own_rate(fmt: str, subtype: str) -> None:
    stereo = np.stack([speech_like(1.5, 22050, 1), speech_like(1.5, 22050, 2)], axis=1)
    samples, rate = decode_reference_audio(_file_bytes(stereo, 22050, fmt, subtype))
    assert rate == 22050 and samples.shape == stereo.shape and samples.dtype == np.float32
    np.testing.assert_allclose(samples, stereo, atol=1 / 32768 if subtype == "PCM_16" else 0)
    assert prepare_reference_audio(samples, rate).size == math.ceil(stereo.shape[0] * (24000 / 22050))


def test_undecodable_empty_and_overlong_files_are_refused() -> None:
    with pytest.raises(ReferenceAudioError) as refused:
        decode_reference_audio(b"RIFF0000WAVEnot really a wave file" * 8)
    assert refused.value.reason == "undecodable"
    with pytest.raises(ReferenceAudioError) as refused:
        decode_reference_audio(b"")
    assert refused.value.reason == "empty"
    with pytest.raises(ReferenceAudioError) as refused:
        decode_reference_audio(_file_bytes(speech_like(3.0, 8000), 8000), ReferenceLimits(max_seconds=2.0))
    assert refused.value.reason == "too_long"


def test_the_error_keeps_its_reason_through_pickling() -> None:
    """Ray hands a replica's exception to its caller pickled: the reason and message must survive."""
    import pickle

    with pytest.raises(ReferenceAudioError) as refused:
        prepare_reference_audio(speech_like(0.2, 24000), 24000)
    copy = pickle.loads(pickle.dumps(refused.value))
    assert type(copy) is ReferenceAudioError and copy.reason == "too_short" and str(copy) == str(refused.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples_are_refused(bad: float) -> None:
    audio = speech_like(2.0, 24000)
    audio[1234] = bad
    with pytest.raises(ReferenceAudioError) as refused:
        prepare_reference_audio(audio, 24000)
    assert refused.value.reason == "non_finite"


def test_limits_are_configurable() -> None:
    clip = speech_like(2.0, 24000)
    with pytest.raises(ReferenceAudioError, match="at most 1.5 s"):
        prepare_reference_audio(clip, 24000, ReferenceLimits(max_seconds=1.5))
    with pytest.raises(ReferenceAudioError, match="at least 3 s"):
        prepare_reference_audio(clip, 24000, ReferenceLimits(min_seconds=3.0))
    quiet = 0.01 * clip / np.abs(clip).max()
    assert prepare_reference_audio(quiet, 24000).size == clip.size
    with pytest.raises(ReferenceAudioError):
        prepare_reference_audio(quiet, 24000, ReferenceLimits(silence_peak=0.02))


def test_channels_are_averaged_and_integer_pcm_is_scaled() -> None:
    left, right = speech_like(1.5, 24000, seed=1), speech_like(1.5, 24000, seed=2)
    stereo = np.stack([left, right], axis=1)
    np.testing.assert_allclose(prepare_reference_audio(stereo, 24000), (left + right) / 2, atol=1e-7)
    pcm16 = np.round(left * 32767).astype(np.int16)
    np.testing.assert_allclose(prepare_reference_audio(pcm16, 24000), pcm16 / 32768.0, atol=1e-7)
    pcm16_stereo = np.round(stereo * 32767).astype(np.int16)
    np.testing.assert_allclose(prepare_reference_audio(pcm16_stereo, 24000), pcm16_stereo.mean(axis=1) / 32768.0, atol=1e-7)
    as_tensor = prepare_reference_audio(torch.from_numpy(left), 24000)
    np.testing.assert_array_equal(as_tensor, left)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_resampling_reaches_24k_at_the_official_length_and_keeps_a_tone(rate: int) -> None:
    seconds, tone = 1.3, 440.0
    samples = (0.5 * np.sin(2 * np.pi * tone * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
    out = resample_to_reference_rate(samples, rate)
    assert out.dtype == np.float32
    # The official length is ceil(N × (24000 / rate)) in floating point: 28665 samples at 22.05 kHz give 31201.
    assert out.size == math.ceil(samples.size * (REFERENCE_SAMPLE_RATE / rate))
    spectrum = np.abs(np.fft.rfft(out[2400:-2400] * np.hanning(out.size - 4800)))
    peak_hz = np.argmax(spectrum) * REFERENCE_SAMPLE_RATE / (out.size - 4800)
    assert abs(peak_hz - tone) < 5.0


# ---------------------------------------------------------------------------------------------------------------------
# Mel front end
# ---------------------------------------------------------------------------------------------------------------------


def test_mel_filters_are_unit_area_triangles_in_increasing_order() -> None:
    filters = slaney_mel_filters(24000, 1024, 128, 0.0, 12000.0)
    assert filters.shape == (128, 513) and filters.dtype == np.float32 and (filters >= 0).all()
    bin_hz = 24000 / 1024
    areas = filters.sum(axis=1) * bin_hz
    np.testing.assert_allclose(areas[80:], 1.0, rtol=0.02)  # wide triangles sample close to their unit analytic area
    peaks = filters.argmax(axis=1)
    assert (np.diff(peaks) >= 0).all() and peaks[-1] > peaks[0]


def test_log_mel_frame_count_and_a_tone_lights_its_band() -> None:
    rate, tone = 24000, 1000.0
    wave = torch.from_numpy((0.5 * np.sin(2 * np.pi * tone * np.arange(rate) / rate)).astype(np.float32))
    mels = log_mel_spectrogram(wave.unsqueeze(0))
    assert mels.shape == (1, (rate - MEL_HOP) // MEL_HOP + 1, 128)
    filters = slaney_mel_filters(24000, 1024, 128, 0.0, 12000.0)
    expected_band = int(filters[:, round(tone / (rate / 1024))].argmax())
    assert int(mels[0].mean(dim=0).argmax()) == expected_band
    assert float(mels.min()) >= math.log(1e-5) - 1e-6


# ---------------------------------------------------------------------------------------------------------------------
# Codes and x-vectors
# ---------------------------------------------------------------------------------------------------------------------


def test_codes_shape_range_and_x_vector_size(encoder: ReferenceEncoder) -> None:
    clip = speech_like(3.0, 24000)
    out = encoder.encode(clip, 24000)
    assert out.codes is not None and out.codes.dtype == torch.int64
    assert out.codes.shape == (math.ceil(clip.size / 1920), 16)
    assert int(out.codes.min()) >= 0 and int(out.codes.max()) < 2048
    assert out.x_vector.shape == (encoder.x_vector_dim,) and torch.isfinite(out.x_vector).all()
    assert out.seconds == pytest.approx(3.0)
    assert len(set(out.codes[:, 0].tolist())) > 1, "random tiny weights should still give varied codes"


def test_x_vector_only_skips_the_codes_and_gives_the_same_x_vector(encoder: ReferenceEncoder) -> None:
    clip = speech_like(2.0, 16000, seed=3)
    both = encoder.encode(clip, 16000)
    only = encoder.encode(clip, 16000, x_vector_only=True)
    assert only.codes is None
    torch.testing.assert_close(only.x_vector, both.x_vector, rtol=0, atol=0)
    xvec_only = ReferenceEncoder(encoder.speaker_encoder, None)
    assert xvec_only.encode(clip, 16000, x_vector_only=True).codes is None
    with pytest.raises(RuntimeError):
        xvec_only.encode(clip, 16000)


def test_a_batch_equals_one_clip_at_a_time(encoder: ReferenceEncoder) -> None:
    """Lengths that are not whole frames, two of them equal (they share a pass), one x-vector-only."""
    clips = [(speech_like(1.23, 24000, 4), 24000), (speech_like(3.71, 24000, 5), 24000),
             (speech_like(1.23, 24000, 9), 24000), (speech_like(2.1, 16000, 6), 16000)]
    batch = encoder.encode_batch(clips, x_vector_only=[False, False, False, True])
    assert batch[3].codes is None
    for (audio, rate), together in zip(clips, batch):
        alone = encoder.encode(audio, rate)
        torch.testing.assert_close(together.x_vector, alone.x_vector, rtol=0, atol=0)
        if together.codes is not None:
            assert torch.equal(together.codes, alone.codes)


def test_codes_are_causal(encoder: ReferenceEncoder) -> None:
    """A clip's first k frames depend only on its first k × 1920 samples."""
    clip = speech_like(4.0, 24000, seed=7)
    prefix_frames = 20
    whole = encoder.reference_codes([clip])[0]
    prefix = encoder.reference_codes([clip[: prefix_frames * 1920]])[0]
    assert prefix.shape[0] == prefix_frames
    assert torch.equal(whole[:prefix_frames], prefix)
    later = clip.copy()
    later[prefix_frames * 1920 :] *= -1.0
    assert torch.equal(encoder.reference_codes([later])[0][:prefix_frames], prefix)


def test_a_different_voice_gives_a_different_x_vector(encoder: ReferenceEncoder) -> None:
    low = encoder.encode(speech_like(2.0, 24000, seed=8), 24000).x_vector
    t = np.arange(48000) / 24000
    high = (0.3 * np.sign(np.sin(2 * np.pi * 310 * t)) * (0.6 + 0.4 * np.sin(2 * np.pi * 1.3 * t))).astype(np.float32)
    other = encoder.encode(high, 24000).x_vector
    assert float(torch.nn.functional.cosine_similarity(low, other, dim=0)) < 0.999


def test_dtype_follows_the_modules_but_rotary_frequencies_stay_float32(base_checkpoint: Path) -> None:
    half = ReferenceEncoder.from_checkpoint(base_checkpoint, dtype=torch.bfloat16)
    out = half.encode(speech_like(1.5, 24000), 24000)
    assert out.x_vector.dtype == torch.bfloat16 and out.codes is not None and out.codes.dtype == torch.int64
    full = ReferenceEncoder.from_checkpoint(base_checkpoint)
    assert half.codec_encoder is not None and full.codec_encoder is not None
    half_rope = half.codec_encoder.encoder_transformer.rotary_emb.inv_freq
    assert half_rope.dtype == torch.float32
    assert torch.equal(half_rope, full.codec_encoder.encoder_transformer.rotary_emb.inv_freq)
    assert half.codec_encoder.encoder.layers[0].conv.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------------
# Parity with the official package
# ---------------------------------------------------------------------------------------------------------------------


def _parity_clips() -> list[tuple[np.ndarray, int]]:
    """24 kHz clips of 3 s and 12 s (past the 250-frame window transformers 5 would apply), and resampled ones."""
    return [
        (speech_like(3.0, 24000, seed=10), 24000),
        (speech_like(12.0, 24000, seed=11)[:-1234], 24000),
        (speech_like(2.5, 16000, seed=12), 16000),
        (speech_like(2.0, 44100, seed=13), 44100),
    ]


def _max_relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.skipif(official_venv_python() is None, reason="opt-in: the official qwen-tts venv is absent "
                    "(tests/goldens/qwen3_tts/make_venv.sh builds it, or point QWEN_TTS_VENV at one)")
@pytest.mark.parametrize(("seed", "dtype"), [(0, "float32"), (5, "float32"), (3, "bfloat16")])
def test_equal_to_the_official_package(seed: int, dtype: str, tmp_path: Path) -> None:
    checkpoint = ck.make_tiny_checkpoint(tmp_path / "base", variant="base", seed=seed)
    clips = _parity_clips() if has_soxr() else [c for c in _parity_clips() if c[1] == REFERENCE_SAMPLE_RATE]
    inputs = {f"wave_{i}": a for i, (a, _) in enumerate(clips)} | {f"rate_{i}": r for i, (_, r) in enumerate(clips)}
    np.savez(tmp_path / "in.npz", batched=0, **inputs)
    run = subprocess.run(
        [str(official_venv_python()), str(OFFICIAL_SCRIPT), str(checkpoint), str(tmp_path / "in.npz"),
         str(tmp_path / "out.npz"), dtype],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    official = np.load(tmp_path / "out.npz")
    ours = ReferenceEncoder.from_checkpoint(checkpoint, dtype=getattr(torch, dtype)).encode_batch(clips)
    for i, encoding in enumerate(ours):
        np.testing.assert_array_equal(encoding.codes.numpy(), official[f"codes_{i}"], err_msg=f"clip {i} codes")
        relative = _max_relative(encoding.x_vector.float().numpy(), official[f"x_vector_{i}"])
        assert relative <= X_VECTOR_RTOL, f"clip {i}: x-vector max relative difference {relative:.3g}"


def _golden_base_cases(seed: int) -> list[dict]:
    path = GOLDENS_DIR / f"seed{seed}" / "cases.json"
    if not path.is_file():
        pytest.skip(f"no goldens at {path} (tests/goldens/qwen3_tts/make_goldens.py writes them)")
    cases = [c for c in json.loads(path.read_text())["cases"] if c.get("variant") == "base"]
    if not cases:
        pytest.skip(f"{path} has no Base cases")
    return cases


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_to_the_goldens(seed: int, tmp_path: Path) -> None:
    """The official package's reference codes and x-vector of the Base golden cases, from the committed reference
    file's bytes (decoded as an upload is)."""
    cases = _golden_base_cases(seed)
    checkpoint = ck.make_tiny_checkpoint(tmp_path / "base", variant="base", seed=seed)
    encoder = ReferenceEncoder.from_checkpoint(checkpoint)
    for case in cases:
        audio, rate = decode_reference_audio((GOLDENS_DIR / case["reference"]["file"]).read_bytes())
        out = encoder.encode(audio, rate, x_vector_only=case["ref_codes"] is None)
        golden_x_vector = np.asarray(case["x_vector"], dtype=np.float32)
        relative = _max_relative(out.x_vector.numpy(), golden_x_vector)
        assert relative <= X_VECTOR_RTOL, f"{case['key']}: x-vector max relative difference {relative:.3g}"
        if case["ref_codes"] is not None:
            np.testing.assert_array_equal(out.codes.numpy(), np.asarray(case["ref_codes"]), err_msg=case["key"])
