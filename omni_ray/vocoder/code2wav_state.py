"""Stateful streaming Code2Wav: each call decodes only the new frames, carrying attention and convolution state.

A window decode re-runs `left_context` old frames with every chunk (25 + 8 frames for 8 new ones: about 4× the
work). Code2Wav is causal, so the same samples come from carrying, per stream: the sliding-window attention's last
`window - 1` keys and values per layer, each causal convolution's last `(kernel - 1) * dilation` input samples, and
each transposed convolution's overlap tail (its outputs still waiting for the next input). The output equals a
one-shot decode of every frame so far, sample for sample up to float rounding: the first call of a stream yields
`n * samples_per_frame - trim` samples, every later call `n * samples_per_frame`.

The convolutional part runs with its activations stored channels last (`CHANNELS_LAST`, see `convolutions.py`):
the pre-transformer's output already is, and cuDNN's convolutions then take and give that layout without
converting. The carried state is kept channel by channel (a few samples per channel).

The module is transformers' `Qwen3OmniMoeCode2Wav`; its weights and submodules are used as they are.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
    apply_rotary_pos_emb,
)

from omni_ray.errors import CapacityError
from omni_ray.vocoder.convolutions import conv1d, conv_transpose1d, prepare_channels_last
from omni_ray.vocoder.kernels import FusedSnake, add_and_snake, empty_activation, fused_snakes

State = list[torch.Tensor]  # one tensor per stateful op, in forward order, each [rows, ...]
CHANNELS_LAST = True  # the convolutions' activations stored channels last; off: channel by channel (A/B runs)


@dataclass
class _Sum:
    """h + bias (per channel) + residual, not yet added up: the decoder's next op adds it in its own pass
    (`add_and_snake`), writing the sum only where a later op reads it again."""

    h: torch.Tensor
    bias: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        if self.bias is None and self.residual is None:
            return self.h
        total, _ = add_and_snake(self.h, self.bias, self.residual, keep_sum=True)
        assert total is not None
        return total


class StateWalk:
    """Reads a call's incoming state tensors in forward order (zeros on a stream's first call) and collects the
    outgoing ones in the same order."""

    def __init__(self, incoming: State | None) -> None:
        self._incoming: Iterator[torch.Tensor] | None = iter(incoming) if incoming is not None else None
        self.outgoing: State = []

    def take(self, zeros_like: torch.Tensor, length: int) -> torch.Tensor:
        """The state carried into this op: [rows, channels, length] (or zeros shaped after `zeros_like`)."""
        if self._incoming is None:
            return zeros_like.new_zeros(*zeros_like.shape[:-1], length)
        return next(self._incoming)

    def keep(self, state: torch.Tensor) -> None:
        """A view of this call's tensors: whoever keeps the state copies it out (`StateStore.scatter`) before they
        are reused."""
        self.outgoing.append(state)


class StatefulCode2Wav:
    """`step(codes, positions, state)` for a batch of streams that each bring `n` new frames (the same `n`).

    `positions[b]` is how many frames stream b has decoded before; `state` is None for streams on their first call
    (all rows of a call must agree), else the `State` the previous call returned for those rows (rows stacked).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        config = module.config
        self.window = int(config.sliding_window)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.samples_per_frame = int(module.total_upsample)
        self.snakes = fused_snakes(module, Qwen3OmniMoeSnakeBeta)  # each SnakeBeta as one kernel (`kernels.py`)
        prepare_channels_last(module)

    @torch.inference_mode()
    def step(self, codes: torch.Tensor, positions: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        """codes [B, Q, n] → (samples [B, n*spf - (trim on a first call)], the state to carry)."""
        module, walk = self.module, StateWalk(state)
        first = state is None
        hidden = self._embed(codes, walk)  # [B, n, H]
        hidden = self._leave_transformer(self._transformer(hidden, positions, walk))
        x = hidden.transpose(1, 2)  # [B, H, n], channels last
        if not CHANNELS_LAST:  # (not `contiguous()`: at n = 1 it keeps these strides, which read as channels last)
            x = x.clone(memory_format=torch.contiguous_format)
        for upsample, convnext in module.upsample:
            x = self._conv_next(convnext, self._trans_conv(upsample, x, walk, first).tensor(), walk)
        wav = self._run(list(module.decoder), _Sum(x), walk, first).tensor()
        return wav.clamp(min=-1, max=1).flatten(1), walk.outgoing

    # ---- the codec's own ends of the transformer (a subclass's codec may embed and project otherwise) ----------
    def _embed(self, codes: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        """codes [B, Q, n] → the transformer's input [B, n, H]: Code2Wav's codebooks' embeddings, averaged."""
        return self.module.code_embedding(codes + self.module.code_offset).mean(1)

    def _leave_transformer(self, hidden: torch.Tensor) -> torch.Tensor:
        """The transformer's normed output [B, n, H] → the upsampler's input [B, n, C] (Code2Wav: as it is)."""
        return hidden

    # ---- the pre-transformer: sliding-window attention with a key/value cache --------------------------------
    def _transformer(self, hidden: torch.Tensor, positions: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        model = self.module.pre_transformer
        rows, new = hidden.shape[:2]
        query_pos = positions[:, None] + torch.arange(new, device=hidden.device)  # [B, n]
        cos, sin = model.rotary_emb(hidden, query_pos)
        past = self.window - 1
        key_pos = positions[:, None] - past + torch.arange(past + new, device=hidden.device)  # [B, past + n]
        relative = query_pos[:, :, None] - key_pos[:, None, :]
        mask = ((relative >= 0) & (relative < self.window) & (key_pos[:, None, :] >= 0))[:, None]  # [B, 1, n, past+n]
        for layer in model.layers:
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attn.q_proj(normed).view(rows, new, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(normed).view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(normed).view(rows, new, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys = torch.cat([walk.take(k.transpose(2, 3), past).transpose(2, 3), k], dim=2)
            values = torch.cat([walk.take(v.transpose(2, 3), past).transpose(2, 3), v], dim=2)
            walk.keep(keys[:, :, -past:].transpose(2, 3))
            walk.keep(values[:, :, -past:].transpose(2, 3))
            groups = self.heads // self.kv_heads
            if groups > 1:
                keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            out = attn.o_proj(out.transpose(1, 2).reshape(rows, new, -1))
            hidden = hidden + layer.self_attn_layer_scale(out)
            hidden = hidden + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(hidden)))
        return model.norm(hidden)

    # ---- convolutions ----------------------------------------------------------------------------------------
    @staticmethod
    def _causal_conv(op: Qwen3OmniMoeCausalConvNet, x: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        """Stride-1 causal convolution: the carried input samples replace the one-shot's left zero padding. One to a
        single output channel (the decoder's last) runs as `single_output_conv1d`."""
        if op.stride != 1:
            raise ValueError("streaming needs stride-1 causal convolutions")
        if op.padding == 0:
            return conv1d(x, op.conv)
        padded = empty_activation(x.shape[0], x.shape[1], op.padding + x.shape[-1], like=x)
        padded[..., : op.padding].copy_(walk.take(x, op.padding))
        padded[..., op.padding :].copy_(x)
        walk.keep(padded[..., -op.padding :])
        return conv1d(padded, op.conv)

    @staticmethod
    def _snake_then_conv(snake: FusedSnake, x: _Sum, op: Qwen3OmniMoeCausalConvNet, walk: StateWalk,
                         keep_sum: bool) -> tuple[_Sum, torch.Tensor | None]:
        """`op`(snake(x)) as a sum still to add its bias, and x added up if `keep_sum`. The snake is written straight
        after the convolution's carried input samples, in one buffer (no join), by the pass that adds x up."""
        if op.stride != 1:
            raise ValueError("streaming needs stride-1 causal convolutions")
        into = None
        if op.padding:
            carried = walk.take(x.h, op.padding)
            into = empty_activation(x.h.shape[0], x.h.shape[1], op.padding + x.h.shape[-1], like=x.h)
            into[..., : op.padding].copy_(carried)
        total, activated = add_and_snake(x.h, x.bias, x.residual, snake, keep_sum, into)
        assert activated is not None
        if op.padding:
            walk.keep(activated[..., -op.padding :])
        if op.conv.out_channels == 1:  # the decoder's last: its own kernel, bias included
            return _Sum(conv1d(activated, op.conv)), total
        return _Sum(conv1d(activated, op.conv, bias=False), op.conv.bias), total

    @staticmethod
    def _trans_conv(op: Qwen3OmniMoeCausalTransConvNet, x: torch.Tensor, walk: StateWalk, first: bool) -> _Sum:
        """Transposed convolution: the previous call's overlap tail is added to this call's head; the new tail (the
        outputs that still need the next input) is carried. A stream's first call drops `left_pad` samples, as the
        one-shot decode trims them. Its bias is left for the next op's pass to add."""
        stride = op.conv.stride[0]
        overlap = op.conv.kernel_size[0] - stride
        full = conv_transpose1d(x, op.conv)  # [B, C, (n-1)*s + k], no bias yet
        if overlap == 0:
            return _Sum(full, op.conv.bias)
        full[..., :overlap] += walk.take(full, overlap)  # in place: a join copied the whole output (4% of GPU time)
        ready = x.shape[-1] * stride
        walk.keep(full[..., ready:])
        out = full[..., op.left_pad if first else 0 : ready]
        return _Sum(out, op.conv.bias)

    def _conv_next(self, block: Qwen3OmniMoeConvNeXtBlock, x: torch.Tensor, walk: StateWalk) -> torch.Tensor:
        h = self._causal_conv(block.dwconv, x, walk).permute(0, 2, 1)
        h = block.gamma * block.pwconv2(block.act(block.pwconv1(block.norm(h))))
        return x + h.permute(0, 2, 1)

    def _residual_unit(self, unit: Qwen3OmniMoeCode2WavDecoderResidualUnit, x: _Sum, walk: StateWalk) -> _Sum:
        """x + conv2(act2(conv1(act1(x)))), x added up by the pass that runs act1, the result left as a sum."""
        h, total = self._snake_then_conv(self.snakes[id(unit.act1)], x, unit.conv1, walk, keep_sum=True)
        out, _ = self._snake_then_conv(self.snakes[id(unit.act2)], h, unit.conv2, walk, keep_sum=False)
        return _Sum(out.h, out.bias, total)

    def _run(self, parts: list[nn.Module], x: _Sum, walk: StateWalk, first: bool) -> _Sum:
        """The decoder's ops in order on a flowing sum; a SnakeBeta followed by a causal convolution runs with it
        (and with the adds before it), see `_snake_then_conv`."""
        index = 0
        while index < len(parts):
            part = parts[index]
            following = parts[index + 1] if index + 1 < len(parts) else None
            if id(part) in self.snakes and isinstance(following, Qwen3OmniMoeCausalConvNet):
                x, _ = self._snake_then_conv(self.snakes[id(part)], x, following, walk, keep_sum=False)
                index += 2
            else:
                x = self._decoder_block(part, x, walk, first)
                index += 1
        return x

    def _decoder_block(self, block: nn.Module, x: _Sum, walk: StateWalk, first: bool) -> _Sum:
        if isinstance(block, Qwen3OmniMoeCode2WavDecoderBlock):
            return self._run(list(block.block), x, walk, first)
        if isinstance(block, Qwen3OmniMoeCausalConvNet):
            return _Sum(self._causal_conv(block, x.tensor(), walk))
        if isinstance(block, Qwen3OmniMoeCausalTransConvNet):
            return self._trans_conv(block, x.tensor(), walk, first)
        if isinstance(block, Qwen3OmniMoeCode2WavDecoderResidualUnit):
            return self._residual_unit(block, x, walk)
        if id(block) in self.snakes:
            _, activated = add_and_snake(x.h, x.bias, x.residual, self.snakes[id(block)])
            assert activated is not None
            return _Sum(activated)
        return _Sum(block(x.tensor()))


class StateStore:
    """Every open stream's state in one preallocated device buffer, one row (slot) per stream holding each of its
    state tensors in turn, so that a batched step gathers its rows' state in one indexing kernel and scatters the new
    state back with one more, inside the step (one CUDA graph, no per-stream copies; a buffer per state tensor took
    36 kernels each way). The last row is a scratch slot for padding rows."""

    def __init__(self, row_shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, capacity: int) -> None:
        self.capacity = capacity
        self.row_shapes = row_shapes
        self.sizes = [math.prod(shape) for shape in row_shapes]
        self.buffer = torch.zeros(capacity + 1, sum(self.sizes), dtype=dtype, device=device)
        self.scratch_slot = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                raise CapacityError(f"the vocoder holds {self.capacity} streams already (streaming.max_streams)")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            if slot in self._free or not 0 <= slot < self.capacity:
                raise ValueError(f"slot {slot} is not in use")
            self._free.append(slot)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def gather(self, slots: torch.Tensor) -> State:
        """The state of the streams in `slots`: views of one gathered copy of their rows."""
        return self._split(self.buffer[slots])

    def scatter(self, slots: torch.Tensor, state: State) -> None:
        """`state` (one tensor per state op, [rows, ...] each, any strides) into the rows of `slots`."""
        packed = self.buffer.new_empty(slots.shape[0], self.buffer.shape[1])
        for view, rows in zip(self._split(packed), state):
            view.copy_(rows)
        self.buffer.index_copy_(0, slots, packed)

    def _split(self, packed: torch.Tensor) -> State:
        """[rows, total] → each state tensor's view [rows, *shape]."""
        return [part.view(-1, *shape) for part, shape in zip(packed.split(self.sizes, dim=1), self.row_shapes)]

    def bytes_per_stream(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()


__all__: list[Any] = ["State", "StateStore", "StateWalk", "StatefulCode2Wav"]
