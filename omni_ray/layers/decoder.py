"""A Qwen3-style decoder stack (dense or MoE) that runs against a slot KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.layers.attention import Attention, AttentionBatch
from omni_ray.layers.basic import GatedMLP, RMSNorm, RotaryEmbedding
from omni_ray.layers import moe_kernels, persistent_pass, small_batch, small_batch_moe
from omni_ray.layers.moe import SparseMoE


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of a decoder stack, read from a Hugging Face text config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None
    intermediate_size: int
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    always_moe: bool = False  # the Talker uses its MoE block on every layer
    qk_norm: bool = True  # per-head RMSNorm of queries and keys
    rope_table_dtype: torch.dtype | None = None  # cos/sin rounded to it (`RotaryEmbedding.table_dtype`)

    @classmethod
    def from_hf(cls, cfg: Any, always_moe: bool = False) -> "DecoderSpec":
        rope = getattr(cfg, "rope_parameters", None) or {}
        section = rope.get("mrope_section")
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            mrope_section=tuple(section) if section else None,
            intermediate_size=cfg.intermediate_size,
            num_experts=getattr(cfg, "num_experts", 0) or 0,
            top_k=getattr(cfg, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(cfg, "moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)),
            shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
            mlp_only_layers=tuple(getattr(cfg, "mlp_only_layers", None) or ()),
            decoder_sparse_step=getattr(cfg, "decoder_sparse_step", 1) or 1,
            always_moe=always_moe,
        )

    def is_moe_layer(self, index: int) -> bool:
        if self.always_moe:
            return True
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )


class DecoderLayer(nn.Module):
    """Pre-norm attention + feed-forward (dense SwiGLU or sparse MoE) with residuals."""

    def __init__(self, spec: DecoderSpec, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps,
                                   qk_norm=spec.qk_norm)
        self.mlp: nn.Module
        if spec.is_moe_layer(index):
            self.mlp = SparseMoE(
                spec.hidden_size,
                spec.num_experts,
                spec.top_k,
                spec.moe_intermediate_size,
                spec.norm_topk_prob,
                spec.shared_expert_intermediate_size,
            )
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """Layers + final norm. `forward` returns the normed output and the requested intermediate states.

    Intermediate state k follows the Hugging Face `hidden_states` convention: 0 is the input embedding,
    k is the output of layer k, and k == num_layers is the final normed output.
    """

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, list(spec.mrope_section or []) or None,
                                      spec.rope_table_dtype)
        self.small_batch_kernels = False  # see use_small_batch_kernels
        self.moe_layer_kernels = False  # see use_moe_layer_kernels
        self.moe_combine_in_down = False  # the folds of `use_moe_layer_kernels`
        self.moe_route_in_router = False
        self.persistent: persistent_pass.PersistentPass | None = None  # see use_persistent_pass

    def fuse_projections(self) -> None:
        """q/k/v, and gate/up of dense and shared-expert MLPs, each as one weight (one GEMM)."""
        for layer in self.layers:
            if layer.self_attn.qkv is None:
                layer.self_attn.fuse_projections()
            for module in layer.mlp.modules():
                if isinstance(module, GatedMLP) and module.gate_up is None:
                    module.fuse_projections()

    def use_small_batch_kernels(self) -> bool:
        """Run dense layers' steps of a few rows over a few keys as `small_batch.decoder_layer` (five Triton kernels a
        layer) where it applies; other steps run the layers as they are. False (and nothing changes) without Triton, or
        for a stack without q/k norms (the kernels norm queries and keys)."""
        if small_batch.triton is None or not self.spec.qk_norm:
            return False
        self.fuse_projections()
        self.small_batch_kernels = True
        return True

    def use_moe_kernels(self) -> bool:
        """Decode batches' MoE expert GEMMs as `moe_kernels` Triton kernels instead of grouped GEMMs, a shared expert
        among them (`SparseMoE.fold_shared_expert`). Call before `compile_layers`. False (and nothing changes)
        without Triton."""
        if moe_kernels.triton is None:
            return False
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.experts.use_kernels = True
                layer.mlp.fold_shared_expert()
        return True

    def use_moe_layer_kernels(self, folds: bool = False) -> bool:
        """Run MoE layers' decode steps of a few rows as `small_batch_moe.decoder_layer` (eight Triton kernels a
        layer; six with `folds`: the routing inside the router GEMM's kernel, the combine inside the down GEMM's);
        other steps run the layers as they are. Turns the expert kernels on (`use_moe_kernels`). False (and nothing
        changes) without Triton."""
        if small_batch_moe.triton is None or not self.use_moe_kernels():
            return False
        self.fuse_projections()
        self.moe_layer_kernels = True
        self.moe_combine_in_down = self.moe_route_in_router = folds
        return True

    def use_persistent_pass(self, head_rows: int, max_rows: int = persistent_pass.MAX_ROWS,
                            l2_keep_percent: int = 0, draws: bool = False) -> bool:
        """Run `last_logits` over a few rows (at most `max_rows` rows and 32 rows x tokens, 2 tokens a row) as one
        persistent CUDA kernel for heads of `head_rows` rows (`persistent_pass`), built now, asking L2 to keep
        `l2_keep_percent` of its weights from pass to pass; with `draws`, `last_draw` draws the codes in that launch
        too. Other steps run as before. False (and nothing changes) without CUDA or where the kernel does not take
        this stack's shapes."""
        if not torch.cuda.is_available():
            return False
        self.fuse_projections()
        if persistent_pass.unsupported(self) is not None:
            return False
        kernel = persistent_pass.PersistentPass(self, max_rows, l2_keep_percent, draws)
        kernel.build(head_rows)
        self.persistent = kernel
        return True

    def compile_layers(self) -> None:
        """Fewer, larger kernels per layer: q/k/v and gate/up (dense and shared-expert MLPs) each become one GEMM, and
        inductor compiles each layer, fusing the small ops between its GEMMs (norms, rotary, routing, SwiGLU,
        residuals). Every layer shares one compiled graph per shape class (decode, prefill, batch 1): compile time is
        paid once per stack, not per layer. Called before CUDA-graph capture, which then records the fused kernels."""
        if getattr(self, "_layers_compiled", False):  # a second runner over the same model (engine lanes)
            return
        self._layers_compiled = True
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.fuse_projections()
        for layer in self.layers:
            layer.compile(dynamic=True)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        batch: AttentionBatch,
        capture: tuple[int, ...] = (),
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        normed: bool = True,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """embeds [B, T, H]; positions [B, T] or [3, B, T] for M-RoPE. `rope`: their (cos, sin) [B, T, head_dim],
        when the caller has them already (positions are then ignored). `normed=False`: the last layer's output
        without the final norm (`head_logits` applies it)."""
        if rope is not None:
            cos, sin = rope
        else:
            if self.spec.mrope_section is not None and positions.dim() == 2:
                positions = positions.unsqueeze(0).expand(3, -1, -1)
            cos, sin = self.rotary(positions, embeds.dtype)
        if not batch.from_zero:  # a prefill from position 0 needs no mask
            batch.grouped_mask(self.spec.num_heads // self.spec.num_kv_heads)  # built once here, not in each layer
        captured: dict[int, torch.Tensor] = {}
        x = embeds
        if 0 in capture:
            captured[0] = x
        squares = None  # the kernels' partial sums of x's rows' squares, for the next layer's norm
        arrivals = None  # the MoE layer kernels' split-attention counters, one memset for the whole step
        for i, layer in enumerate(self.layers):
            if self.small_batch_kernels and small_batch.applies(layer, x, batch):
                x, squares = small_batch.decoder_layer(layer, x, cos, sin, kv_caches[i], batch, squares)
            elif self.moe_layer_kernels and small_batch_moe.applies(layer, x, batch):
                if arrivals is None:
                    arrivals = small_batch_moe.new_arrivals(x, len(self.layers), layer.self_attn.num_kv_heads)
                x, squares = small_batch_moe.decoder_layer(layer, x, cos, sin, kv_caches[i], batch, squares,
                                                           arrivals[i], self.moe_combine_in_down,
                                                           self.moe_route_in_router)
            else:
                x, squares = layer(x, cos, sin, kv_caches[i], batch), None
            if i + 1 in capture and i + 1 < self.spec.num_layers:
                captured[i + 1] = x
        if normed:
            x = self.norm(x)
        if self.spec.num_layers in capture:
            captured[self.spec.num_layers] = x
        return x, captured

    def last_logits(
        self, embeds: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
        rope: tuple[torch.Tensor, torch.Tensor], head: torch.Tensor,
    ) -> torch.Tensor:
        """A decode pass from `embeds` [B, T, h] (keys and values into `kv_caches`), then the last position's logits
        [B, V] by `head` [V, h] after the final norm: one persistent kernel where `use_persistent_pass` applies,
        else `forward` and `head_logits`."""
        if self.persistent is not None and self.persistent.applies(embeds, batch):
            return self.persistent.logits(embeds, kv_caches, batch, rope[0], rope[1], head)
        hidden, _ = self(embeds, None, kv_caches, batch, rope=rope, normed=False)
        return self.head_logits(hidden, head)

    def last_draw(
        self, embeds: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], batch: AttentionBatch,
        rope: tuple[torch.Tensor, torch.Tensor], head: torch.Tensor, draw: persistent_pass.CodeDraw,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`last_logits` and each row's code drawn from them in one persistent launch: codes [B], their embeddings
        [B, h] and `draw.feedback` plus those; None where that launch does not take this pass or this draw."""
        kernel = self.persistent
        if kernel is None or not kernel.applies(embeds, batch) or not kernel.draw_applies(draw):
            return None
        return kernel.draw(embeds, kv_caches, batch, rope[0], rope[1], head, draw)

    def head_logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The last position's logits [B, V] from `hidden` [B, T, h], the un-normed output of `forward(...,
        normed=False)`, by `head` [V, h]: the final norm and the head's GEMM in one kernel where the small-batch
        kernels run, else the norm, then the GEMM."""
        last = hidden[:, -1]
        if self.small_batch_kernels and small_batch.takes_rows(last):
            return small_batch.rows_matmul(last, head, self.norm.weight, self.norm.variance_epsilon)
        return F.linear(self.norm(last), head)
