"""S2 Pro checkpoints in the official layout: the config, the Dual-AR weights, the tokenizer and the codec
(`codec.pth`) of a tiny random model, deterministic by seed."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omni_ray.models.s2_pro.codec import (CODEC_CONFIG_FILE, CODEC_FILE, TINY_CODEC_CONFIG, CodecConfig,
                                          official_codec_layout)
from omni_ray.models.s2_pro.dual_ar_model import MODEL_TYPE
from omni_ray.models.s2_pro.prompt import IM_END, semantic_token
from omni_ray.tiny_checkpoints import param_generator, train_byte_level_bpe

DEFAULT_SEED = 0
TINY_CODEBOOK_SIZE = TINY_CODEC_CONFIG.semantic_codebook_size  # 64: the tiny codec's codes are the Dual-AR's
NUM_CODEBOOKS = 10  # the codec's: one semantic and nine residual codebooks
# The official tokenizer's control tokens, in its order; the semantic tokens follow them, contiguous, as the model
# requires (<|semantic:i|> for every code i of the first codebook).
CONTROL_TOKENS = (
    "<|endoftext|>", "<|pad|>", "<|im_start|>", IM_END, "<|phoneme_start|>", "<|phoneme_end|>", "<|text|>",
    "<|voice|>", "<|interleave|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
)


def write_tokenizer(out_dir: Path, codebook_size: int = TINY_CODEBOOK_SIZE) -> dict[str, int]:
    """`tokenizer.json` and `tokenizer_config.json`: a byte-level BPE trained on the shipped corpus, then the control
    and semantic tokens as special tokens. Returns the ids the config names (first and last semantic token, vocab)."""
    tokenizer = train_byte_level_bpe((*CONTROL_TOKENS, *(semantic_token(i) for i in range(codebook_size))))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": "<|pad|>",
        "bos_token": None, "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
    }, indent=2) + "\n")
    return {"semantic_begin": int(tokenizer.token_to_id(semantic_token(0))),
            "semantic_end": int(tokenizer.token_to_id(semantic_token(codebook_size - 1))),
            "vocab_size": int(tokenizer.get_vocab_size(with_added_tokens=True))}


def tiny_config(semantic_begin: int, vocab_size: int, codebook_size: int = TINY_CODEBOOK_SIZE) -> dict[str, Any]:
    """A tiny `config.json` of the published shape: q/k norms in the slow AR only, GQA in both, tied embeddings; the
    semantic token range and the vocabulary are the tokenizer's."""
    stack = {"dim": 64, "n_head": 4, "n_local_heads": 2, "head_dim": 16, "intermediate_size": 96}
    return {
        "model_type": MODEL_TYPE,
        "semantic_start_token_id": semantic_begin,
        "semantic_end_token_id": semantic_begin + codebook_size - 1,
        "text_config": {**stack, "vocab_size": vocab_size, "n_layer": 2, "rope_base": 1000000.0,
                        "norm_eps": 1e-6, "max_seq_len": 512, "tie_word_embeddings": True, "attention_qk_norm": True,
                        "attention_qkv_bias": False, "attention_o_bias": False},
        "audio_decoder_config": {**stack, "vocab_size": codebook_size, "num_codebooks": NUM_CODEBOOKS, "n_layer": 2,
                                 "attention_qk_norm": False, "attention_qkv_bias": False, "attention_o_bias": False,
                                 "max_seq_len": NUM_CODEBOOKS + 1, "text_dim": stack["dim"]},
    }


def _stack_layout(prefix: str, section: dict[str, Any], qk_norm: bool) -> dict[str, tuple[int, ...]]:
    dim, heads, kv_heads, head_dim = section["dim"], section["n_head"], section["n_local_heads"], section["head_dim"]
    ffn = section["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}norm.weight": (dim,)}
    for n in range(section["n_layer"]):
        layer = f"{prefix}layers.{n}."
        shapes.update({
            f"{layer}attention.wqkv.weight": ((heads + 2 * kv_heads) * head_dim, dim),
            f"{layer}attention.wo.weight": (dim, heads * head_dim),
            f"{layer}attention_norm.weight": (dim,), f"{layer}ffn_norm.weight": (dim,),
            f"{layer}feed_forward.w1.weight": (ffn, dim), f"{layer}feed_forward.w3.weight": (ffn, dim),
            f"{layer}feed_forward.w2.weight": (dim, ffn),
        })
        if qk_norm:
            shapes.update({f"{layer}attention.q_norm.weight": (head_dim,), f"{layer}attention.k_norm.weight": (head_dim,)})
    return shapes


def weight_layout(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the official `model.safetensors` for `config`, with its shape."""
    text, audio = config["text_config"], config["audio_decoder_config"]
    fast = {**text, **audio}
    shapes = _stack_layout("text_model.model.", text, bool(text["attention_qk_norm"]))
    shapes["text_model.model.embeddings.weight"] = (text["vocab_size"], text["dim"])
    if not text.get("tie_word_embeddings", True):
        shapes["text_model.model.output.weight"] = (text["vocab_size"], text["dim"])
    shapes.update(_stack_layout("audio_decoder.", fast, bool(audio.get("attention_qk_norm", text["attention_qk_norm"]))))
    shapes["audio_decoder.codebook_embeddings.weight"] = (audio["vocab_size"] * audio["num_codebooks"], text["dim"])
    shapes["audio_decoder.embeddings.weight"] = (audio["vocab_size"], fast["dim"])
    shapes["audio_decoder.output.weight"] = (audio["vocab_size"], fast["dim"])
    return shapes


def random_weights(config: dict[str, Any], seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """Float32 weights for `config`, each drawn from its own (seed, key) generator: norm scales 1 + N(0, 0.1) (so a
    head norm's order matters), embeddings N(0, 1), other matrices N(0, 0.02) scaled up for the tiny widths."""
    out = {}
    for key, shape in weight_layout(config).items():
        noise = torch.randn(shape, generator=param_generator(seed, key), dtype=torch.float32)
        if key.endswith("norm.weight"):
            out[key] = 1.0 + 0.1 * noise
        elif "embeddings" in key:
            out[key] = noise
        else:
            out[key] = noise * (1.0 / shape[-1] ** 0.5)
    return out


def random_codec_weights(config: CodecConfig, seed: int = DEFAULT_SEED) -> dict[str, torch.Tensor]:
    """Float32 tensors of the official `codec.pth` for `config` (keys without the `generator.` prefix), each drawn
    from its own (seed, "codec." + key) generator. Scaled so that activations keep their size through the tiny
    network: weight-norm magnitudes, norm scales, Snake's alpha and the layer scales 1 + N(0, 0.1) (0.5 + for the
    scales, so the transformers and ConvNeXt blocks matter; 0.3 × for the magnitudes of the residual units' last
    convolutions and of the decoder's last), directions N(0, 1), other matrices N(0, 1/fan-in), biases N(0, 0.1),
    codebooks N(0, 1)."""
    out_conv = f"decoder.model.{len(config.decoder_rates) + 2}.conv."
    out = {}
    for key, (_, shape) in official_codec_layout(config).items():
        noise = torch.randn(shape, generator=param_generator(seed, f"codec.{key}"), dtype=torch.float32)
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "original0" and (key.startswith(out_conv) or ".block.3.conv." in key):
            out[key] = 0.3 * (1.0 + 0.1 * noise)  # the last convolution's and each residual unit's, so the sums
            # through the blocks stay near unit size and the output short of tanh's saturation
        elif leaf in ("original0", "weight_g", "alpha") or (leaf == "weight" and len(shape) == 1):
            out[key] = 1.0 + 0.1 * noise
        elif leaf == "gamma":
            out[key] = 0.5 + 0.1 * noise
        elif leaf in ("original1", "weight_v") or "codebook" in key:
            out[key] = noise
        elif leaf == "bias":
            out[key] = 0.1 * noise
        else:
            fan_in = shape[0] if "upsample" in key and len(shape) == 3 else math.prod(shape[1:])
            out[key] = noise / fan_in ** 0.5
    return out


def write_tiny_codec(out_dir: Path, seed: int = DEFAULT_SEED, config: CodecConfig = TINY_CODEC_CONFIG) -> Path:
    """`codec.pth` as the official training code saves it (every key under `generator.`, weight norms unfolded)
    and, for our loader, `codec_config.json` (the official loader reads its geometry from its hydra config)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save({f"generator.{k}": v.contiguous() for k, v in random_codec_weights(config, seed).items()},
               out_dir / CODEC_FILE)
    (out_dir / CODEC_CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    return out_dir / CODEC_FILE


def write_tiny_checkpoint(out_dir: Path, seed: int = DEFAULT_SEED) -> Path:
    """A tiny random S2 Pro in the official layout into `out_dir`: the tokenizer, `config.json` (its ids the
    tokenizer's), `model.safetensors` and the codec (`write_tiny_codec`)."""
    out_dir = Path(out_dir)
    ids = write_tokenizer(out_dir)
    config = tiny_config(ids["semantic_begin"], ids["vocab_size"])
    if ids["semantic_end"] != config["semantic_end_token_id"]:
        raise RuntimeError("the tokenizer's semantic tokens are not contiguous")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in random_weights(config, seed).items()}, str(out_dir / "model.safetensors"))
    write_tiny_codec(out_dir, seed)
    return out_dir
