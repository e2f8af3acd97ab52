"""Tests for the deterministic tiny Qwen3-Omni checkpoint and its tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from omni_ray.models.qwen3_omni import checkpoint as ck
from omni_ray.tiny_checkpoints import BPE_VOCAB_SIZE

AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_omni")
    return {
        "a": ck.make_tiny_checkpoint(root / "seed0_a", seed=0),
        "b": ck.make_tiny_checkpoint(root / "seed0_b", seed=0),
        "c": ck.make_tiny_checkpoint(root / "seed1", seed=1),
    }


@pytest.fixture(scope="module")
def tokenizer(ckpts: dict[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpts["a"]))


@pytest.fixture(scope="module")
def model(ckpts: dict[str, Path]):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    m, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(ckpts["a"]), output_loading_info=True)
    return m.eval(), info


# ---------------------------------------------------------------- determinism


def test_same_seed_identical_files(ckpts: dict[str, Path]) -> None:
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha256(ckpts["a"] / name) == _sha256(ckpts["b"] / name), name


# sha256 of the seed-0 checkpoint's content. Weights: every tensor's key, dtype, shape and bytes, in key order (the
# content, whatever safetensors' header layout). Other files: their bytes; the saved configs carry no
# transformers_version stamp, so they too are the same bytes under every supported transformers release.
GOLDEN_SEED0: dict[str, str] = {
    "weights": "7437b2d10e971cc9028461ba64bfc41b02f5424665b255d046efe9c16287709b",
    "config.json": "5668e67d0e107a4bcac42f89e27f1225ca1229fa53dd8049976edfaf9ee65a51",
    "generation_config.json": "f96e25e0124ba8afb0b42ce82835c868fd6d5c35a980318a0d4a5d2b39b99205",
    "tokenizer.json": "e08b38897a68e2afcb0658c9a4de1a4c8694f5cbff1fef0cf2a7595d3991458d",
    "tokenizer_config.json": "afd4293783372cf7d73db0f80541943b6fdfd6dfc8abde658f037abcd389f97d",
    "preprocessor_config.json": "30cb5d84c7c3255f9137f89f04723740dddcfe34430b895ebb1150925b4caa07",
}


def _content_hashes(d: Path) -> dict[str, str]:
    weights = hashlib.sha256()
    with safe_open(str(d / ck.WEIGHTS_FILE), "pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            weights.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
            weights.update(t.numpy().tobytes())
    return {"weights": weights.hexdigest(), **{name: _sha256(d / name) for name in GOLDEN_SEED0 if name != "weights"}}


def test_checkpoint_matches_golden_hash(ckpts: dict[str, Path]) -> None:
    """The seed-0 checkpoint is the same content under every supported transformers release: each tensor is drawn
    from its checkpoint key (the official on-disk layout), not from transformers' in-memory module names, which
    differ between releases. A change here changes every cached tiny checkpoint: bump ck.TINY_FORMAT with it."""
    assert _content_hashes(ckpts["a"]) == GOLDEN_SEED0


def test_different_seed_different_weights(ckpts: dict[str, Path]) -> None:
    assert _sha256(ckpts["a"] / "model.safetensors") != _sha256(ckpts["c"] / "model.safetensors")
    assert _sha256(ckpts["a"] / "tokenizer.json") == _sha256(ckpts["c"] / "tokenizer.json")


def test_directory_contents(ckpts: dict[str, Path]) -> None:
    d = ckpts["a"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json"):
        assert (d / name).is_file(), name
    assert not list(d.parent.glob(".*tmp-*")), "temporary build dirs left behind"
    fe = json.loads((d / "preprocessor_config.json").read_text())
    assert fe["feature_extractor_type"] == "WhisperFeatureExtractor"
    assert (fe["feature_size"], fe["sampling_rate"], fe["hop_length"], fe["n_fft"], fe["chunk_length"]) == (
        128, 16000, 160, 400, 300)
    assert fe["padding_value"] == 0.0 and fe["return_attention_mask"] is True
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "<|audio_pad|>" in cfg["chat_template"]


def test_moe_keys_use_per_expert_layout(ckpts: dict[str, Path]) -> None:
    with safe_open(str(ckpts["a"] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    for k in (
        "thinker.model.layers.0.mlp.experts.7.gate_proj.weight",
        "thinker.model.layers.2.mlp.experts.0.down_proj.weight",
        "thinker.model.layers.0.mlp.gate.weight",
        "talker.model.layers.1.mlp.experts.3.up_proj.weight",
        "talker.model.layers.0.mlp.shared_expert.gate_proj.weight",
        "talker.model.layers.0.mlp.shared_expert_gate.weight",
        "talker.code_predictor.lm_head.14.weight",
        "talker.code_predictor.model.codec_embedding.14.weight",
        "code2wav.code_embedding.weight",
    ):
        assert k in keys, k
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_basics(tokenizer) -> None:
    assert type(tokenizer).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert len(tokenizer) == BPE_VOCAB_SIZE + len(ck.SPECIAL_TOKENS)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for text in ("Hello, world! It's 3:15 p.m. on 2024-02-29.", "Café déjà vu — naïve 🙂\n\tTabs  and  spaces.",
                 "user: What is 7 times 8?\nassistant: 56."):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_special_tokens_single_ids(tokenizer) -> None:
    seen = set()
    for tok in ck.SPECIAL_TOKENS:
        ids = tokenizer.encode(tok, add_special_tokens=False)
        assert ids == [tokenizer.convert_tokens_to_ids(tok)], tok
        assert ids[0] >= BPE_VOCAB_SIZE
        seen.add(ids[0])
    assert len(seen) == len(ck.SPECIAL_TOKENS)
    im_start, nl = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.encode("\n")
    for role in ck.ROLE_WORDS:
        ids = tokenizer.encode(f"<|im_start|>{role}\n", add_special_tokens=False)
        assert len(ids) == 2 + len(nl) and ids[0] == im_start, role


def test_chat_template_text(tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there!<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(msgs[1:], tokenize=False) == "<|im_start|>user\nHello there!<|im_end|>\n"


@pytest.mark.parametrize("part", [
    {"type": "audio", "audio": "clip.wav"},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "audio_url", "audio_url": {"url": "http://example.invalid/a.wav"}},
])
def test_chat_template_audio(tokenizer, part: dict) -> None:
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out == f"<|im_start|>user\n{AUDIO}What is this?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|audio_pad|>")) == 1


# ---------------------------------------------------------------- config + model


def test_config_token_ids_match_tokenizer(model, tokenizer) -> None:
    cfg = model[0].config
    tid = tokenizer.convert_tokens_to_ids
    assert (cfg.im_start_token_id, cfg.im_end_token_id) == (tid("<|im_start|>"), tid("<|im_end|>"))
    assert (cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id) == (
        tid("<tts_pad>"), tid("<tts_text_bos>"), tid("<tts_text_eod>"))
    for role in ck.ROLE_WORDS:
        assert getattr(cfg, f"{role}_token_id") == tokenizer.encode(role, add_special_tokens=False)[0]
    for sub in (cfg.thinker_config, cfg.talker_config):
        assert sub.audio_token_id == tid("<|audio_pad|>")
        assert sub.audio_start_token_id == tid("<|audio_start|>")
        assert sub.image_token_id == tid("<|image_pad|>") and sub.video_token_id == tid("<|video_pad|>")
        assert sub.vision_start_token_id == tid("<|vision_start|>")
    assert cfg.thinker_config.user_token_id == cfg.user_token_id
    assert cfg.thinker_config.text_config.vocab_size % 64 == 0
    assert cfg.thinker_config.text_config.vocab_size >= len(tokenizer)
    assert cfg.talker_config.text_config.num_experts == 4
    assert cfg.code2wav_config.upsample_rates == [8, 5, 4, 3]


def test_loads_without_missing_or_unexpected_keys(model) -> None:
    m, info = model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert m.dtype == torch.float32


def test_generate_end_to_end(model, tokenizer) -> None:
    m, _ = model
    msgs = [{"role": "user", "content": "Hello there! How are you today?"}]
    input_ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        seq, wav = m.generate(input_ids, thinker_max_new_tokens=8, talker_max_new_tokens=6,
                              thinker_eos_token_id=im_end, speaker="ethan",
                              thinker_do_sample=False, talker_do_sample=False)
    new = seq[0, input_ids.shape[1]:].tolist()
    assert 1 <= len(new) <= 8
    assert len(set(new)) > 1, f"degenerate greedy text: {new}"
    assert all(0 <= t < len(tokenizer) for t in new)
    assert isinstance(tokenizer.decode(new), str)
    assert wav.ndim == 3 and wav.shape[:2] == (1, 1) and wav.shape[-1] > 0
    assert torch.isfinite(wav).all() and wav.std() > 1e-3 and wav.abs().max() <= 1.0


def test_ensure_default_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   ckpts: dict[str, Path]) -> None:
    monkeypatch.setenv("OMNI_RAY_CACHE", str(tmp_path / "cache"))
    target = ck.default_checkpoint_dir()
    assert target == tmp_path / "cache" / f"qwen3-omni-tiny-v{ck.TINY_FORMAT}-seed0"
    first = ck.ensure_default_checkpoint()
    assert first == target
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ck.ensure_default_checkpoint() == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime
    assert _sha256(target / "model.safetensors") == _sha256(ckpts["a"] / "model.safetensors")


def test_cached_checkpoint_of_another_format_is_made_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          ckpts: dict[str, Path]) -> None:
    """A complete-looking cached checkpoint whose marker names no or another format (an older generator's output) is
    not reused: it is regenerated in place."""
    monkeypatch.setenv("OMNI_RAY_CACHE", str(tmp_path / "cache"))
    target = ck.tiny_checkpoint_dir(0)
    target.mkdir(parents=True)
    (target / ck.WEIGHTS_FILE).write_bytes(b"stale")
    for marker in ({"seed": 0}, {"format": ck.TINY_FORMAT - 1, "seed": 0}):
        (target / ck.MARKER_FILE).write_text(json.dumps(marker))
        assert ck.ensure_tiny_checkpoint(0) == target
        assert json.loads((target / ck.MARKER_FILE).read_text()) == {"format": ck.TINY_FORMAT, "seed": 0}
        assert _sha256(target / ck.WEIGHTS_FILE) == _sha256(ckpts["a"] / ck.WEIGHTS_FILE)
        (target / ck.WEIGHTS_FILE).write_bytes(b"stale")
