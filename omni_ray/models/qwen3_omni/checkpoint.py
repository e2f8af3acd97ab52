"""Deterministic tiny random-weight Qwen3-Omni checkpoint with a real byte-level BPE tokenizer."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from torch import nn

from omni_ray.tiny_checkpoints import (
    build_once, cache_root, param_generator, read_marker, train_byte_level_bpe, write_atomically,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3OmniMoeConfig

DEFAULT_SEED: int = 0
# Bumped whenever the generator's output changes, so that a cached checkpoint of an older format is made anew.
TINY_FORMAT: int = 2
WEIGHTS_FILE: str = "model.safetensors"
CONFIG_FILE: str = "config.json"
GENERATION_CONFIG_FILE: str = "generation_config.json"
MARKER_FILE: str = "omni_ray_tiny.json"
INIT_STD: float = 0.02  # recorded as initializer_range in the config (what HF init would use)
# The actual re-init is variance preserving (std = gain / sqrt(fan_in)) rather than HF's flat 0.02, so
# that attention, MoE routing and the audio tower visibly change the output: with 0.02 the residual
# stream is just the last token's embedding and greedy text ignores the context.
EMBED_STD: float = 1.0
LINEAR_GAIN: float = 1.0
HEAD_GAIN: float = 2.0  # peaked enough logits that sampling is not uniform noise
# Convolutions use fan-in scaled init; code2wav's residual units and output conv are damped so the
# random vocoder yields an audible (~0.1 rms) waveform rather than silence or a clipped square wave.
CODE2WAV_RESIDUAL_GAIN: float = 0.3
CODE2WAV_OUTPUT_GAIN: float = 0.08

# Qwen3-Omni's added special tokens, in the order they receive ids after the BPE vocabulary.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
)
ROLE_WORDS: tuple[str, ...] = ("user", "assistant", "system")

CHAT_TEMPLATE: str = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- elif part['type'] in ['audio', 'input_audio', 'audio_url'] -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ['image', 'image_url'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}"
    "{{- raise_exception('Unsupported content part type: ' + part['type']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

WHISPER_FEATURE_EXTRACTOR: dict[str, Any] = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 300 * 16000,
    "nb_max_frames": 300 * 16000 // 160,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "dither": 0.0,
}


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the shipped corpus, save it to ``out_dir`` and return it."""
    from transformers import PreTrainedTokenizerFast

    tok = train_byte_level_bpe(SPECIAL_TOKENS)

    extra = [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")]
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=extra,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    im_start = hf_tok.convert_tokens_to_ids("<|im_start|>")
    newline = hf_tok.encode("\n", add_special_tokens=False)
    for word in ROLE_WORDS:  # must hold as the chat template renders them, right after <|im_start|>
        ids = hf_tok.encode(f"<|im_start|>{word}\n", add_special_tokens=False)
        if not (ids[0] == im_start and ids[2:] == newline and len(ids) == 2 + len(newline)):
            raise RuntimeError(f"role word {word!r} is not one token: {hf_tok.convert_ids_to_tokens(ids)}")
    for t in SPECIAL_TOKENS:
        if len(hf_tok.encode(t, add_special_tokens=False)) != 1:
            raise RuntimeError(f"special token {t!r} is not one token")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out_dir), save_jinja_files=False)
    return hf_tok


def _tok_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """Id of a token the tokenizer must contain as a single piece."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{token!r} is not a single token: {ids}")
    return int(ids[0])


def tiny_config(tokenizer: PreTrainedTokenizerFast) -> Qwen3OmniMoeConfig:
    """A tiny ``Qwen3OmniMoeConfig`` with every field explicit, structured like the 30B-A3B config."""
    from transformers import Qwen3OmniMoeConfig

    ids = {
        "im_start": _tok_id(tokenizer, "<|im_start|>"),
        "im_end": _tok_id(tokenizer, "<|im_end|>"),
        "endoftext": _tok_id(tokenizer, "<|endoftext|>"),
        "user": _tok_id(tokenizer, "user"),
        "assistant": _tok_id(tokenizer, "assistant"),
        "system": _tok_id(tokenizer, "system"),
        "tts_pad": _tok_id(tokenizer, "<tts_pad>"),
        "tts_bos": _tok_id(tokenizer, "<tts_text_bos>"),
        "tts_eos": _tok_id(tokenizer, "<tts_text_eod>"),
        "audio": _tok_id(tokenizer, "<|audio_pad|>"),
        "audio_start": _tok_id(tokenizer, "<|audio_start|>"),
        "audio_end": _tok_id(tokenizer, "<|audio_end|>"),
        "image": _tok_id(tokenizer, "<|image_pad|>"),
        "video": _tok_id(tokenizer, "<|video_pad|>"),
        "vision_start": _tok_id(tokenizer, "<|vision_start|>"),
        "vision_end": _tok_id(tokenizer, "<|vision_end|>"),
    }
    thinker_vocab = -(-len(tokenizer) // 64) * 64

    audio_config = {
        "num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
        "d_model": 32, "dropout": 0.0, "attention_dropout": 0.0, "activation_function": "gelu",
        "activation_dropout": 0.0, "scale_embedding": False, "initializer_range": INIT_STD,
        "max_source_positions": 1500, "n_window": 50, "output_dim": 64, "n_window_infer": 800,
        "conv_chunksize": 500, "downsample_hidden_size": 16,
    }
    vision_config = {
        "depth": 1, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64,
        "num_heads": 2, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0], "initializer_range": INIT_STD,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        # Present in the real config, not read by transformers.
        "apply_vit_abs_pos_embed": True, "image_size": 128, "spatial_patch_size": 16, "tokens_per_second": 2,
    }
    thinker_text_config = {
        "vocab_size": thinker_vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
        "max_position_embeddings": 4096, "initializer_range": INIT_STD, "rms_norm_eps": 1e-6,
        "use_cache": True, "attention_bias": False, "sliding_window": None, "use_sliding_window": False,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "moe_intermediate_size": 32,
        "num_experts_per_tok": 2, "num_experts": 8, "norm_topk_prob": True, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "shared_expert_intermediate_size": 0,
        "use_qk_norm": True, "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1000000.0, "interleaved": True,
            "mrope_interleaved": True, "mrope_section": [4, 2, 2],
        },
        "pad_token_id": ids["endoftext"], "bos_token_id": None, "eos_token_id": ids["im_end"],
    }
    thinker_config = {
        "audio_config": audio_config, "vision_config": vision_config, "text_config": thinker_text_config,
        "position_id_per_seconds": 13, "seconds_per_chunk": 2, "initializer_range": INIT_STD,
        "tie_word_embeddings": False, "user_token_id": ids["user"],
        "audio_token_id": ids["audio"], "audio_start_token_id": ids["audio_start"],
        "audio_end_token_id": ids["audio_end"], "image_token_id": ids["image"],
        "video_token_id": ids["video"], "vision_start_token_id": ids["vision_start"],
        "vision_end_token_id": ids["vision_end"],
    }
    code_predictor_config = {
        "vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": INIT_STD, "rms_norm_eps": 1e-6,
        "use_cache": True, "tie_word_embeddings": False, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28,
        "layer_types": ["full_attention", "full_attention"], "attention_dropout": 0.0,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "num_code_groups": 16,
    }
    talker_text_config = {
        "vocab_size": 3072, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "max_position_embeddings": 65536, "initializer_range": INIT_STD, "rms_norm_eps": 1e-6,
        "use_cache": True, "tie_word_embeddings": False, "attention_bias": False,
        "sliding_window": None, "use_sliding_window": False, "attention_dropout": 0.0,
        "decoder_sparse_step": 1, "moe_intermediate_size": 16, "num_experts_per_tok": 2,
        # transformers maps num_experts -> num_local_experts for the talker (the real config's spelling).
        "num_local_experts": 4, "norm_topk_prob": True, "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "shared_expert_intermediate_size": 32,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1000000.0, "interleaved": True, "mrope_section": [2, 1, 1],
        },
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    talker_config = {
        "code_predictor_config": code_predictor_config, "text_config": talker_text_config,
        "num_code_groups": 16, "thinker_hidden_size": 64, "accept_hidden_layer": 2,
        "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_pad_id": 2148,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "audio_token_id": ids["audio"], "audio_start_token_id": ids["audio_start"],
        "audio_end_token_id": ids["audio_end"], "image_token_id": ids["image"],
        "video_token_id": ids["video"], "vision_start_token_id": ids["vision_start"],
        "position_id_per_seconds": 13, "seconds_per_chunk": 2, "spatial_merge_size": 2,
        "speaker_id": {"aiden": 2303, "chelsie": 2301, "ethan": 2302},
        "initializer_range": INIT_STD, "output_router_logits": False, "tie_word_embeddings": False,
    }
    code2wav_config = {
        "codebook_size": 2048, "hidden_size": 32, "max_position_embeddings": 8000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "num_attention_heads": 2, "num_key_value_heads": 2, "attention_bias": False, "sliding_window": 72,
        "intermediate_size": 64, "hidden_act": "silu", "layer_scale_initial_scale": 0.01,
        "rms_norm_eps": 1e-5, "num_hidden_layers": 2, "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32,
        "attention_dropout": 0.0, "initializer_range": INIT_STD,
        # Present in the real config, not read by transformers' Code2Wav.
        "codebook_dim": 16, "vector_quantization_hidden_dimension": 16,
        "num_semantic_quantizers": 1, "semantic_codebook_size": 4096,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker_config,
        talker_config=talker_config,
        code2wav_config=code2wav_config,
        enable_audio_output=True,
        im_start_token_id=ids["im_start"],
        im_end_token_id=ids["im_end"],
        tts_pad_token_id=ids["tts_pad"],
        tts_bos_token_id=ids["tts_bos"],
        tts_eos_token_id=ids["tts_eos"],
        system_token_id=ids["system"],
        user_token_id=ids["user"],
        assistant_token_id=ids["assistant"],
        initializer_range=INIT_STD,
        dtype="float32",
        architectures=["Qwen3OmniMoeForConditionalGeneration"],
    )


def _write_unstamped_json(src: Path, dst: Path) -> None:
    """Copy a config transformers saved, less its ``transformers_version``: that stamps the writer, not the
    checkpoint (loading ignores it), and without it the file is the same bytes whichever release wrote it."""
    data = json.loads(src.read_text(encoding="utf-8"))
    data.pop("transformers_version", None)
    dst.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _conv_std(module: nn.Module, name: str, modules: dict[str, nn.Module]) -> float:
    """Fan-in scaled std for a conv weight, with smaller gains inside code2wav's residual path."""
    weight = module.weight
    if isinstance(module, nn.ConvTranspose1d):
        fan_in = weight.shape[0] * weight.shape[2] / module.stride[0]
    else:
        fan_in = weight[0].numel()
    gain = 1.0
    wrapper = name.rsplit(".", 1)[0]  # the causal-conv wrapper module
    parent = modules.get(wrapper.rsplit(".", 1)[0]) if "." in wrapper else None
    if parent is not None and "ResidualUnit" in type(parent).__name__:
        gain = CODE2WAV_RESIDUAL_GAIN  # keep the dilated residual units close to identity
    elif name == f"code2wav.decoder.{len(modules['code2wav.decoder']) - 1}.conv":
        gain = CODE2WAV_OUTPUT_GAIN  # waveform out at ~0.1 rms, well inside the [-1, 1] clamp
    return gain / float(fan_in) ** 0.5


InitRule = tuple[str, float]  # ("fill", value) or ("normal", std)


@torch.no_grad()
def init_rules(model: nn.Module) -> dict[str, InitRule]:
    """Each parameter's init, by in-memory name: a constant fill, or normal noise of a fan-in scaled std."""
    rules: dict[str, InitRule] = {}
    modules = dict(model.named_modules())
    for mod_name, module in modules.items():
        kind = type(module).__name__
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if "Norm" in kind:  # RMSNorm / LayerNorm: identity scale, zero shift
                rules[full] = ("fill", 1.0 if p_name == "weight" else 0.0)
            elif "SnakeBeta" in kind:  # log-scale alpha/beta: exp(0) = 1
                rules[full] = ("fill", 0.0)
            elif "LayerScale" in kind:
                rules[full] = ("fill", float(model.config.code2wav_config.layer_scale_initial_scale))
            elif "ConvNeXt" in kind and p_name == "gamma":
                rules[full] = ("fill", 0.1)
            elif p_name == "bias":
                rules[full] = ("fill", 0.0)
            elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d)):
                rules[full] = ("normal", _conv_std(module, mod_name, modules))
            elif isinstance(module, nn.Embedding):
                rules[full] = ("normal", EMBED_STD)
            elif "lm_head" in full or "codec_head" in full:
                rules[full] = ("normal", HEAD_GAIN / param.shape[-1] ** 0.5)
            else:  # nn.Linear weights, MoE routers, fused expert tensors: fan_in is the last dim
                rules[full] = ("normal", LINEAR_GAIN / param.shape[-1] ** 0.5)
    return rules


@torch.no_grad()
def checkpoint_rules(model: nn.Module, scratch: Path) -> dict[str, tuple[InitRule, torch.Size]]:
    """Each checkpoint key's init rule and shape, in the on-disk layout that ``save_pretrained`` writes.

    transformers' in-memory names and layouts differ between releases (fused expert tensors, where the Thinker's
    towers sit), while the saved keys follow the official checkpoint. To carry each rule over to the keys it becomes,
    every parameter is filled with the index of its rule, the model is saved to ``scratch`` and the indices are read
    back per key."""
    from safetensors import safe_open

    by_name = init_rules(model)
    rules = sorted(set(by_name.values()))
    for name, param in model.named_parameters():
        param.fill_(float(rules.index(by_name[name])))  # small integers: exact in any float dtype
    model.save_pretrained(str(scratch), safe_serialization=True)
    out: dict[str, tuple[InitRule, torch.Size]] = {}
    for file in sorted(scratch.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                labels = f.get_tensor(key).unique()
                if labels.numel() != 1:
                    raise RuntimeError(f"checkpoint key {key} mixes parameters of different init rules")
                out[key] = (rules[int(labels.item())], f.get_slice(key).get_shape())
    return out


def checkpoint_tensors(rules: dict[str, tuple[InitRule, torch.Size]], seed: int) -> dict[str, torch.Tensor]:
    """The float32 weights, each drawn from a generator seeded by (seed, checkpoint key): the same bytes whichever
    transformers release builds the model, and independent of iteration order."""
    tensors: dict[str, torch.Tensor] = {}
    for key in sorted(rules):
        (kind, value), shape = rules[key]
        if kind == "fill":
            tensors[key] = torch.full(tuple(shape), value, dtype=torch.float32)
        else:
            noise = torch.randn(tuple(shape), generator=param_generator(seed, key), dtype=torch.float32)
            tensors[key] = noise * value
    return tensors


def make_tiny_checkpoint(out_dir: Path, seed: int = DEFAULT_SEED) -> Path:
    """Write a complete tiny checkpoint (weights, config, tokenizer, feature extractor) to ``out_dir``."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    def write(tmp: Path) -> None:
        tokenizer = build_tokenizer(tmp)
        config = tiny_config(tokenizer)
        with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG; don't leak that
            torch.manual_seed(seed)
            model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32).eval()
        scratch = Path(tempfile.mkdtemp(prefix=".labels-", dir=tmp))
        rules = checkpoint_rules(model, scratch)  # also writes config.json and generation_config.json
        for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
            _write_unstamped_json(scratch / name, tmp / name)
        shutil.rmtree(scratch)
        tensors = checkpoint_tensors(rules, seed)
        # Rows past len(tokenizer) only pad the vocab to a multiple of 64: a zero row gives logit 0,
        # which never wins greedy decoding against ~1000 real logits of std HEAD_GAIN.
        tensors["thinker.lm_head.weight"][len(tokenizer):] = 0.0
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "preprocessor_config.json").write_text(
            json.dumps(WHISPER_FEATURE_EXTRACTOR, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        (tmp / MARKER_FILE).write_text(json.dumps({"format": TINY_FORMAT, "seed": seed}) + "\n", encoding="utf-8")

    return write_atomically(Path(out_dir), write, _is_complete)


def tiny_checkpoint_dir(seed: int = DEFAULT_SEED) -> Path:
    """Cache location of a generated tiny checkpoint (``$OMNI_RAY_CACHE`` or ``~/.cache/omni-ray``); the format
    version in the name keeps a checkpoint made by an older generator from being reused."""
    return cache_root() / f"qwen3-omni-tiny-v{TINY_FORMAT}-seed{seed}"


def default_checkpoint_dir() -> Path:
    """Cache location of the embedded default checkpoint."""
    return tiny_checkpoint_dir(DEFAULT_SEED)


def _is_complete(path: Path) -> bool:
    """Whether ``path`` holds a finished checkpoint of this generator's format (the marker is written last, before
    the rename)."""
    marker = read_marker(path, MARKER_FILE)
    return marker is not None and marker.get("format") == TINY_FORMAT and (path / WEIGHTS_FILE).is_file()


def ensure_tiny_checkpoint(seed: int = DEFAULT_SEED) -> Path:
    """Return the tiny checkpoint directory for ``seed``, generating it once (safe under concurrent callers)."""
    return build_once(tiny_checkpoint_dir(seed), _is_complete, lambda path: make_tiny_checkpoint(path, seed=seed))


def ensure_default_checkpoint() -> Path:
    """The embedded default: the tiny checkpoint of the default seed."""
    return ensure_tiny_checkpoint(DEFAULT_SEED)


def resolve_checkpoint(path: str | Path | None, tiny_seed: int = DEFAULT_SEED) -> Path:
    """A configured local checkpoint, or the tiny one (generated on first use) when no path is set."""
    if path is not None:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        return Path(path)
    return ensure_tiny_checkpoint(tiny_seed)
