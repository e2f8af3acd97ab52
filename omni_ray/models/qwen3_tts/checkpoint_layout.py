"""Qwen3-TTS checkpoint keys and shapes, enumerated from a config in the official on-disk layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# How a tensor is initialised in a tiny random checkpoint.
#  ("fill", v):      every element is v (norm scales, biases, codebook usage counts, log-scale Snake params)
#  ("normal", std):  Gaussian noise of that std, drawn per key from a seeded generator
InitRule = tuple[str, float]

# Fan-in scaled init, with gains that keep the tiny random models away from degenerate behaviour:
EMBED_STD: float = 1.0  # codec / text embeddings and codebooks: unit scale, like a trained model's inputs
LINEAR_GAIN: float = 1.0  # variance preserving linear / conv layers
HEAD_GAIN: float = 2.0  # peaked enough logits that greedy codes follow the context, not noise
RESIDUAL_UNIT_GAIN: float = 0.3  # the codec decoder's dilated residual units stay close to identity
WAVE_OUT_GAIN: float = 0.08  # the codec decoder's last conv: ~0.1 rms audio, well inside its [-1, 1] clamp
CONVNEXT_GAMMA: float = 0.1  # the upsampler's ConvNeXt residual scale (the trained model's is learnt)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its shape and how a tiny random checkpoint fills it."""

    shape: tuple[int, ...]
    rule: InitRule


Layout = dict[str, TensorSpec]


def _normal_fan_in(shape: tuple[int, ...], fan_in: float, gain: float = LINEAR_GAIN) -> TensorSpec:
    return TensorSpec(shape, ("normal", gain / float(fan_in) ** 0.5))


def _fill(shape: tuple[int, ...], value: float) -> TensorSpec:
    return TensorSpec(shape, ("fill", value))


def _linear(out: Layout, name: str, in_dim: int, out_dim: int, bias: bool, gain: float = LINEAR_GAIN) -> None:
    out[f"{name}.weight"] = _normal_fan_in((out_dim, in_dim), in_dim, gain)
    if bias:
        out[f"{name}.bias"] = _fill((out_dim,), 0.0)


def _conv(
    out: Layout, name: str, in_ch: int, out_ch: int, kernel: int, bias: bool = True, groups: int = 1,
    gain: float = LINEAR_GAIN,
) -> None:
    """An ``nn.Conv1d`` weight ``[out, in / groups, kernel]`` (and bias)."""
    out[f"{name}.weight"] = _normal_fan_in((out_ch, in_ch // groups, kernel), in_ch // groups * kernel, gain)
    if bias:
        out[f"{name}.bias"] = _fill((out_ch,), 0.0)


def _conv_transpose(out: Layout, name: str, in_ch: int, out_ch: int, kernel: int, stride: int) -> None:
    """An ``nn.ConvTranspose1d`` weight ``[in, out, kernel]`` and bias; each output sees in * kernel / stride taps."""
    out[f"{name}.weight"] = _normal_fan_in((in_ch, out_ch, kernel), in_ch * kernel / stride)
    out[f"{name}.bias"] = _fill((out_ch,), 0.0)


def _norm(out: Layout, name: str, dim: int, bias: bool = False) -> None:
    out[f"{name}.weight"] = _fill((dim,), 1.0)
    if bias:
        out[f"{name}.bias"] = _fill((dim,), 0.0)


def _qwen3_decoder_layer(out: Layout, name: str, cfg: dict[str, Any]) -> None:
    """A dense Qwen3 layer: GQA attention with per-head q/k RMSNorm, SwiGLU MLP, pre-norms."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    bias = bool(cfg.get("attention_bias", False))
    _linear(out, f"{name}.self_attn.q_proj", hidden, heads * head_dim, bias)
    _linear(out, f"{name}.self_attn.k_proj", hidden, kv * head_dim, bias)
    _linear(out, f"{name}.self_attn.v_proj", hidden, kv * head_dim, bias)
    _linear(out, f"{name}.self_attn.o_proj", heads * head_dim, hidden, bias)
    _norm(out, f"{name}.self_attn.q_norm", head_dim)
    _norm(out, f"{name}.self_attn.k_norm", head_dim)
    _linear(out, f"{name}.mlp.gate_proj", hidden, inter, False)
    _linear(out, f"{name}.mlp.up_proj", hidden, inter, False)
    _linear(out, f"{name}.mlp.down_proj", inter, hidden, False)
    _norm(out, f"{name}.input_layernorm", hidden)
    _norm(out, f"{name}.post_attention_layernorm", hidden)


def talker_layout(talker: dict[str, Any]) -> Layout:
    """``talker.*``: the Talker backbone, its embeddings and heads, and the code predictor."""
    out: Layout = {}
    hidden, text_hidden = talker["hidden_size"], talker["text_hidden_size"]
    groups = talker["num_code_groups"]
    out["talker.model.codec_embedding.weight"] = TensorSpec((talker["vocab_size"], hidden), ("normal", EMBED_STD))
    out["talker.model.text_embedding.weight"] = TensorSpec(
        (talker["text_vocab_size"], text_hidden), ("normal", EMBED_STD)
    )
    for i in range(talker["num_hidden_layers"]):
        _qwen3_decoder_layer(out, f"talker.model.layers.{i}", talker)
    _norm(out, "talker.model.norm", hidden)
    _linear(out, "talker.text_projection.linear_fc1", text_hidden, text_hidden, True)
    _linear(out, "talker.text_projection.linear_fc2", text_hidden, hidden, True)
    _linear(out, "talker.codec_head", hidden, talker["vocab_size"], False, gain=HEAD_GAIN)

    predictor = talker["code_predictor_config"]
    p_hidden, p_vocab = predictor["hidden_size"], predictor["vocab_size"]
    for i in range(predictor["num_hidden_layers"]):
        _qwen3_decoder_layer(out, f"talker.code_predictor.model.layers.{i}", predictor)
    _norm(out, "talker.code_predictor.model.norm", p_hidden)
    for g in range(groups - 1):  # groups 1..15: their input embeddings live in the Talker's width
        out[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = TensorSpec(
            (p_vocab, hidden), ("normal", EMBED_STD)
        )
        _linear(out, f"talker.code_predictor.lm_head.{g}", p_hidden, p_vocab, False, gain=HEAD_GAIN)
    if p_hidden != hidden:  # the official model uses an identity when the widths agree (0.6B)
        _linear(out, "talker.code_predictor.small_to_mtp_projection", hidden, p_hidden, True)
    return out


def speaker_encoder_layout(cfg: dict[str, Any]) -> Layout:
    """``speaker_encoder.*``: ECAPA-TDNN (TDNN, SE-Res2Net blocks, aggregation, attentive pooling, fc)."""
    out: Layout = {}
    channels, kernels = cfg["enc_channels"], cfg["enc_kernel_sizes"]
    scale, se, att = cfg["enc_res2net_scale"], cfg["enc_se_channels"], cfg["enc_attention_channels"]
    _conv(out, "speaker_encoder.blocks.0.conv", cfg["mel_dim"], channels[0], kernels[0])
    for i in range(1, len(channels) - 1):
        name, c_in, c = f"speaker_encoder.blocks.{i}", channels[i - 1], channels[i]
        _conv(out, f"{name}.tdnn1.conv", c_in, c, 1)
        for j in range(scale - 1):
            _conv(out, f"{name}.res2net_block.blocks.{j}.conv", c // scale, c // scale, kernels[i])
        _conv(out, f"{name}.tdnn2.conv", c, c, 1)
        _conv(out, f"{name}.se_block.conv1", c, se, 1)
        _conv(out, f"{name}.se_block.conv2", se, c, 1)
    last = channels[-1]
    _conv(out, "speaker_encoder.mfa.conv", last, last, kernels[-1])
    _conv(out, "speaker_encoder.asp.tdnn.conv", last * 3, att, 1)
    _conv(out, "speaker_encoder.asp.conv", att, last, 1)
    _conv(out, "speaker_encoder.fc", last * 2, cfg["enc_dim"], 1)
    return out


def model_layout(config: dict[str, Any]) -> Layout:
    """Every key of the top-level ``model.safetensors`` for a Qwen3-TTS ``config.json``."""
    out = talker_layout(config["talker_config"])
    if config["tts_model_type"] == "base":  # only Base carries the x-vector speaker encoder
        out.update(speaker_encoder_layout(config["speaker_encoder_config"]))
    return out


def _mimi_encoder_layout(enc: dict[str, Any]) -> Layout:
    """``encoder.*``: the Mimi encoder that the 12 Hz tokenizer keeps (SEANet, transformer, downsample, split RVQ)."""
    out: Layout = {}
    filters, kernel = enc["num_filters"], enc["kernel_size"]
    _conv(out, "encoder.encoder.layers.0.conv", enc["audio_channels"], filters, kernel)
    index, scaling = 1, 1
    for ratio in reversed(enc["upsampling_ratios"]):
        dim = scaling * filters
        for j in range(enc["num_residual_layers"]):
            hidden = dim // enc["compress"]
            _conv(out, f"encoder.encoder.layers.{index}.block.1.conv", dim, hidden, enc["residual_kernel_size"])
            _conv(out, f"encoder.encoder.layers.{index}.block.3.conv", hidden, dim, 1)
            index += 1
        index += 1  # the ELU before the downsampling conv
        _conv(out, f"encoder.encoder.layers.{index}.conv", dim, dim * 2, ratio * 2)
        index += 1
        scaling *= 2
    index += 1  # the final ELU
    _conv(out, f"encoder.encoder.layers.{index}.conv", scaling * filters, enc["hidden_size"], enc["last_kernel_size"])

    hidden, inter = enc["hidden_size"], enc["intermediate_size"]
    heads, kv, head_dim = enc["num_attention_heads"], enc["num_key_value_heads"], enc["head_dim"]
    bias = bool(enc.get("attention_bias", False))
    for i in range(enc["num_hidden_layers"]):
        name = f"encoder.encoder_transformer.layers.{i}"
        _linear(out, f"{name}.self_attn.q_proj", hidden, heads * head_dim, bias)
        _linear(out, f"{name}.self_attn.k_proj", hidden, kv * head_dim, bias)
        _linear(out, f"{name}.self_attn.v_proj", hidden, kv * head_dim, bias)
        _linear(out, f"{name}.self_attn.o_proj", heads * head_dim, hidden, bias)
        _linear(out, f"{name}.mlp.fc1", hidden, inter, False)
        _linear(out, f"{name}.mlp.fc2", inter, hidden, False)
        _norm(out, f"{name}.input_layernorm", hidden, bias=True)
        _norm(out, f"{name}.post_attention_layernorm", hidden, bias=True)
        out[f"{name}.self_attn_layer_scale.scale"] = _fill((hidden,), enc["layer_scale_initial_scale"])
        out[f"{name}.mlp_layer_scale.scale"] = _fill((hidden,), enc["layer_scale_initial_scale"])
    frames_per_encodec_frame = enc["sampling_rate"] / _prod(enc["upsampling_ratios"]) / enc["_frame_rate"]
    _conv(out, "encoder.downsample.conv", hidden, hidden, 2 * int(frames_per_encodec_frame), bias=False)

    vq_dim, code_dim, size = enc["vector_quantization_hidden_dimension"], enc["codebook_dim"], enc["codebook_size"]
    semantic = enc["num_semantic_quantizers"]
    for part, count in (("semantic", semantic), ("acoustic", enc["num_quantizers"] - semantic)):
        name = f"encoder.quantizer.{part}_residual_vector_quantizer"
        for q in range(count):
            out[f"{name}.layers.{q}.codebook.initialized"] = _fill((1,), 1.0)
            out[f"{name}.layers.{q}.codebook.cluster_usage"] = _fill((size,), 1.0)
            out[f"{name}.layers.{q}.codebook.embed_sum"] = TensorSpec((size, code_dim), ("normal", EMBED_STD))
        if vq_dim != hidden:
            _conv(out, f"{name}.input_proj", hidden, vq_dim, 1, bias=False)
            _conv(out, f"{name}.output_proj", vq_dim, hidden, 1, bias=False)
    return out


def _codec_decoder_layout(dec: dict[str, Any]) -> Layout:
    """``decoder.*``: split RVQ, causal pre-conv, sliding-window transformer, ConvNeXt upsampler, SnakeBeta vocoder."""
    out: Layout = {}
    code_dim, latent, hidden = dec["codebook_dim"], dec["latent_dim"], dec["hidden_size"]
    half = code_dim // 2
    for part, count in (("rvq_first", 1), ("rvq_rest", dec["num_quantizers"] - 1)):
        name = f"decoder.quantizer.{part}"
        _conv(out, f"{name}.input_proj", code_dim, half, 1, bias=False)
        _conv(out, f"{name}.output_proj", half, code_dim, 1, bias=False)
        for q in range(count):
            out[f"{name}.vq.layers.{q}._codebook.cluster_usage"] = _fill((dec["codebook_size"],), 1.0)
            out[f"{name}.vq.layers.{q}._codebook.embedding_sum"] = TensorSpec(
                (dec["codebook_size"], half), ("normal", EMBED_STD)
            )
    _conv(out, "decoder.pre_conv.conv", code_dim, latent, 3)

    heads, kv, head_dim, inter = (
        dec["num_attention_heads"], dec["num_key_value_heads"], dec["head_dim"], dec["intermediate_size"]
    )
    bias = bool(dec.get("attention_bias", False))
    _linear(out, "decoder.pre_transformer.input_proj", latent, hidden, True)
    _linear(out, "decoder.pre_transformer.output_proj", hidden, latent, True)
    for i in range(dec["num_hidden_layers"]):
        name = f"decoder.pre_transformer.layers.{i}"
        _linear(out, f"{name}.self_attn.q_proj", hidden, heads * head_dim, bias)
        _linear(out, f"{name}.self_attn.k_proj", hidden, kv * head_dim, bias)
        _linear(out, f"{name}.self_attn.v_proj", hidden, kv * head_dim, bias)
        _linear(out, f"{name}.self_attn.o_proj", heads * head_dim, hidden, bias)
        _linear(out, f"{name}.mlp.gate_proj", hidden, inter, False)
        _linear(out, f"{name}.mlp.up_proj", hidden, inter, False)
        _linear(out, f"{name}.mlp.down_proj", inter, hidden, False)
        _norm(out, f"{name}.input_layernorm", hidden)
        _norm(out, f"{name}.post_attention_layernorm", hidden)
        out[f"{name}.self_attn_layer_scale.scale"] = _fill((hidden,), dec["layer_scale_initial_scale"])
        out[f"{name}.mlp_layer_scale.scale"] = _fill((hidden,), dec["layer_scale_initial_scale"])
    _norm(out, "decoder.pre_transformer.norm", hidden)

    for k, factor in enumerate(dec["upsampling_ratios"]):
        _conv_transpose(out, f"decoder.upsample.{k}.0.conv", latent, latent, factor, factor)
        name = f"decoder.upsample.{k}.1"
        _conv(out, f"{name}.dwconv.conv", latent, latent, 7, groups=latent)
        _norm(out, f"{name}.norm", latent, bias=True)
        _linear(out, f"{name}.pwconv1", latent, 4 * latent, True)
        _linear(out, f"{name}.pwconv2", 4 * latent, latent, True)
        out[f"{name}.gamma"] = _fill((latent,), CONVNEXT_GAMMA)

    decoder_dim, rates = dec["decoder_dim"], dec["upsample_rates"]
    _conv(out, "decoder.decoder.0.conv", latent, decoder_dim, 7)
    for i, rate in enumerate(rates):
        name, c_in, c_out = f"decoder.decoder.{i + 1}.block", decoder_dim // 2**i, decoder_dim // 2 ** (i + 1)
        out[f"{name}.0.alpha"] = _fill((c_in,), 0.0)
        out[f"{name}.0.beta"] = _fill((c_in,), 0.0)
        _conv_transpose(out, f"{name}.1.conv", c_in, c_out, 2 * rate, rate)
        for u in range(3):  # residual units at dilations 1, 3, 9
            unit = f"{name}.{u + 2}"
            for act in ("act1", "act2"):
                out[f"{unit}.{act}.alpha"] = _fill((c_out,), 0.0)
                out[f"{unit}.{act}.beta"] = _fill((c_out,), 0.0)
            _conv(out, f"{unit}.conv1.conv", c_out, c_out, 7, gain=RESIDUAL_UNIT_GAIN)
            _conv(out, f"{unit}.conv2.conv", c_out, c_out, 1, gain=RESIDUAL_UNIT_GAIN)
    last = decoder_dim // 2 ** len(rates)
    tail = len(rates) + 1
    out[f"decoder.decoder.{tail}.alpha"] = _fill((last,), 0.0)
    out[f"decoder.decoder.{tail}.beta"] = _fill((last,), 0.0)
    _conv(out, f"decoder.decoder.{tail + 1}.conv", last, 1, 7, gain=WAVE_OUT_GAIN)
    return out


def speech_tokenizer_layout(config: dict[str, Any]) -> Layout:
    """Every key of ``speech_tokenizer/model.safetensors`` (encoder and decoder of the 12 Hz tokenizer)."""
    out = _mimi_encoder_layout(config["encoder_config"])
    out.update(_codec_decoder_layout(config["decoder_config"]))
    return out


def _prod(values: list[int]) -> int:
    result = 1
    for v in values:
        result *= v
    return result
