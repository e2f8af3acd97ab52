"""Sparse mixture-of-experts block (Qwen3 MoE router, fused expert weights, optional gated shared expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.layers import moe_kernels
from omni_ray.layers.basic import GatedMLP


# The router-and-shared-gate weight's rows (its logits' width) padded to a multiple of this with zero rows: a row
# stride of 16 elements lets Triton specialise the routing kernel (`small_batch_moe.route`)
ROUTER_ROWS_MULTIPLE = 16
# Decode-sized batches group their (token, expert) pairs by comparison counts: one fusable reduction over pairs x
# pairs instead of a sort (a radix sort took 26 us for 256 pairs on an H200, and a one-hot cumsum 15-18 us, once per
# MoE layer). The work grows with the square of the pairs: past this many (a prefill), a sort.
RANK_BY_COMPARISON_MAX_PAIRS = 4096
# The router's top-k by comparison is quadratic in the experts per row: for a decode batch's rows only (a prefill of
# 32 prompts spent 270 us per Thinker layer on it on an H200, where a top-k kernel takes a few).
TOP_K_BY_COMPARISON_MAX_ROWS = 256


def stable_rank(values: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """Each entry's place in the stable sort of the last dim (ties keep index order), with no sort kernel: how many
    entries come before it. Quadratic in the last dim: one fusable reduction for small dims."""
    index = torch.arange(values.shape[-1], device=values.device)
    other, this = values[..., None, :], values[..., :, None]
    ahead = (other > this) if descending else (other < this)
    return (ahead | ((other == this) & (index[None, :] < index[:, None]))).sum(-1)


def key_counts(keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """How many of `keys` (values in [0, num_keys)) hold each value, as a reduction (bincount sizes its output from a
    host read of max(); a scatter-add ran as a sort-based kernel inside a compiled layer)."""
    return (keys[None, :] == torch.arange(num_keys, device=keys.device)[:, None]).sum(1)


def narrowest_keys(keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """`keys` (values in [0, num_keys)) in the narrowest integer dtype that holds them: a radix sort makes one pass
    per key byte, so expert ids sorted as int64 took eight passes (eight kernels a MoE layer in a prefill, about 5.6
    us each on an H200) where one byte takes one. A stable sort orders the same values the same in any dtype."""
    if num_keys <= 256:
        return keys.to(torch.uint8)
    if num_keys <= 1 << 15:
        return keys.to(torch.int16)
    return keys


def rank_by_comparison(keys: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stable argsort `order` of `keys` (values in [0, num_keys)), its inverse `place` (where each pair lands),
    and each key's count, with no sort or scan."""
    place = stable_rank(keys)
    order = torch.empty_like(keys).scatter_(0, place, torch.arange(keys.numel(), device=keys.device))
    return order, place, key_counts(keys, num_keys)


def top_k_by_comparison(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(values, k)` over the last dim (descending; ties to the lower index) with no sort or select
    kernel: an entry's rank is how many entries beat it, and the entries of ranks 0..k-1 are picked by a scatter.
    Quadratic in the last dim, so for a router's scores (128 experts), where it is one fusable reduction instead of
    a top-k kernel and a sort of its picks (8 and 7 us per Thinker layer at 32 rows on an H200)."""
    rank = stable_rank(values, descending=True)  # [..., n], a permutation of 0..n-1 in each row
    index = torch.arange(values.shape[-1], device=values.device)
    by_rank = torch.empty_like(rank).scatter_(-1, rank, index.expand_as(rank))
    picked = by_rank[..., :k]
    return values.gather(-1, picked), picked


class Router(nn.Module):
    """Softmax router picking top-k experts, optionally renormalising their weights."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pick(F.linear(x, self.weight))

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [N, E] → each row's top-k experts' weights (in the logits' dtype) and ids [N, k]."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if logits.is_cuda and logits.shape[0] <= TOP_K_BY_COMPARISON_MAX_ROWS:
            weights, experts = top_k_by_comparison(probs, self.top_k)
        else:
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


class Experts(nn.Module):
    """All experts' SwiGLU weights stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.use_kernels = False  # decode batches through `moe_kernels` (see `DecoderStack.use_moe_kernels`)
        # the experts' weights, then any a dense expert added (`append_dense_expert`); the kernels read these
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def append_dense_expert(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> int:
        """Stack a dense SwiGLU expert (gate and up [J, H], down [H, J], J a multiple of the experts' inner size I)
        after the experts, as J / I more experts of inner size I: SwiGLU splits over the inner dimension, so their
        outputs add up to the dense expert's. The experts' own weights become views of the stacked ones (no second
        copy). Returns how many experts were added."""
        experts, twice_inner, hidden = self.gate_up_proj.shape
        inner = twice_inner // 2
        parts = gate.shape[0] // inner
        assert gate.shape == up.shape == (parts * inner, hidden) and down.shape == (hidden, parts * inner)
        gate_up = torch.empty(experts + parts, twice_inner, hidden, dtype=gate.dtype, device=gate.device)
        gate_up[:experts] = self.gate_up_proj.detach()
        gate_up[experts:, :inner] = gate.detach().reshape(parts, inner, hidden)
        gate_up[experts:, inner:] = up.detach().reshape(parts, inner, hidden)
        down_stacked = torch.empty(experts + parts, hidden, inner, dtype=down.dtype, device=down.device)
        down_stacked[:experts] = self.down_proj.detach()
        down_stacked[experts:] = down.detach().reshape(hidden, parts, inner).transpose(0, 1)
        self.gate_up_proj = nn.Parameter(gate_up[:experts], requires_grad=False)
        self.down_proj = nn.Parameter(down_stacked[:experts], requires_grad=False)
        self.stacked = (gate_up, down_stacked)
        return parts

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [N, H]; experts/weights: [N, k]. On CUDA, with no host sync (so CUDA graphs can capture it): a decode
        batch through the Triton expert kernels when turned on, else grouped GEMMs in half precision, per-pair gathered
        weights otherwise; on the CPU one matmul per hit expert."""
        if self.use_kernels and moe_kernels.applies(x):
            return self.with_kernels(x, experts, weights)
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            return self.grouped(x, experts, weights)
        if x.is_cuda:
            return self.gathered(x, experts, weights)
        return self.looped(x, experts, weights)

    @staticmethod
    def _sort_by_expert(
        experts: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pairs grouped by expert: the pair order, each pair's place in it, each sorted pair's token, the counts."""
        flat = experts.reshape(-1)
        if flat.is_cuda and flat.numel() <= RANK_BY_COMPARISON_MAX_PAIRS:
            order, place, counts = rank_by_comparison(flat, num_experts)
        else:
            order = torch.argsort(narrowest_keys(flat, num_experts), stable=True)
            place = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
            # (a scatter-add of the counts ran in a compiled layer as a sort-based kernel: 358 us per Thinker layer
            # for a prefill of 32 prompts on an H200)
            counts = key_counts(flat, num_experts)
        return order, place, order // experts.shape[1], counts

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped GEMMs over the tokens sorted by expert (torch._grouped_mm). The results come
        back to pair order by a gather, and each token's k results are summed in fp32 (no scatter-add)."""
        order, place, token_of, counts = self._sort_by_expert(experts, self.gate_up_proj.shape[0])
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = torch._grouped_mm(x[token_of], self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)
        return self._combine(y, place, experts, weights, x.dtype)

    def with_kernels(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`grouped` with its two GEMMs as `moe_kernels.expert_gemms`: one program per picked expert and column
        block (decode batches). Ids past the experts pick those `append_dense_expert` added."""
        gate_up, down = self.stacked or (self.gate_up_proj, self.down_proj)
        _, place, token_of, counts = self._sort_by_expert(experts, gate_up.shape[0])
        y = _expert_gemms(x, gate_up, down, token_of, counts)
        return self._combine(y, place, experts, weights, x.dtype)

    @staticmethod
    def _combine(
        y: torch.Tensor, place: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Per-pair outputs [pairs, H] in expert order → each token's k results weighted and summed in fp32 (a
        gather back to pair order, no scatter-add). Eager: one gather and a sum over k. Compiled: the k gathered rows
        added in turn, which inductor makes one pointwise kernel with k row loads (the sum over k, which inductor
        made a reduction, ran at about 0.7 TB/s: 197 us per Thinker layer in a prefill of 32 prompts on an H200, 14%
        of that step)."""
        place = place.view(experts.shape)
        if not torch.compiler.is_compiling():
            return (y[place].float() * weights[..., None].float()).sum(1).to(dtype)
        total = y[place[:, 0]].float() * weights[:, :1].float()
        for pick in range(1, place.shape[1]):
            total = total + y[place[:, pick]].float() * weights[:, pick : pick + 1].float()
        return total.to(dtype)

    def gathered(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, expert) pair with its own gathered weights: sync-free and exact, but memory grows with
        N*k*expert size, so it is for small models in fp32 (tests), not for serving."""
        gate, up = torch.einsum("nh,nkoh->nko", x, self.gate_up_proj[experts]).chunk(2, dim=-1)
        y = torch.einsum("nki,nkhi->nkh", F.silu(gate) * up, self.down_proj[experts])
        return (y * weights[..., None].to(y.dtype)).sum(1).to(x.dtype)

    def looped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One matmul per hit expert (needs the per-expert counts on the host)."""
        out = torch.zeros_like(x)
        order, _, token_of, counts_t = self._sort_by_expert(experts, self.gate_up_proj.shape[0])
        counts = counts_t.tolist()
        flat_weights = weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, (y * flat_weights[start : start + count, None]).to(out.dtype))
            start += count
        return out


@torch.compiler.disable
def _expert_gemms(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, token_of: torch.Tensor, counts: torch.Tensor,
) -> torch.Tensor:
    """`moe_kernels.expert_gemms` outside inductor's graph (a compiled layer calls it between two compiled parts;
    replayed from a CUDA graph, the break costs nothing)."""
    return moe_kernels.expert_gemms(x, gate_up, down, token_of, counts)


class SparseMoE(nn.Module):
    """Router + experts, plus a sigmoid-gated shared expert when `shared_intermediate_size` > 0."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        shared_intermediate_size: int = 0,
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert: GatedMLP | None = None
        if shared_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.router_and_shared_gate: torch.Tensor | None = None  # set by `fold_shared_expert`
        self.shared_parts = 0

    def fold_shared_expert(self) -> bool:
        """For the expert kernels' decode batches: the shared expert as `shared_parts` more experts that every token
        picks, each weighted by the shared expert's sigmoid gate, and that gate as one more router column (then zero
        rows up to a multiple of `ROUTER_ROWS_MULTIPLE`); its own GEMMs, SiLU and gate (five kernels a layer) go.
        False (nothing changes) without a shared expert, or one whose inner size is not a multiple of the experts'."""
        shared = self.shared_expert
        if self.router_and_shared_gate is not None:
            return True
        inner = self.experts.down_proj.shape[-1]
        if shared is None or shared.gate_proj.out_features % inner:
            return False
        self.shared_parts = self.experts.append_dense_expert(
            shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
        gates = [self.gate.weight, self.shared_expert_gate.weight]
        padding = -sum(g.shape[0] for g in gates) % ROUTER_ROWS_MULTIPLE
        gates.append(self.gate.weight.new_zeros(padding, self.gate.weight.shape[1]))
        self.router_and_shared_gate = torch.cat(gates).detach()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.router_and_shared_gate is not None and self.experts.use_kernels and moe_kernels.applies(flat):
            return self._with_shared_expert_folded(flat).reshape(shape)
        weights, experts = self.gate(flat)
        out = self.experts(flat, experts, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)

    def _with_shared_expert_folded(self, flat: torch.Tensor) -> torch.Tensor:
        """One GEMM for the router and the shared expert's gate, then the picked experts and the shared expert's
        parts in the expert kernels (see `fold_shared_expert`)."""
        assert self.router_and_shared_gate is not None
        logits = F.linear(flat, self.router_and_shared_gate)
        routed = self.gate.weight.shape[0]
        weights, experts = self.gate.pick(logits[:, :routed])
        first = self.experts.gate_up_proj.shape[0]
        shared_ids = torch.arange(first, first + self.shared_parts, device=flat.device).expand(flat.shape[0], -1)
        shared_weights = torch.sigmoid(logits[:, routed:routed + 1]).to(weights.dtype).expand(-1, self.shared_parts)
        experts, weights = torch.cat([experts, shared_ids], 1), torch.cat([weights, shared_weights], 1)
        return self.experts.with_kernels(flat, experts, weights)
