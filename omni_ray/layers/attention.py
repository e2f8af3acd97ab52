"""Causal self-attention over a slot-based KV cache, batched with per-request positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN attention rebuilds its plan whenever the masked key length changes (every decode step): ~1.4 ms of host
# time per call on an H200. The memory-efficient kernel takes the same boolean mask without that cost.
SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
# A prefill from position 0 needs no mask, only causality: the flash kernel takes it. (With a boolean mask, the
# pointwise kernel before the memory-efficient one took 230 us per Thinker layer for 32 prompts on an H200.)
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

from omni_ray.layers.basic import RMSNorm, apply_rotary, fuse_linears

# Up to this many keys, attention is plain broadcasts and sums (`small_key_attention`), which inductor can fuse with
# the ops around it inside a compiled layer; the memory-efficient kernel took 12.5 us per call on an H200 for the code
# predictor's at most 17 keys (75 calls per Talker frame).
SMALL_KEY_ATTENTION_MAX_KEYS = 32


def small_key_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention in fp32 without a GEMM or an attention kernel. q [B, H, Q, D]; keys, values [B, H, K, D];
    mask [B, 1 or H, Q, K] bool, True = attend. A row that may attend nowhere gets the mean of the values, not NaN."""
    scores = (q.float()[:, :, :, None, :] * keys.float()[:, :, None, :, :]).sum(-1) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~mask, torch.finfo(torch.float32).min).softmax(-1)  # [B, H, Q, K]
    return (weights[..., None] * values.float()[:, :, None, :, :]).sum(-2).to(q.dtype)


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """A prefill's attention over its own keys: q [B, T, H, D], k and v [B, T, H/group, D] → [B, T, H, D], causal.
    K/V are repeated per query head so that every fused kernel (flash first) takes it; a row's padding comes after
    its tokens, so causality alone keeps it out of them."""
    k, v = (t.repeat_interleave(group, dim=2) if group > 1 else t for t in (k, v))
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), is_causal=True
        )
    return out.transpose(1, 2)


@dataclass
class AttentionBatch:
    """Where a step's tokens live in the KV cache: B rows of T new tokens each.

    Row b writes its T tokens at cache positions starts[b] .. starts[b]+T-1 of cache slot slots[b] and attends
    causally to everything before them in that slot. Keys are read over a fixed range of `kv_len` positions, and the
    mask hides what lies past each row's own length, so every shape is static for a given (B, T, kv_len): the same
    code is captured in a CUDA graph.
    """

    slots: torch.Tensor  # [B] long
    num_tokens: int
    kv_len: int
    mask: torch.Tensor  # [B, 1, T, kv_len] bool, True = attend
    write_index: torch.Tensor  # [B, T] long cache positions
    rows_are_slots: bool = False  # row b is slot b: keys are read as a view of the cache's first B slots
    from_zero: bool = False  # every row writes from position 0 and kv_len == num_tokens: the keys are the step's own
    _grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask for queries folded as [B, kv_heads, group*T, D] (query row g*T + t uses row t); built once."""
        if group not in self._grouped_masks:
            self._grouped_masks[group] = self.mask.repeat(1, 1, group, 1) if group > 1 else self.mask
        return self._grouped_masks[group]

    @classmethod
    def build(cls, slots: list[int], starts: list[int], num_tokens: int, device: torch.device) -> "AttentionBatch":
        """From host lists; kv_len is the smallest range that covers every row."""
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        return cls.from_tensors(slot_t, start_t, num_tokens, max(starts) + num_tokens)

    @classmethod
    def from_tensors(
        cls, slots: torch.Tensor, starts: torch.Tensor, num_tokens: int, kv_len: int, rows_are_slots: bool = False
    ) -> "AttentionBatch":
        """From device tensors, with no host sync (graph-capturable). kv_len must cover max(starts) + num_tokens,
        except for rows writing past it (their keys are garbage nobody reads). `rows_are_slots`: slots == arange(B)."""
        offsets = torch.arange(num_tokens, device=starts.device)
        write_index = starts[:, None] + offsets[None, :]
        key_pos = torch.arange(kv_len, device=starts.device)
        mask = key_pos[None, None, :] <= write_index[:, :, None]
        return cls(slots, num_tokens, kv_len, mask[:, None], write_index, rows_are_slots)

    @classmethod
    def prefill(cls, slots: torch.Tensor, num_tokens: int) -> "AttentionBatch":
        """Whole prompts written from position 0 of their slots (right-padded to `num_tokens`): attention is causal
        over the step's own keys, with no mask and no cache read."""
        write_index = torch.arange(num_tokens, device=slots.device)[None].expand(slots.shape[0], -1)
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=slots.device).expand(slots.shape[0], 1, num_tokens, num_tokens)
        return cls(slots, num_tokens, num_tokens, mask, write_index, from_zero=True)


class Attention(nn.Module):
    """Qwen3 attention: q/k RMS-normed per head (unless `qk_norm` is false), rotary, grouped-query, KV cache write +
    read."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rms_norm_eps: float, bias: bool = False,
        qk_norm: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps=rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=rms_norm_eps) if qk_norm else None
        self.qkv: torch.Tensor | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """q, k and v in one GEMM (bias-free Qwen3 attention only)."""
        if self.q_proj.bias is None:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv).split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = self._project(x)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        k_cache, v_cache = kv_cache  # [slots, max_len, kv_heads, head_dim]
        # Written through the whole cache tensor, never through a slice of it: inductor turns a write into a view of a
        # graph input into a copy of the whole view and back (O(cache) per layer and step, 54 µs per Thinker layer
        # with 32 slots of 2048 positions on an H200), while a write into the input itself stays a scatter of the new
        # rows.
        rows = torch.arange(bsz, device=x.device)[:, None] if batch.rows_are_slots else batch.slots[:, None]
        k_cache[rows, batch.write_index] = k.to(k_cache.dtype)
        v_cache[rows, batch.write_index] = v.to(v_cache.dtype)
        group = self.num_heads // self.num_kv_heads
        if batch.from_zero:
            return self.o_proj(causal_self_attention(q, k, v, group).reshape(bsz, seq, self.num_heads * self.head_dim))
        if batch.rows_are_slots:  # a view of the first B slots: no gather
            keys, values = k_cache[:bsz, : batch.kv_len], v_cache[:bsz, : batch.kv_len]
        else:
            keys, values = k_cache[batch.slots, : batch.kv_len], v_cache[batch.slots, : batch.kv_len]
        # Grouped-query attention without repeating K/V: each KV head's query heads are folded into its query rows.
        folded = q.transpose(1, 2).reshape(bsz, self.num_kv_heads, group * seq, self.head_dim)
        keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
        if batch.kv_len <= SMALL_KEY_ATTENTION_MAX_KEYS:
            out = small_key_attention(folded, keys, values, batch.grouped_mask(group))
        else:
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=batch.grouped_mask(group))
        out = out.reshape(bsz, self.num_heads, seq, self.head_dim).transpose(1, 2)  # CUDA kernels may return a strided view
        return self.o_proj(out.reshape(bsz, seq, self.num_heads * self.head_dim))
