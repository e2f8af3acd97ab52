"""Tests for the tiny Qwen3-TTS checkpoints: official file layout, determinism, tokenizer, official-package load."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from omni_ray.models.qwen3_tts import checkpoint as ck
from omni_ray.models.qwen3_tts.checkpoint_layout import model_layout, speech_tokenizer_layout

GOLDENS_DIR = Path(__file__).resolve().parent / "goldens" / "qwen3_tts"
OFFICIAL_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt",
    "tokenizer_config.json", "preprocessor_config.json", "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors", "speech_tokenizer/preprocessor_config.json",
)


def official_venv_python() -> Path | None:
    """The official package's venv python: ``$QWEN_TTS_VENV`` or /work/venv-qwen-tts, when it exists."""
    venv = Path(os.environ.get("QWEN_TTS_VENV", "/work/venv-qwen-tts"))
    python = venv / "bin" / "python"
    return python if python.is_file() else None


needs_official = pytest.mark.skipif(
    official_venv_python() is None,
    reason="opt-in fidelity check: the official qwen-tts venv is absent (build it with "
    "tests/goldens/qwen3_tts/make_venv.sh, or point QWEN_TTS_VENV at one)",
)


def _digest(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in OFFICIAL_FILES}


def _keys_and_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_tts")
    made = {v: ck.make_tiny_checkpoint(root / v, variant=v, seed=0) for v in ck.VARIANTS}
    made["custom_voice_again"] = ck.make_tiny_checkpoint(root / "again", variant="custom_voice", seed=0)
    made["custom_voice_seed1"] = ck.make_tiny_checkpoint(root / "seed1", variant="custom_voice", seed=1)
    made["custom_voice_0b6"] = ck.make_tiny_checkpoint(root / "small", variant="custom_voice", seed=0, size="0b6")
    return made


def test_official_file_layout(ckpts: dict[str, Path]) -> None:
    for variant in ck.VARIANTS:
        missing = [name for name in OFFICIAL_FILES if not (ckpts[variant] / name).is_file()]
        assert missing == [], f"{variant} lacks {missing}"
        config = ck.read_config(ckpts[variant])
        assert config["model_type"] == "qwen3_tts" and config["tts_model_type"] == variant
        assert config["tokenizer_type"] == "qwen3_tts_tokenizer_12hz"


def test_deterministic_per_seed_and_different_across_seeds(ckpts: dict[str, Path]) -> None:
    assert _digest(ckpts["custom_voice"]) == _digest(ckpts["custom_voice_again"])
    other = _digest(ckpts["custom_voice_seed1"])
    same = _digest(ckpts["custom_voice"])
    assert other["model.safetensors"] != same["model.safetensors"]
    assert other["speech_tokenizer/model.safetensors"] != same["speech_tokenizer/model.safetensors"]
    assert other["config.json"] == same["config.json"]  # the seed changes weights only


def test_weights_match_the_layout_the_config_implies(ckpts: dict[str, Path]) -> None:
    for name in (*ck.VARIANTS, "custom_voice_0b6"):
        directory = ckpts[name]
        config = ck.read_config(directory)
        expected = {k: spec.shape for k, spec in model_layout(config).items()}
        assert _keys_and_shapes(directory / "model.safetensors") == expected
        speech = json.loads((directory / "speech_tokenizer/config.json").read_text())
        expected_speech = {k: spec.shape for k, spec in speech_tokenizer_layout(speech).items()}
        assert _keys_and_shapes(directory / "speech_tokenizer/model.safetensors") == expected_speech


def test_variant_and_size_specific_weights(ckpts: dict[str, Path]) -> None:
    keys = {name: set(_keys_and_shapes(ckpts[name] / "model.safetensors")) for name in ckpts}
    assert any(k.startswith("speaker_encoder.") for k in keys["base"])
    assert not any(k.startswith("speaker_encoder.") for k in keys["custom_voice"] | keys["voice_design"])
    projection = "talker.code_predictor.small_to_mtp_projection.weight"
    assert projection in keys["custom_voice"] and projection not in keys["custom_voice_0b6"]
    assert ck.read_config(ckpts["custom_voice_0b6"])["tts_model_size"] == "0b6"


def test_official_codec_ids_and_speakers(ckpts: dict[str, Path]) -> None:
    talker = ck.read_config(ckpts["custom_voice"])["talker_config"]
    assert (talker["vocab_size"], talker["num_code_groups"]) == (3072, 16)
    assert talker["code_predictor_config"]["vocab_size"] == 2048
    assert (talker["codec_bos_id"], talker["codec_eos_token_id"], talker["codec_pad_id"]) == (2149, 2150, 2148)
    assert talker["codec_language_id"]["english"] == 2050 and talker["spk_id"]["ryan"] == 3061
    assert talker["spk_is_dialect"]["eric"] == "sichuan_dialect"
    assert ck.read_config(ckpts["base"])["talker_config"]["spk_id"] == {}
    speaker_encoder = ck.read_config(ckpts["base"])["speaker_encoder_config"]
    assert speaker_encoder["enc_dim"] == talker["hidden_size"]  # the x-vector enters the Talker's input


def test_tokenizer_special_ids_and_prompt_slicing(ckpts: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    directory = ckpts["custom_voice"]
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    config = ck.read_config(directory)
    for field, token in (("tts_pad_token_id", "<tts_pad>"), ("tts_bos_token_id", "<tts_text_bos>"),
                         ("tts_eos_token_id", "<tts_text_eod>"), ("im_start_token_id", "<|im_start|>"),
                         ("im_end_token_id", "<|im_end|>")):
        assert tokenizer.convert_tokens_to_ids(token) == config[field]
    ids = tokenizer.encode("<|im_start|>assistant\nHello there.<|im_end|>\n<|im_start|>assistant\n")
    text = tokenizer.encode("Hello there.")
    assert ids[:1] == [config["im_start_token_id"]] and ids[3:-5] == text  # role [:3], body [3:-5]
    assert ids[-5:] == ids[-5:-3] + ids[:3] and ids[-5] == config["im_end_token_id"]
    vocab = config["talker_config"]["text_vocab_size"]
    assert len(tokenizer) <= vocab and vocab % 64 == 0


def test_ensure_tiny_checkpoint_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_RAY_CACHE", str(tmp_path))
    first = ck.ensure_tiny_checkpoint("voice_design", seed=3)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ck.ensure_tiny_checkpoint("voice_design", seed=3) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.parent == tmp_path and "voice_design" in first.name and "seed3" in first.name


def test_make_tiny_cli(tmp_path: Path) -> None:
    from omni_ray.cli import build_parser

    args = build_parser().parse_args(
        ["make-tiny", "--family", "qwen3_tts", "--variant", "base", "--seed", "2", "--out", str(tmp_path / "b")]
    )
    assert args.func(args) == 0
    assert ck.read_config(tmp_path / "b")["tts_model_type"] == "base"
    assert json.loads((tmp_path / "b" / ck.MARKER_FILE).read_text())["seed"] == 2


@needs_official
def test_official_package_loads_every_variant(ckpts: dict[str, Path]) -> None:
    """No missing, unexpected or mismatched keys, and every loaded value is the file's (nothing re-initialised)."""
    python = official_venv_python()
    names = (*ck.VARIANTS, "custom_voice_0b6")
    run = subprocess.run(
        [str(python), str(GOLDENS_DIR / "check_official_load.py"), *(str(ckpts[n]) for n in names)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for name in names:
        entry = report[str(ckpts[name])]
        assert entry["model"] == {} and entry["speech_tokenizer"] == {}, (name, entry)
        assert entry["model_values"] == [] and entry["speech_tokenizer_values"] == [], (name, entry)
        assert entry["tts_model_type"] == ck.read_config(ckpts[name])["tts_model_type"]


def _golden(seed: int) -> dict:
    return json.loads((GOLDENS_DIR / f"seed{seed}" / "cases.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("seed", [0, 1])
def test_committed_goldens_are_well_formed(seed: int) -> None:
    from safetensors.torch import load_file

    document = _golden(seed)
    waves = load_file(str(GOLDENS_DIR / f"seed{seed}" / "waveforms.safetensors"))
    keys = [case["key"] for case in document["cases"]]
    assert sorted(keys) == sorted(waves) and len(set(keys)) == len(keys)
    forms = {(case["name"], case["non_streaming_mode"]) for case in document["cases"]}
    assert forms == {(name, mode) for name, _ in forms for mode in (False, True)}  # every prompt form
    for case in document["cases"]:
        codes, wave = case["codes"], waves[case["key"]]
        assert len(codes) >= 8 and all(len(frame) == 16 for frame in codes), case["key"]
        assert all(0 <= code < 2048 for frame in codes for code in frame), case["key"]
        assert len({frame[0] for frame in codes}) > len(codes) // 2, case["key"]  # codes vary frame to frame
        assert wave.shape == (len(codes) * document["samples_per_frame"],), case["key"]
        assert 0.01 < float(wave.pow(2).mean().sqrt()) and float(wave.abs().max()) < 0.99, case["key"]


@pytest.mark.parametrize("seed", [0, 1])
def test_our_tokenizer_and_ids_give_the_goldens_prompt_ids(seed: int, ckpts: dict[str, Path]) -> None:
    """Our transformers reads the tiny tokenizer as the official package's did, and the prompts' special text ids
    are the ones our config names."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ckpts["custom_voice"]))
    config = ck.read_config(ckpts["custom_voice"])
    for case in _golden(seed)["cases"]:
        assert case["input_ids"] == tokenizer.encode(f"<|im_start|>assistant\n{case['text']}<|im_end|>\n"
                                                     "<|im_start|>assistant\n")
        if case.get("instruct"):
            assert case["instruct_ids"] == tokenizer.encode(f"<|im_start|>user\n{case['instruct']}<|im_end|>\n")
        if case.get("ref_ids"):
            assert case["ref_ids"] == tokenizer.encode(f"<|im_start|>assistant\n{case['ref_text']}<|im_end|>\n")
        texts = [p["text"] for p in case["prompt"] if "codec" in p or "x_vector" in p]
        assert config["tts_pad_token_id"] in texts + case["trailing_text"]
        if not case["non_streaming_mode"] and case["trailing_text"] != [config["tts_pad_token_id"]]:
            assert case["trailing_text"][-1] == config["tts_eos_token_id"]


@needs_official
@pytest.mark.parametrize("seed", [0, 1])
def test_goldens_script_reproduces_the_committed_goldens(seed: int, tmp_path: Path) -> None:
    """Rerun the official package on freshly made tiny checkpoints: the same codes, ids, layouts and waveforms."""
    import sys

    import torch
    from safetensors.torch import load_file

    run = subprocess.run(
        [str(official_venv_python()), str(GOLDENS_DIR / "make_goldens.py"), "--seed", str(seed),
         "--out", str(tmp_path), "--project-python", sys.executable],
        capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    fresh = json.loads((tmp_path / "cases.json").read_text(encoding="utf-8"))
    committed = _golden(seed)
    assert [c["key"] for c in fresh["cases"]] == [c["key"] for c in committed["cases"]]
    for new, old in zip(fresh["cases"], committed["cases"]):
        for field in ("codes", "input_ids", "instruct_ids", "ref_ids", "prompt", "trailing_text", "ref_codes",
                      "finish_reason", "ref_cut_samples"):
            assert new.get(field) == old.get(field), (new["key"], field)
        if old.get("x_vector") is not None:
            assert torch.allclose(torch.tensor(new["x_vector"]), torch.tensor(old["x_vector"]), atol=1e-5)
    new_waves = load_file(str(tmp_path / "waveforms.safetensors"))
    old_waves = load_file(str(GOLDENS_DIR / f"seed{seed}" / "waveforms.safetensors"))
    for key, wave in old_waves.items():
        assert torch.allclose(new_waves[key], wave, atol=1e-5), key


CONFIGS_DIR = Path(ck.__file__).resolve().parent / "configs"
FULL_SIZE = {  # (file stem, millions of parameters the layout implies; the totals the official classes give)
    "qwen3_tts_12hz_0b6_base": 914.6, "qwen3_tts_12hz_0b6_custom_voice": 905.8, "qwen3_tts_12hz_1b7_base": 1928.7,
    "qwen3_tts_12hz_1b7_custom_voice": 1916.7, "qwen3_tts_12hz_1b7_voice_design": 1916.7,
}


def test_full_size_configs_are_consistent() -> None:
    import math

    for stem, millions in FULL_SIZE.items():
        config = json.loads((CONFIGS_DIR / f"{stem}.json").read_text())
        size, variant = config["tts_model_size"], config["tts_model_type"]
        assert stem == f"qwen3_tts_12hz_{size}_{variant}"
        talker = config["talker_config"]
        assert (talker["hidden_size"], talker["intermediate_size"]) == ({"0b6": (1024, 3072), "1b7": (2048, 6144)}[size])
        assert ("speaker_encoder_config" in config) == (variant == "base")
        total = sum(math.prod(spec.shape) for spec in model_layout(config).values()) / 1e6
        assert round(total, 1) == millions, stem
    speech = json.loads((CONFIGS_DIR / "speech_tokenizer_12hz.json").read_text())
    layout = speech_tokenizer_layout(speech)
    encoder = sum(math.prod(s.shape) for k, s in layout.items() if k.startswith("encoder.")) / 1e6
    decoder = sum(math.prod(s.shape) for k, s in layout.items() if k.startswith("decoder.")) / 1e6
    assert (round(encoder, 1), round(decoder, 1)) == (56.2, 114.3)


@needs_official
def test_full_size_layouts_equal_the_official_state_dicts() -> None:
    paths = sorted(str(p) for p in CONFIGS_DIR.glob("*.json"))
    run = subprocess.run([str(official_venv_python()), str(GOLDENS_DIR / "official_keys.py"), *paths],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    official = json.loads(run.stdout.strip().splitlines()[-1])
    for path, keys in official.items():
        config = json.loads(Path(path).read_text())
        layout = model_layout(config) if config["model_type"] == "qwen3_tts" else speech_tokenizer_layout(config)
        assert {k: list(spec.shape) for k, spec in layout.items()} == keys, path
