"""Stateful streaming decode of S2 Pro's codec: each call decodes only a stream's new frames, carrying its state.

The codec's decode is causal, so a stream's samples equal the one-shot decode's when each call carries, per stream:
`post_module`'s last `window - 1` keys and values per layer (rotated at the stream's absolute frame positions, as the
one-shot decode rotates them: its bfloat16-rounded rotary table depends only on the position), each stride-1 causal
convolution's last `(kernel - 1) * dilation` input samples (the ConvNeXt blocks' depthwise ones included; the first
call's are zeros, the one-shot's left padding) and each transposed convolution's overlap tail (kernel - stride outputs
still waiting for the next input's). Trim 0: every call yields `n * 2048` samples. The carried state of the open
streams sits in the shared `StateStore` (one row per slot), walked in forward order by the shared `StateWalk`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.engine.cuda_graphs import GraphCache
from omni_ray.models.s2_pro.codec import S2ProCodec
from omni_ray.models.s2_pro.codec_blocks import (
    CausalConv,
    CausalConvTranspose,
    ConvNeXtBlock,
    ResidualUnit,
    WindowedTransformer,
    rotary_table,
)
from omni_ray.vocoder.code2wav_state import State, StateStore, StateWalk
from omni_ray.vocoder.convolutions import conv1d, conv_transpose1d

__all__ = ["StatefulS2ProCodec", "StatefulS2ProDecoder"]


class StatefulS2ProDecoder:
    """`step(codes, positions, state)` for a batch of streams that each bring `n` new frames (the same `n`).

    `positions[b]` is how many frames stream b has decoded before; `state` is None for streams on their first call
    (all rows of a call agree), else the `State` the previous call returned for those rows (rows stacked)."""

    def __init__(self, codec: S2ProCodec) -> None:
        self.codec = codec
        self.transformer: WindowedTransformer = codec.quantizer.post_module
        if self.transformer.window is None:
            raise ValueError("streaming needs a windowed post_module")
        self.window = int(self.transformer.window)
        self._table = torch.zeros(0)

    @torch.inference_mode()
    def step(self, codes: torch.Tensor, positions: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        """codes [B, 10, n] → (samples [B, n × 2048], the state to carry)."""
        walk = StateWalk(state)
        quantizer = self.codec.quantizer
        codes = self.codec.clamped(codes)
        latent = quantizer.semantic_quantizer.decode(codes[:, :1]) + quantizer.quantizer.decode(codes[:, 1:])
        x = self._transformer(latent, positions.to(latent.device), walk)
        x = self._run(quantizer.upsample, x, walk)
        return self._run(self.codec.decoder.model, x, walk)[:, 0], walk.outgoing

    # ---- post_module: windowed attention over the carried keys and values ------------------------------------
    def _rotary(self, length: int, device: torch.device) -> torch.Tensor:
        """The rotary table of positions 0..length-1 (at least), grown by doubling and kept."""
        if self._table.shape[0] < length or self._table.device != device:
            size = max(length, 2 * self._table.shape[0], 1024)
            self._table = rotary_table(size, self.transformer.head_dim, self.transformer.rope_base).to(device)
        return self._table

    def _transformer(self, x: torch.Tensor, positions: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        model = self.transformer
        hidden = model.input_proj(x.transpose(1, 2))  # [B, n, D]
        rows, new = hidden.shape[:2]
        query_pos = positions[:, None] + torch.arange(new, device=hidden.device)  # [B, n]
        table = self._rotary(int(query_pos.max()) + 1, hidden.device)[query_pos]  # [B, n, D/2, 2]
        past = self.window - 1
        key_pos = positions[:, None] - past + torch.arange(past + new, device=hidden.device)  # [B, past + n]
        relative = query_pos[:, :, None] - key_pos[:, None, :]
        mask = ((relative >= 0) & (relative < self.window) & (key_pos[:, None, :] >= 0))[:, None]  # [B, 1, n, p+n]
        for layer in model.layers:
            attention = layer.attention
            normed = layer.attention_norm(hidden)
            shape = (rows, new, attention.heads, attention.head_dim)
            q, k, v = (part.view(shape) for part in attention.wqkv(normed).chunk(3, dim=-1))
            q, k = _rotate(q, table).transpose(1, 2), _rotate(k, table).transpose(1, 2)  # [B, H, n, hd]
            v = v.transpose(1, 2)
            keys = torch.cat([walk.take(k.transpose(2, 3), past).transpose(2, 3), k], dim=2)
            values = torch.cat([walk.take(v.transpose(2, 3), past).transpose(2, 3), v], dim=2)
            walk.keep(keys[:, :, -past:].transpose(2, 3))
            walk.keep(values[:, :, -past:].transpose(2, 3))
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            out = attention.wo(out.transpose(1, 2).reshape(rows, new, -1))
            hidden = hidden + layer.attention_layer_scale(out)
            hidden = hidden + layer.ffn_layer_scale(layer.feed_forward(layer.ffn_norm(hidden)))
        return model.output_proj(model.norm(hidden)).transpose(1, 2)

    # ---- the convolutional part: upsampler and decoder ---------------------------------------------------------
    def _run(self, module: nn.Module, x: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        """`module`(x) with every convolution carrying its state; the stateless parts run as they are."""
        if isinstance(module, CausalConv):
            return self._causal_conv(module, x, walk)
        if isinstance(module, CausalConvTranspose):
            return self._transposed_conv(module, x, walk)
        if isinstance(module, ConvNeXtBlock):
            h = self._causal_conv(module.dwconv, x, walk).transpose(1, 2)
            h = module.pwconv2(module.act(module.pwconv1(module.norm(h))))
            return x + (module.gamma * h).transpose(1, 2)
        if isinstance(module, ResidualUnit):
            return x + self._run(module.block, x, walk)
        if isinstance(module, nn.Sequential):
            for part in module:
                x = self._run(part, x, walk)
            return x
        inner = getattr(module, "block", None) or getattr(module, "model", None)  # DecoderBlock, Decoder
        if isinstance(inner, nn.Sequential):
            return self._run(inner, x, walk)
        if any(True for _ in module.parameters(recurse=False)) or not any(True for _ in module.children()):
            return module(x)  # Snake, Tanh: sample by sample
        raise TypeError(f"no streaming rule for {type(module).__name__}")

    @staticmethod
    def _causal_conv(op: CausalConv, x: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        """A stride-1 causal convolution: the carried input samples replace the one-shot's left zero padding."""
        if op.conv.stride[0] != 1:
            raise ValueError("streaming needs stride-1 causal convolutions")
        if op.left_pad == 0:
            return conv1d(x, op.conv)
        padded = torch.cat([walk.take(x, op.left_pad), x], dim=-1)
        walk.keep(padded[..., -op.left_pad :])
        return conv1d(padded, op.conv)

    @staticmethod
    def _transposed_conv(op: CausalConvTranspose, x: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        """A transposed convolution: the previous call's overlap tail is added to this call's head, and this call's
        tail (the outputs the next input still adds to) carried, before the bias."""
        stride = op.conv.stride[0]
        overlap = op.conv.kernel_size[0] - stride
        full = conv_transpose1d(x, op.conv)  # [B, C, n * stride + overlap], no bias
        ready = x.shape[-1] * stride
        if overlap > 0:
            full[..., :overlap] += walk.take(full, overlap)
            walk.keep(full[..., ready:])
        out = full[..., :ready]
        return out + op.conv.bias[:, None] if op.conv.bias is not None else out


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`codec_blocks.apply_rotary` with a table per row: x [B, n, H, D], table [B, n, D/2, 2]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(3).type_as(x)


class StatefulS2ProCodec:
    """The shared vocoder's stateful batch decoder (`StatefulBatchDecoder`) over `S2ProCodec`, eager: [B, 10, n] new
    frames of the streams in `slots` → [B, n × 2048] float32 host samples. Each open stream holds a slot of a
    `StateStore` (`max_streams` at once, plus a scratch slot)."""

    trim = 0

    def __init__(self, codec: S2ProCodec, max_streams: int) -> None:
        self.codec = codec
        self.num_quantizers = codec.num_quantizers
        self.samples_per_frame = codec.samples_per_frame
        self.sample_rate = codec.sample_rate
        self.device = next(codec.parameters()).device
        self.graphs = GraphCache(self.device, False)
        self.stream = None
        self.decoder = StatefulS2ProDecoder(codec)
        self.states = self._state_store(max_streams)

    def _state_store(self, capacity: int) -> StateStore:
        """Rows shaped after one stream's state (learnt from a one-frame step)."""
        codes = torch.zeros(1, self.num_quantizers, 1, dtype=torch.long, device=self.device)
        _, state = self.decoder.step(codes, torch.zeros(1, dtype=torch.long), None)
        dtype = next(self.codec.parameters()).dtype
        return StateStore([tuple(t.shape[1:]) for t in state], dtype, self.device, capacity)

    def open_stream(self) -> int:
        return self.states.allocate()

    def close_stream(self, slot: int) -> None:
        self.states.release(slot)

    def copy_state_out(self, slot: int) -> torch.Tensor:
        return self.states.buffer[slot].clone()

    def copy_state_in(self, slot: int, state: torch.Tensor) -> None:
        self.states.buffer[slot].copy_(state)

    def step_batch(self, codes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, first: bool) -> torch.Tensor:
        """Stateful decode of [B, 10, n] new frames for the streams in `slots`, each `positions[b]` frames in (`first`:
        every row's first call, which starts from zero state)."""
        slots = slots.to(self.device)
        with torch.inference_mode():
            wav, state = self.decoder.step(codes.to(self.device), positions.to(self.device),
                                           None if first else self.states.gather(slots))
            self.states.scatter(slots, state)
            return wav.to(device="cpu", dtype=torch.float32)

    def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor:
        """One stream's call (`StatefulCodec`): codes [10, n] → n × 2048 samples."""
        return self.step_batch(codes[None], torch.tensor([position]), torch.tensor([slot]), first)[0]

    def warmup(self, window_lengths: Sequence[int], max_rows: int, step_shapes: Sequence[Any] = ()) -> None:
        """One one-frame step on the scratch slot: eager decoding has no shapes to capture."""
        scratch = torch.tensor([self.states.scratch_slot])
        self.step_batch(torch.zeros(1, self.num_quantizers, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                        scratch, True)
