"""The layers S2 Pro's codec (a modified DAC) is built from: causal convolutions, Snake, residual units, ConvNeXt
blocks, the windowed causal transformer and the residual vector quantizers.

Parameter names follow the official `codec.pth` (after `omni_ray.models.s2_pro.codec.read_codec_state` has folded
its weight norms): a convolution's weight sits under `conv.` inside its causal wrapper, a quantizer's projections are
plain 1×1 convolutions, a transformer layer's parts are `attention.wqkv`, `attention.wo`, `feed_forward.w1/w2/w3`,
`attention_norm`, `ffn_norm` and the layer scales' `gamma`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.vocoder.convolutions import conv1d, conv_transpose1d


class Snake(nn.Module):
    """x + sin²(αx) / α per channel (α learnt, [1, C, 1])."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class CausalConv(nn.Module):
    """A convolution that sees only the past: padded on the left by its span minus its stride, and on the right up to
    a whole number of strides. `weight_normed` tells how the official checkpoint stores its weight (as a weight
    norm's magnitude and direction; `codec.pth` folding and `checkpoint.py` writing read it)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, weight_normed: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups)
        self.weight_normed = weight_normed
        self.left_pad = (kernel_size - 1) * dilation + 1 - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stride = self.conv.stride[0]
        x = F.pad(x, (self.left_pad, (-x.shape[-1]) % stride))
        return conv1d(x, self.conv)


class CausalConvTranspose(nn.Module):
    """A transposed convolution whose overlap into the next input's samples is cut on the right: T inputs give
    exactly T * stride outputs, each from its own input and the one before."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 weight_normed: bool = True) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.weight_normed = weight_normed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = conv_transpose1d(x, self.conv)
        out = out[..., : x.shape[-1] * self.conv.stride[0]]
        return out + self.conv.bias[:, None] if self.conv.bias is not None else out


class ResidualUnit(nn.Module):
    """x + conv1x1(Snake(causal conv k7, dilated(Snake(x))))."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(Snake(channels), CausalConv(channels, channels, 7, dilation=dilation),
                                   Snake(channels), CausalConv(channels, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class ConvNeXtBlock(nn.Module):
    """A causal depthwise k7 convolution, LayerNorm, a GELU MLP (4× wide) and a learnt per-channel scale, added to
    the input."""

    def __init__(self, dim: int, kernel_size: int = 7, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, kernel_size, groups=dim, weight_normed=False)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, int(mlp_ratio * dim))
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(int(mlp_ratio * dim), dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class RMSNorm(nn.Module):
    """RMS normalisation in float32, then the learnt scale in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerScale(nn.Module):
    """A learnt per-channel scale (`gamma`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


def rotary_table(length: int, head_dim: int, base: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[length, head_dim / 2, 2] (cos, sin) of positions 0..length-1, rounded to `dtype` as the codec was trained
    (bfloat16), returned in float32."""
    inverse = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inverse)
    unit = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([unit.real, unit.imag], dim=-1).to(dtype).float()


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each interleaved pair (2i, 2i + 1) of x [B, T, H, D] by its position's angle, in float32."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(3).type_as(x)


def window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[length, length] boolean: query i attends to keys i - window + 1 .. i (all earlier keys if window is None)."""
    positions = torch.arange(length, device=device)
    offset = positions[:, None] - positions[None, :]
    allowed = offset >= 0
    return allowed & (offset < window) if window is not None else allowed


class Attention(nn.Module):
    """Multi-head attention from one fused qkv projection (as many key/value heads as query heads), interleaved
    rotary positions on queries and keys."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wqkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (part.view(batch, length, self.heads, self.head_dim) for part in self.wqkv(x).chunk(3, dim=-1))
        q, k = apply_rotary(q, table), apply_rotary(k, table)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerLayer(nn.Module):
    """Pre-norm attention and feed-forward, each scaled (LayerScale) before its residual add."""

    def __init__(self, dim: int, heads: int, head_dim: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.attention = Attention(dim, heads, head_dim)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def forward(self, x: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention_layer_scale(self.attention(self.attention_norm(x), table, mask))
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowedTransformer(nn.Module):
    """A causal transformer over [B, C, T] (channels first in and out) whose queries see at most `window` steps
    (themselves included); positions count from the first step of the input. Linear projections in and out where
    its width differs from the input's."""

    def __init__(self, input_dim: int, dim: int, layers: int, heads: int, head_dim: int, hidden: int,
                 window: int | None, rope_base: float, eps: float) -> None:
        super().__init__()
        self.window, self.head_dim, self.rope_base = window, head_dim, rope_base
        self.input_proj: nn.Module = nn.Linear(input_dim, dim) if input_dim != dim else nn.Identity()
        self.output_proj: nn.Module = nn.Linear(dim, input_dim) if input_dim != dim else nn.Identity()
        self.layers = nn.ModuleList(TransformerLayer(dim, heads, head_dim, hidden, eps) for _ in range(layers))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x.transpose(1, 2))
        length = h.shape[1]
        table = rotary_table(length, self.head_dim, self.rope_base).to(h.device)
        mask = window_mask(length, self.window, h.device)
        for layer in self.layers:
            h = layer(h, table, mask)
        return self.output_proj(self.norm(h)).transpose(1, 2)


class VectorQuantizer(nn.Module):
    """One codebook: a 1×1 projection down to the code space, the nearest code by cosine (both sides L2-normalised),
    and the code's (unnormalised) row projected back up."""

    def __init__(self, input_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Conv1d(input_dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, input_dim, 1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z [B, C, T] → (codes [B, T], their reconstruction [B, C, T]). The code's row enters the projection up as
        z_e + (row - z_e), z_e being the projection down: the value the codec was trained with, which can differ from
        the row in its last bit and so tip the next codebook's choice."""
        projected = self.in_proj(z)
        latents = F.normalize(projected.transpose(1, 2).reshape(-1, self.codebook.embedding_dim))
        codebook = F.normalize(self.codebook.weight)
        distance = (latents.pow(2).sum(1, keepdim=True) - 2 * latents @ codebook.t()
                    + codebook.pow(2).sum(1, keepdim=True).t())
        codes = (-distance).max(1)[1].view(z.shape[0], z.shape[2])
        rows = self.codebook(codes).transpose(1, 2)
        return codes, self.out_proj(projected + (rows - projected))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] → [B, C, T]."""
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class ResidualQuantizer(nn.Module):
    """Codebooks applied in turn, each to what the ones before left unexplained."""

    def __init__(self, input_dim: int, codebooks: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.codebook_size = codebook_size
        self.quantizers = nn.ModuleList(VectorQuantizer(input_dim, codebook_size, codebook_dim)
                                        for _ in range(codebooks))

    def encode(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z [B, C, T] → (codes [B, N, T], their reconstruction [B, C, T])."""
        residual, total, codes = z, torch.zeros_like(z), []
        for quantizer in self.quantizers:
            code, quantized = quantizer.quantize(residual)
            total, residual = total + quantized, residual - quantized
            codes.append(code)
        return torch.stack(codes, dim=1), total

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, N, T] → the sum of each codebook's reconstruction [B, C, T]."""
        out = self.quantizers[0].decode(codes[:, 0])
        for index in range(1, codes.shape[1]):
            out = out + self.quantizers[index].decode(codes[:, index])
        return out
