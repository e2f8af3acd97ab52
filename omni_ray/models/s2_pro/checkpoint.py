"""S2 Pro checkpoints in the official layout: the config, the Dual-AR weights and the tokenizer of a tiny random
model, deterministic by seed (the codec's `codec.pth` is not written yet)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from omni_ray.models.s2_pro.dual_ar_model import MODEL_TYPE
from omni_ray.models.s2_pro.prompt import IM_END, semantic_token
from omni_ray.tiny_checkpoints import param_generator, train_byte_level_bpe

DEFAULT_SEED = 0
TINY_CODEBOOK_SIZE = 64
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


def write_tiny_checkpoint(out_dir: Path, seed: int = DEFAULT_SEED) -> Path:
    """A tiny random S2 Pro in the official layout into `out_dir`: the tokenizer, `config.json` (its ids the
    tokenizer's) and `model.safetensors`."""
    out_dir = Path(out_dir)
    ids = write_tokenizer(out_dir)
    config = tiny_config(ids["semantic_begin"], ids["vocab_size"])
    if ids["semantic_end"] != config["semantic_end_token_id"]:
        raise RuntimeError("the tokenizer's semantic tokens are not contiguous")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in random_weights(config, seed).items()}, str(out_dir / "model.safetensors"))
    return out_dir
