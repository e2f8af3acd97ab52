"""S2 Pro's codec against the official code (goldens of fish-speech 3dd1f85's modified DAC on the tiny codecs, seeds
0 and 1): the loader on the official `codec.pth` layout, the reference clip's codes, the one-shot waveform of a code
matrix with out-of-range codes, and the shared streaming decoder on it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch

from omni_ray.audio import resample
from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint, write_tiny_codec
from omni_ray.models.s2_pro.codec import (CODEC_CONFIG_FILE, CODEC_FILE, CodecConfig, S2ProCodec, load_codec,
                                          official_codec_layout)
from omni_ray.models.s2_pro.dual_ar_model import S2ProConfig
from omni_ray.vocoder.schedule import ChunkSchedule
from omni_ray.vocoder.streaming import Codec, StreamingDecoder, measure_trim

GOLDENS = Path(__file__).parent / "goldens" / "s2_pro"
REFERENCE_WAV = Path(__file__).parent / "goldens" / "qwen3_tts" / "reference.wav"
SEEDS = (0, 1)


@lru_cache(maxsize=None)
def golden(seed: int) -> dict[str, Any]:
    with np.load(GOLDENS / f"codec_seed{seed}.npz") as data:
        return {"meta": json.loads(str(data["meta"])), **{k: torch.from_numpy(data[k]) for k in data.files if k != "meta"}}


def reference_audio() -> np.ndarray:
    """The goldens' reference clip: reference.wav (24 kHz) in mono, resampled to 44.1 kHz (make_codec_goldens.py
    has the project's python do the same)."""
    audio, rate = sf.read(str(REFERENCE_WAV), dtype="float32", always_2d=True)
    return resample(audio.mean(axis=1), rate, 44100).astype(np.float32)


@pytest.fixture(scope="module")
def codec_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("s2_pro_codec")
    for seed in SEEDS:
        write_tiny_codec(root / f"seed{seed}", seed)
    return {seed: root / f"seed{seed}" for seed in SEEDS}


@pytest.fixture(scope="module")
def codecs(codec_dirs: dict[int, Path]) -> dict[int, S2ProCodec]:
    return {seed: load_codec(directory) for seed, directory in codec_dirs.items()}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_tiny_codec_and_clip_are_the_ones_the_goldens_were_made_on(codec_dirs: dict[int, Path], seed: int) -> None:
    meta = golden(seed)["meta"]
    for name in (CODEC_FILE, CODEC_CONFIG_FILE):
        assert hashlib.sha256((codec_dirs[seed] / name).read_bytes()).hexdigest() == meta["checkpoint_sha256"][name]
    assert hashlib.sha256(reference_audio().tobytes()).hexdigest() == meta["reference_audio_sha256"]


@pytest.mark.parametrize("seed", SEEDS)
def test_encode_gives_the_official_codes(codecs: dict[int, S2ProCodec], seed: int) -> None:
    codes = codecs[seed].encode(torch.from_numpy(reference_audio()))
    assert codes.shape == (10, -(-golden(seed)["meta"]["reference_samples"] // 2048))
    assert torch.equal(codes, golden(seed)["reference_codes"])


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_gives_the_official_waveform_and_leaves_the_callers_codes(codecs: dict[int, S2ProCodec],
                                                                         seed: int) -> None:
    codes = golden(seed)["fixed_codes"].clone()
    config = codecs[seed].config
    assert (codes[0] >= config.semantic_codebook_size).any() and (codes[1:] >= config.codebook_size).any()  # the
    # clamp has work to do
    waveform = codecs[seed].decode(codes)
    assert waveform.shape == (codes.shape[1] * 2048,)
    torch.testing.assert_close(waveform, golden(seed)["waveform"], rtol=0, atol=1e-4)
    assert torch.equal(codes, golden(seed)["fixed_codes"])


def test_a_tiny_checkpoints_codec_encodes_references_into_its_dual_ars_codebooks(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path, 0)
    config, codec = S2ProConfig.from_checkpoint(tmp_path), load_codec(tmp_path)
    assert (codec.config.semantic_codebook_size == config.codebook_size
            == config.semantic_end - config.semantic_begin + 1)  # every semantic code has its token
    assert codec.config.codebook_size <= config.codebook_size  # the fast AR's vocabulary, shared by all codebooks
    noise = torch.randn(20 * 2048, generator=torch.Generator().manual_seed(0))
    for audio in (torch.from_numpy(reference_audio()), noise):
        codes = codec.encode(audio)
        assert codes.shape[0] == config.num_codebooks and codes.min() >= 0 and codes.max() < config.codebook_size
        assert torch.equal(codec.clamped(codes), codes)


@pytest.mark.parametrize("seed", SEEDS)
def test_streaming_with_full_left_context_equals_the_one_shot_decode(codecs: dict[int, S2ProCodec], seed: int) -> None:
    codec = codecs[seed]
    codes = golden(seed)["fixed_codes"]
    assert isinstance(codec, Codec) and measure_trim(codec) == 0
    assert (codec.num_quantizers, codec.samples_per_frame, codec.sample_rate) == (10, 2048, 44100)
    decoder = StreamingDecoder(codec, ChunkSchedule(left_context=codes.shape[1]))
    chunks = []
    for frame in range(codes.shape[1]):
        chunks += decoder.push(codes[:, frame : frame + 1])
    last = decoder.finish()
    streamed = torch.cat(chunks + ([last] if last is not None else []))
    assert len(chunks) >= 4  # the ramp's chunks and steady ones, each decoded as a window of its own
    torch.testing.assert_close(streamed, codec.decode(codes), rtol=0, atol=1e-4)


def test_the_loader_folds_either_weight_norm_form_and_drops_what_is_not_the_generators(
        codec_dirs: dict[int, Path], codecs: dict[int, S2ProCodec], tmp_path: Path) -> None:
    stored = torch.load(codec_dirs[0] / CODEC_FILE)
    variant: dict[str, torch.Tensor] = {}
    for key, value in stored.items():  # the parametrized weight norms in the older weight_g/weight_v form
        key = key.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v")
        variant[key] = value
    variant["generator.quantizer.post_module.causal_mask"] = torch.ones(4, 4, dtype=torch.bool)
    variant["generator.quantizer.pre_module.freqs_cis"] = torch.zeros(4, 8, 2)
    variant["discriminator.conv.weight"] = torch.zeros(1)
    torch.save({"state_dict": variant}, tmp_path / CODEC_FILE)
    (tmp_path / CODEC_CONFIG_FILE).write_bytes((codec_dirs[0] / CODEC_CONFIG_FILE).read_bytes())
    loaded = load_codec(tmp_path)
    expected = codecs[0].state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())

    del variant["generator.decoder.model.0.conv.weight_g"]
    torch.save({"state_dict": variant}, tmp_path / CODEC_FILE)
    with pytest.raises(KeyError, match="decoder.model.0.conv"):
        load_codec(tmp_path)


def test_the_released_codecs_tensors_are_the_official_configs() -> None:
    official = json.loads((GOLDENS / "codec_layout_full.json").read_text())
    assert {key: list(shape) for key, (_, shape) in official_codec_layout(CodecConfig()).items()} == official
    with torch.device("meta"):
        codec = S2ProCodec(CodecConfig())
    assert sum(p.numel() for p in codec.parameters()) == 391_398_385  # weight norms folded: one tensor each
    assert codec.decode(torch.zeros(10, 3, dtype=torch.long, device="meta")).shape == (3 * 2048,)


def _official() -> tuple[Path, Path] | None:
    """The official code's venv python and source: ``$FISH_SPEECH_VENV`` (or /work/venv-fish-speech) and
    ``$FISH_SPEECH_SRC`` (or /work/fish-speech-src), when both exist (tests/goldens/s2_pro/make_venv.sh builds them)."""
    python = Path(os.environ.get("FISH_SPEECH_VENV", "/work/venv-fish-speech")) / "bin" / "python"
    source = Path(os.environ.get("FISH_SPEECH_SRC", "/work/fish-speech-src"))
    return (python, source) if python.is_file() and (source / "fish_speech" / "models" / "dac").is_dir() else None


@pytest.mark.skipif(_official() is None, reason="opt-in fidelity check: the official fish-speech venv and source are "
                    "absent (tests/goldens/s2_pro/make_venv.sh builds them)")
def test_the_official_codec_still_writes_the_committed_goldens(tmp_path: Path) -> None:
    official = _official()
    assert official is not None
    python, source = official
    out = tmp_path / "codec_seed0.npz"
    subprocess.run([str(python), str(GOLDENS / "make_codec_goldens.py"), "--seed", "0", "--out", str(out),
                    "--project-python", sys.executable], check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(source)}, capture_output=True)
    assert out.read_bytes() == (GOLDENS / "codec_seed0.npz").read_bytes()
    layout = tmp_path / "codec_layout_full.json"
    subprocess.run([str(python), str(GOLDENS / "make_codec_goldens.py"), "--full-layout", str(layout)], check=True,
                   timeout=600, env={**os.environ, "PYTHONPATH": str(source)}, capture_output=True)
    assert layout.read_bytes() == (GOLDENS / "codec_layout_full.json").read_bytes()
