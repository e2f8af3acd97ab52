"""RMSNorm, gated MLP and (multimodal) rotary embeddings shared by all backbones."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Qwen models do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # exactly transformers' order: normalise, then scale
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.variance_epsilon)
        # Half precision: one fused kernel on CUDA that accumulates in fp32 and scales before rounding (transformers
        # rounds, then scales: a last-bit difference), instead of four (upcast, norm, downcast, scale).
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.variance_epsilon)


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One weight [sum(out), in] holding every (bias-free) linear's rows, so one GEMM computes them all; each
    linear's own weight becomes a view into it (no second copy of the weights)."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """gate and up in one GEMM."""
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ResizeMLP(nn.Module):
    """Two biased linears with SiLU between: projects one model's width onto another's."""

    def __init__(self, in_size: int, intermediate_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(intermediate_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class RotaryEmbedding(nn.Module):
    """RoPE tables; with `mrope_section` it interleaves temporal/height/width frequencies (Qwen3 M-RoPE); with
    `table_dtype`, cos and sin are rounded to it before they take the model's dtype (a model trained with rounded
    tables, as S2 Pro's bfloat16 ones, needs the same rounding in every dtype)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int] | None = None,
                 table_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.table_dtype = table_dtype
        self.register_buffer("inv_freq", self._frequencies(torch.device("cpu")), persistent=False)
        self.mrope_section = list(mrope_section) if mrope_section else None

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))

    def _apply(self, fn: Any, recurse: bool = True) -> "RotaryEmbedding":
        """Moves keep the frequencies in float32 (a cast of the model to bfloat16 would round them, and the angles of
        late positions with them), as transformers' models keep theirs."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._frequencies(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [..., N] (1-D rope) or [3, ..., N] (M-RoPE). Returns cos, sin of shape [..., N, head_dim]."""
        inv = self.inv_freq
        if self.mrope_section is None:
            freqs = positions.to(torch.float32).unsqueeze(-1) * inv
        else:
            per_axis = positions.to(torch.float32).unsqueeze(-1) * inv  # [3, ..., N, D/2]
            freqs = per_axis[0].clone()
            for axis in (1, 2):
                idx = slice(axis, self.mrope_section[axis] * 3, 3)
                freqs[..., idx] = per_axis[axis][..., idx]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.table_dtype is not None:
            cos, sin = cos.to(self.table_dtype), sin.to(self.table_dtype)
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]; cos/sin: [B, T, D]."""
    cos = cos.unsqueeze(2)
    sin = sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin
