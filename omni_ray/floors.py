"""The memory-bandwidth floor of a decode step: the weight bytes it must read at a batch size, over the GPU's bandwidth.

A batch of B rows whose tokens differ reads every non-expert weight once and, in each MoE layer, the experts that any
of its rows picks: with k of E experts per row, about E·(1 - (1 - k/E)^B) of them (rows routed independently, as
random weights route them and a trained router's load balancing aims for). Token embeddings are left out: a step
reads only its rows of them. The Talker's step also runs the code predictor once per code group after the first,
so its layers count that many times.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from omni_ray.models.qwen3_omni.talker_model import TalkerModel
from omni_ray.models.qwen3_omni.thinker import ThinkerLM

H200_BANDWIDTH = 4.3e12  # bytes/s, an H200's device-to-device copy, measured
H100_BANDWIDTH = 3.35e12  # bytes/s, an H100 SXM's HBM3 as specified (not measured here)
BYTES_PER_PARAM = 2  # bf16


def distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected number of experts that at least one of `batch` independently routed rows picks."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def _split_params(module: nn.Module) -> tuple[int, int]:
    """(parameters outside the MoE experts and token embeddings, parameters of the experts)."""
    dense = experts = 0
    for name, parameter in module.named_parameters():
        if ".experts." in name:
            experts += parameter.numel()
        elif not isinstance(_owner(module, name), nn.Embedding):
            dense += parameter.numel()
    return dense, experts


def _owner(module: nn.Module, parameter_name: str) -> nn.Module:
    return module.get_submodule(parameter_name.rsplit(".", 1)[0]) if "." in parameter_name else module


def step_bytes(config: Any, stage: str, batch: int, expert_share: float | None = None) -> float:
    """Weight bytes one decode step of `stage` (thinker | talker, the Talker with its whole frame) reads at `batch`;
    `expert_share`: the share of each MoE layer's experts the step reads, measured (`benchmarks/expert_reads.py`),
    instead of the count for independently routed rows."""
    with torch.device("meta"):
        if stage == "thinker":
            text = config.thinker_config.text_config
            dense, experts = _split_params(ThinkerLM(text))
            repeated = 0
        else:
            text = config.talker_config.text_config
            talker = TalkerModel(config.talker_config)
            dense, experts = _split_params(talker)
            # the frame's code predictor: its decoder stack once per completed group, each group's head once
            stack, _ = _split_params(talker.code_predictor.model)
            heads = sum(p.numel() for p in talker.code_predictor.lm_head.parameters())
            prefill_only = sum(p.numel() for p in talker.hidden_projection.parameters())  # multimodal prompt states
            dense -= stack + heads + prefill_only
            repeated = stack * (int(config.talker_config.num_code_groups) - 1) + heads
    num_experts = int(getattr(text, "num_experts", 0) or 0)
    if expert_share is not None:
        share = expert_share
    else:
        share = distinct_experts(num_experts, int(text.num_experts_per_tok), batch) / num_experts if num_experts else 0.0
    return BYTES_PER_PARAM * (dense + repeated + share * experts)


def floor_ms(
    config: Any, stage: str, batch: int, bandwidth: float = H200_BANDWIDTH, expert_share: float | None = None,
) -> float:
    """The step's bandwidth floor in milliseconds (`expert_share`: as `step_bytes`)."""
    return 1000.0 * step_bytes(config, stage, batch, expert_share) / bandwidth


def frame_seconds(config: Any, sample_rate: int = 24000) -> float:
    """Audio seconds per codec frame: Code2Wav's total upsampling over the output sample rate (0.08 s: 12.5 Hz)."""
    code2wav = config.code2wav_config
    return math.prod([*code2wav.upsample_rates, *code2wav.upsampling_ratios]) / sample_rate


def rtf_floor(
    config: Any, streams: int, text_tokens: int, frames: int, bandwidth: float = H200_BANDWIDTH,
    expert_shares: dict[str, float] | None = None,
) -> float:
    """The lowest RTF `streams` concurrent replies of `text_tokens` Thinker tokens and `frames` Talker frames can reach
    with the Thinker and the Talker on GPUs of their own, each step at its floor. The Talker reads one reply token per
    frame, so its first frames (as many as the reply has tokens) come no faster than the Thinker's steps.
    `expert_shares`: a stage's share of its experts a step reads at this batch, measured, instead of the count for
    independently routed rows (`step_bytes`)."""
    shares = expert_shares or {}
    thinker, talker = (floor_ms(config, stage, streams, bandwidth, shares.get(stage)) for stage in ("thinker", "talker"))
    paced = min(text_tokens, frames)
    seconds = (paced * max(thinker, talker) + (frames - paced) * talker) / 1000.0
    return seconds / (frames * frame_seconds(config))


def card_bandwidth(name: str) -> float:
    """The memory bandwidth the floors take for a card by its name (`torch.cuda.get_device_name()`): an H100's
    specified, else an H200's measured."""
    return H100_BANDWIDTH if "H100" in name.upper() else H200_BANDWIDTH


def _dense_layers_params(section: dict[str, Any]) -> int:
    """Parameters of a Qwen3 decoder stack's layers (attention with q/k norms, gated MLP, two norms each) and its
    final norm, from a config section."""
    hidden, head_dim = int(section["hidden_size"]), int(section["head_dim"])
    heads, kv_heads = int(section["num_attention_heads"]), int(section["num_key_value_heads"])
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim
    mlp = 3 * hidden * int(section["intermediate_size"])
    return int(section["num_hidden_layers"]) * (attention + mlp + 2 * hidden) + hidden


def tts_step_bytes(config: dict[str, Any], batch: int, context: int) -> float:
    """Bytes one Qwen3-TTS Talker step (a whole frame) reads at `batch` rows of `context` positions each: the
    backbone's layers and its codec head once, the code predictor's layers (with the Talker-to-predictor projection
    where the widths differ) 15 times and each of its 15 heads once, and each row's KV in the backbone (bf16; the code
    predictor's KV, at most 17 positions, is left out). `config`: a checkpoint's `config.json` as a dict."""
    talker = config["talker_config"]
    predictor = talker["code_predictor_config"]
    hidden, small = int(talker["hidden_size"]), int(predictor["hidden_size"])
    groups = int(talker.get("num_code_groups", 16))
    backbone = _dense_layers_params(talker) + int(talker["vocab_size"]) * hidden
    projection = hidden * small + small if hidden != small else 0
    passes = (groups - 1) * (_dense_layers_params(predictor) + projection)
    heads = (groups - 1) * int(predictor["vocab_size"]) * small
    kv_per_position = 2 * int(talker["num_hidden_layers"]) * int(talker["num_key_value_heads"]) * int(talker["head_dim"])
    return BYTES_PER_PARAM * (backbone + passes + heads + batch * context * kv_per_position)


def tts_step_floor_ms(config: dict[str, Any], batch: int, context: int, bandwidth: float = H200_BANDWIDTH) -> float:
    """The bandwidth floor of a Qwen3-TTS Talker step in milliseconds (`tts_step_bytes` over `bandwidth`)."""
    return 1000.0 * tts_step_bytes(config, batch, context) / bandwidth


def tts_throughput_ceiling(config: dict[str, Any], streams: int, context: int, bandwidth: float = H200_BANDWIDTH,
                           frame_seconds: float = 0.08) -> float:
    """Audio seconds a second that `streams` concurrent streams reach at most when the Talker steps at its floor:
    each step makes one frame (`frame_seconds`, 12.5 Hz) for every stream."""
    return streams * frame_seconds * 1000.0 / tts_step_floor_ms(config, streams, context, bandwidth)


def s2_pro_step_bytes(config: dict[str, Any], batch: int, context: int) -> float:
    """Bytes one S2 Pro Dual-AR step (a whole frame) reads at `batch` rows of `context` positions each: the slow AR's
    layers and its output head (the token embeddings when tied) once, the fast AR's layers and codebook head once per
    codebook (its sequential passes, positions 0..num_codebooks-1), and each row's KV in the slow AR (bf16; the fast
    AR's, at most 11 positions, is left out). Embedding lookups read only their rows and are left out. `config`: a
    checkpoint's `config.json` as a dict."""
    from omni_ray.models.s2_pro.checkpoint import weight_layout

    text, audio = config["text_config"], config["audio_decoder_config"]
    layout = {key: math.prod(shape) for key, shape in weight_layout(config).items()}
    slow = sum(n for key, n in layout.items() if key.startswith("text_model.") and "embeddings" not in key)
    if text.get("tie_word_embeddings", True):
        slow += layout["text_model.model.embeddings.weight"]
    fast = sum(n for key, n in layout.items() if key.startswith("audio_decoder.") and "embeddings" not in key)
    kv_heads = int(text.get("n_local_heads") or text["n_head"])
    kv_per_position = 2 * int(text["n_layer"]) * kv_heads * int(text.get("head_dim") or text["dim"] // text["n_head"])
    return BYTES_PER_PARAM * (slow + int(audio["num_codebooks"]) * fast + batch * context * kv_per_position)


def s2_pro_step_floor_ms(config: dict[str, Any], batch: int, context: int, bandwidth: float = H200_BANDWIDTH) -> float:
    """The bandwidth floor of an S2 Pro Dual-AR step in milliseconds (`s2_pro_step_bytes` over `bandwidth`)."""
    return 1000.0 * s2_pro_step_bytes(config, batch, context) / bandwidth
