"""Deterministic tiny random-weight Qwen3-TTS checkpoints (Base, CustomVoice, VoiceDesign) in the official layout."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omni_ray.models.qwen3_tts.checkpoint_layout import Layout, model_layout, speech_tokenizer_layout
from omni_ray.tiny_checkpoints import (
    build_once, cache_root, param_generator, read_marker, train_byte_level_bpe, write_atomically,
)

DEFAULT_SEED: int = 0
VARIANTS: tuple[str, ...] = ("base", "custom_voice", "voice_design")
SIZES: tuple[str, ...] = ("0b6", "1b7")
DEFAULT_SIZE: str = "1b7"  # instructions apply to 1.7B CustomVoice only; VoiceDesign exists only at 1.7B
# Bumped whenever the generator's output changes, so that a cached checkpoint of an older format is made anew.
TINY_FORMAT: int = 2
WEIGHTS_FILE: str = "model.safetensors"
CONFIG_FILE: str = "config.json"
GENERATION_CONFIG_FILE: str = "generation_config.json"
SPEECH_TOKENIZER_DIR: str = "speech_tokenizer"
MARKER_FILE: str = "omni_ray_tiny.json"
INIT_STD: float = 0.02  # recorded as initializer_range (what HF init would use); the weights use fan-in init

# The official tokenizer's added tokens that Qwen3-TTS prompts use, in their official relative order; here they
# take the ids right after the BPE vocabulary and the config names those ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# Prompt slicing is by position ([:3] is "<|im_start|>assistant\n"), so these must be one token each.
SINGLE_TOKEN_WORDS: tuple[str, ...] = ("assistant", "user", "\n")

# The official ids of the codec vocabulary (3072 = 2048 codes + 1024 control / speaker / language ids).
CODEC_IDS: dict[str, int] = {
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_think_id": 2154,
    "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
}
LANGUAGE_IDS: dict[str, int] = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
    "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069, "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
SPEAKER_IDS: dict[str, int] = {
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
    "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECTS: dict[str, str | bool] = {
    **{name: False for name in SPEAKER_IDS}, "eric": "sichuan_dialect", "dylan": "beijing_dialect",
}

# The official generation_config.json of every variant: the talker's and the code predictor's sampling.
GENERATION_CONFIG: dict[str, Any] = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0, "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}
PROCESSOR_CONFIG: dict[str, Any] = {"processor_class": "Qwen3TTSProcessor"}
SPEECH_FEATURE_EXTRACTOR: dict[str, Any] = {
    "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
    "overlap": None, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "sampling_rate": 24000,
}


def write_tokenizer(out_dir: Path) -> dict[str, int]:
    """Write the Qwen2 tokenizer files (vocab.json, merges.txt, tokenizer_config.json) to ``out_dir`` and return
    the special tokens' ids."""
    tok = train_byte_level_bpe(SPECIAL_TOKENS)
    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=False)
    model_state = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_state["merges"]]
    special_ids = {t: int(tok.token_to_id(t)) for t in SPECIAL_TOKENS}
    out_dir.mkdir(parents=True, exist_ok=True)
    ordered = dict(sorted(vocab.items(), key=lambda item: item[1]))
    (out_dir / "vocab.json").write_text(json.dumps(ordered, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for t, i in special_ids.items()
    }
    tokenizer_config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 32768, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _check_tokenizer(out_dir, special_ids)
    return special_ids


def _check_tokenizer(directory: Path, special_ids: dict[str, int]) -> None:
    """Load the written files as transformers does and check the single-token words and special ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    for token, token_id in special_ids.items():
        if tokenizer.encode(token, add_special_tokens=False) != [token_id]:
            raise RuntimeError(f"special token {token!r} does not encode to its id {token_id}")
    for word in SINGLE_TOKEN_WORDS:
        ids = tokenizer.encode(f"<|im_start|>{word}", add_special_tokens=False)
        if len(ids) != 2:
            raise RuntimeError(f"{word!r} is not one token after <|im_start|>: {ids}")


def tiny_config(variant: str, special_ids: dict[str, int], vocab_size: int, size: str = DEFAULT_SIZE) -> dict[str, Any]:
    """A tiny ``config.json`` for ``variant`` with the official codec ids, languages and speakers, shrunk widths.

    ``size`` "1b7" gives the code predictor a narrower width than the Talker (so ``small_to_mtp_projection``
    exists, as in 1.7B); "0b6" makes the widths equal (the projection is an identity, as in 0.6B)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen3-TTS variant {variant!r}; expected one of {VARIANTS}")
    if size not in SIZES:
        raise ValueError(f"unknown Qwen3-TTS size {size!r}; expected one of {SIZES}")
    talker_hidden = 64
    predictor_hidden = 32 if size == "1b7" else talker_hidden
    text_vocab = -(-vocab_size // 64) * 64
    rope = {"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default", "type": "default"}
    code_predictor = {
        "vocab_size": 2048, "hidden_size": predictor_hidden, "intermediate_size": 2 * predictor_hidden,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": predictor_hidden // 4, "hidden_act": "silu", "max_position_embeddings": 65536,
        "initializer_range": INIT_STD, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
        "rope_theta": 1000000, "rope_scaling": None, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 28, "layer_types": ["full_attention"] * 2,
        "attention_dropout": 0.0, "num_code_groups": 16, "model_type": "qwen3_tts_talker_code_predictor",
    }
    talker = {
        "code_predictor_config": code_predictor, "vocab_size": 3072, "hidden_size": talker_hidden,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 32768, "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False, "rope_theta": 1000000,
        "rope_scaling": rope, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "attention_dropout": 0.0, "num_code_groups": 16, "text_hidden_size": 48, "text_vocab_size": text_vocab,
        **CODEC_IDS,
        # the dialect tags exist in CustomVoice only (Base and VoiceDesign list the 10 languages)
        "codec_language_id": {k: v for k, v in LANGUAGE_IDS.items() if variant == "custom_voice" or "dialect" not in k},
        "spk_id": dict(SPEAKER_IDS) if variant == "custom_voice" else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if variant == "custom_voice" else {},
        "model_type": "qwen3_tts_talker",
    }
    speaker_encoder = {
        "mel_dim": 128, "enc_dim": talker_hidden, "enc_channels": [32, 32, 32, 32, 96],
        "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 16,
        "enc_res2net_scale": 8, "enc_se_channels": 16, "sample_rate": 24000,
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": size, "tts_model_type": variant,
        "im_start_token_id": special_ids["<|im_start|>"], "im_end_token_id": special_ids["<|im_end|>"],
        "tts_pad_token_id": special_ids["<tts_pad>"], "tts_bos_token_id": special_ids["<tts_text_bos>"],
        "tts_eos_token_id": special_ids["<tts_text_eod>"],
        "talker_config": talker, "speaker_encoder_config": speaker_encoder, "dtype": "float32",
    }


def tiny_speech_tokenizer_config() -> dict[str, Any]:
    """A tiny 12 Hz speech tokenizer ``config.json``: the official rates and code geometry (16 × 2048 codes,
    1920 samples a frame at 24 kHz), small encoder and decoder widths."""
    encoder = {
        "_frame_rate": 12.5, "audio_channels": 1, "codebook_dim": 16, "codebook_size": 2048, "compress": 2,
        "dilation_growth_rate": 2, "head_dim": 16, "hidden_act": "gelu", "hidden_size": 32, "intermediate_size": 64,
        "kernel_size": 7, "last_kernel_size": 3, "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000,
        "model_type": "mimi", "norm_eps": 1e-5, "num_attention_heads": 2, "num_filters": 8, "num_hidden_layers": 1,
        "num_key_value_heads": 2, "num_quantizers": 16, "num_residual_layers": 1, "num_semantic_quantizers": 1,
        "pad_mode": "constant", "residual_kernel_size": 3, "rope_theta": 10000.0, "sampling_rate": 24000,
        "sliding_window": 250, "trim_right_ratio": 1.0, "upsample_groups": 32, "upsampling_ratios": [8, 6, 5, 4],
        "use_cache": False, "use_causal_conv": True, "use_conv_shortcut": False, "use_streaming": False,
        "vector_quantization_hidden_dimension": 16, "attention_bias": False, "initializer_range": INIT_STD,
    }
    decoder = {
        "attention_bias": False, "attention_dropout": 0.0, "codebook_dim": 32, "codebook_size": 2048,
        "decoder_dim": 64, "head_dim": 16, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
        "latent_dim": 64, "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000,
        "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_quantizers": 16,
        "num_semantic_quantizers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000, "semantic_codebook_size": 4096,
        "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
        "vector_quantization_hidden_dimension": 32,
    }
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16, "input_sample_rate": 24000, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920, "encode_downsample_rate": 1920, "encoder_config": encoder,
        "decoder_config": decoder, "dtype": "float32",
    }


def layout_tensors(layout: Layout, seed: int, namespace: str = "") -> dict[str, torch.Tensor]:
    """The float32 weights of ``layout``, each drawn from a generator seeded by (seed, namespace + key)."""
    tensors: dict[str, torch.Tensor] = {}
    for key in sorted(layout):
        spec = layout[key]
        kind, value = spec.rule
        if kind == "fill":
            tensors[key] = torch.full(spec.shape, value, dtype=torch.float32)
        else:
            noise = torch.randn(spec.shape, generator=param_generator(seed, namespace + key), dtype=torch.float32)
            tensors[key] = noise * value
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_checkpoint(
    out_dir: Path, variant: str = "custom_voice", seed: int = DEFAULT_SEED, size: str = DEFAULT_SIZE
) -> Path:
    """Write a complete tiny checkpoint of ``variant`` (weights, configs, tokenizer, speech tokenizer) to
    ``out_dir``, atomically (built in a sibling temp directory, then renamed)."""

    def write(tmp: Path) -> None:
        special_ids = write_tokenizer(tmp)
        vocab_size = max(special_ids.values()) + 1
        config = tiny_config(variant, special_ids, vocab_size, size)
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / GENERATION_CONFIG_FILE, GENERATION_CONFIG)
        _write_json(tmp / "preprocessor_config.json", PROCESSOR_CONFIG)
        tensors = layout_tensors(model_layout(config), seed)
        # Rows past the tokenizer only pad the text vocab to a multiple of 64: no text ever reaches them.
        tensors["talker.model.text_embedding.weight"][vocab_size:] = 0.0
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})

        speech_dir = tmp / SPEECH_TOKENIZER_DIR
        speech_dir.mkdir()
        speech_config = tiny_speech_tokenizer_config()
        _write_json(speech_dir / CONFIG_FILE, speech_config)
        _write_json(speech_dir / "preprocessor_config.json", SPEECH_FEATURE_EXTRACTOR)
        speech_tensors = layout_tensors(speech_tokenizer_layout(speech_config), seed, namespace="speech_tokenizer/")
        save_file(speech_tensors, str(speech_dir / WEIGHTS_FILE), metadata={"format": "pt"})

        marker = {"format": TINY_FORMAT, "seed": seed, "variant": variant, "size": size}
        _write_json(tmp / MARKER_FILE, marker)

    return write_atomically(Path(out_dir), write, lambda path: _is_complete(path, variant, size))


def tiny_checkpoint_dir(variant: str, seed: int = DEFAULT_SEED, size: str = DEFAULT_SIZE) -> Path:
    """Cache location of a generated tiny checkpoint (``$OMNI_RAY_CACHE`` or ``~/.cache/omni-ray``); the format
    version in the name keeps a checkpoint made by an older generator from being reused."""
    return cache_root() / f"qwen3-tts-tiny-v{TINY_FORMAT}-{variant}-{size}-seed{seed}"


def _is_complete(path: Path, variant: str, size: str) -> bool:
    """Whether ``path`` holds a finished checkpoint of this generator's format (the marker is written last)."""
    marker = read_marker(path, MARKER_FILE)
    return (
        marker is not None and marker.get("format") == TINY_FORMAT and marker.get("variant") == variant
        and marker.get("size") == size and (path / SPEECH_TOKENIZER_DIR / WEIGHTS_FILE).is_file()
    )


def ensure_tiny_checkpoint(variant: str = "custom_voice", seed: int = DEFAULT_SEED, size: str = DEFAULT_SIZE) -> Path:
    """Return the tiny checkpoint directory for (variant, seed, size), generating it once (safe under concurrent
    callers)."""
    return build_once(tiny_checkpoint_dir(variant, seed, size), lambda path: _is_complete(path, variant, size),
                      lambda path: make_tiny_checkpoint(path, variant=variant, seed=seed, size=size))


def read_config(checkpoint_dir: Path) -> dict[str, Any]:
    """A checkpoint's ``config.json`` as a dict (a deep copy, safe to modify)."""
    return copy.deepcopy(json.loads((Path(checkpoint_dir) / CONFIG_FILE).read_text(encoding="utf-8")))


def make_random_checkpoint(out_dir: Path, config_file: Path, speech_tokenizer_config_file: Path, seed: int = DEFAULT_SEED,
                           device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Path:
    """A full-size random checkpoint in the official layout, for the official package at a real model's size: the
    shapes of `config_file` (its text-token ids replaced by the tiny tokenizer's, whose files it takes) and of
    `speech_tokenizer_config_file`, weights drawn on `device` by the tiny checkpoints' rules and stored as `dtype`.
    Kept if already written."""
    out_dir = Path(out_dir)
    if (out_dir / MARKER_FILE).is_file():
        return out_dir
    config = json.loads(Path(config_file).read_text())
    variant = str(config.get("tts_model_type", "custom_voice"))
    tiny = ensure_tiny_checkpoint(variant, seed)
    tiny_config_ids = read_config(tiny)
    config.update({key: value for key, value in tiny_config_ids.items() if key.endswith("_token_id")})
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json",
                 GENERATION_CONFIG_FILE):
        shutil.copy(tiny / name, out_dir / name)
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(layout: Layout) -> dict[str, torch.Tensor]:
        tensors = {}
        for key in sorted(layout):
            spec = layout[key]
            kind, value = spec.rule
            tensor = (torch.full(spec.shape, value, device=device) if kind == "fill"
                      else torch.randn(spec.shape, generator=generator, device=device) * value)
            tensors[key] = tensor.to(dtype).cpu()
        return tensors

    _write_json(out_dir / CONFIG_FILE, config)
    save_file(draw(model_layout(config)), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    speech_dir = out_dir / SPEECH_TOKENIZER_DIR
    speech_dir.mkdir(exist_ok=True)
    speech_config = json.loads(Path(speech_tokenizer_config_file).read_text())
    _write_json(speech_dir / CONFIG_FILE, speech_config)
    _write_json(speech_dir / "preprocessor_config.json", SPEECH_FEATURE_EXTRACTOR)
    save_file(draw(speech_tokenizer_layout(speech_config)), str(speech_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(out_dir / MARKER_FILE, {"format": TINY_FORMAT, "seed": seed, "variant": variant, "size": "full",
                                        "config": Path(config_file).name})
    return out_dir
