"""What `DecoderStack.compile_layers` changes besides compiling: fused q/k/v and gate/up GEMMs, and the comparison
ranks that group MoE pairs by expert and pick the router's experts in decode, each against the unfused or sorted
original (CPU; the compiled layers themselves are checked on a GPU in test_gpu_engine.py)."""

from __future__ import annotations

import torch

from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.basic import GatedMLP
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.layers.moe import Experts, narrowest_keys, rank_by_comparison, top_k_by_comparison


def test_rank_by_comparison_is_the_stable_argsort() -> None:
    g = torch.Generator().manual_seed(0)
    for pairs, keys in ((1, 4), (8, 128), (256, 128), (1000, 16), (300, 1)):
        values = torch.randint(0, keys, (pairs,), generator=g)
        order, place, counts = rank_by_comparison(values, keys)
        assert torch.equal(order, torch.argsort(values, stable=True))
        assert torch.equal(order[place], torch.arange(pairs))
        assert torch.equal(counts, torch.bincount(values, minlength=keys))


def test_pairs_sorted_by_narrow_expert_ids_keep_the_stable_order_of_the_wide_ones() -> None:
    """A prefill's pairs (past the comparison ranks' size) are grouped by a stable sort of their expert ids in one
    byte: the order, each pair's place and the counts are those of the int64 ids' stable argsort."""
    g = torch.Generator().manual_seed(1)
    for tokens, k, experts in ((700, 8, 128), (600, 8, 256), (520, 8, 300)):
        ids = torch.randint(0, experts, (tokens, k), generator=g)
        narrow = narrowest_keys(ids.reshape(-1), experts)
        assert narrow.dtype == (torch.uint8 if experts <= 256 else torch.int16)
        order, place, token_of, counts = Experts._sort_by_expert(ids, experts)
        expected = torch.argsort(ids.reshape(-1), stable=True)
        assert torch.equal(order, expected) and torch.equal(order[place], torch.arange(tokens * k))
        assert torch.equal(token_of, expected // k)
        assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=experts))


def test_top_k_by_comparison_is_torch_topk() -> None:
    g = torch.Generator().manual_seed(1)
    for rows, n, k in ((1, 4, 1), (32, 128, 8), (7, 128, 6), (3, 5, 5)):
        scores = torch.randn(rows, n, generator=g).softmax(-1)
        values, picked = top_k_by_comparison(scores, k)
        expected_values, expected_picked = torch.topk(scores, k)
        assert torch.equal(values, expected_values) and torch.equal(picked, expected_picked)
    ties = torch.tensor([[0.2, 0.3, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])  # ties go to the lower index
    assert top_k_by_comparison(ties, 3)[1].tolist() == [[1, 2, 0], [0, 1, 2]]


def _spec(moe: bool) -> DecoderSpec:
    return DecoderSpec(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
        mrope_section=None, intermediate_size=96, num_experts=8 if moe else 0, top_k=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48 if moe else 0, always_moe=moe,
    )


def _run(stack: DecoderStack) -> list[torch.Tensor]:
    """A prefill of 5 tokens for 2 rows, then 3 decode steps; returns every step's output."""
    g = torch.Generator().manual_seed(1)
    caches = [(torch.zeros(3, 32, 2, 16), torch.zeros(3, 32, 2, 16)) for _ in range(2)]
    slots = torch.arange(2)
    batch = AttentionBatch.from_tensors(slots, torch.zeros(2, dtype=torch.long), 5, 16, rows_are_slots=True)
    outputs = [stack(torch.randn(2, 5, 64, generator=g), torch.arange(5).expand(2, 5), caches, batch)[0]]
    for step in range(3):
        positions = torch.full((2,), 5 + step)
        batch = AttentionBatch.from_tensors(slots, positions, 1, 16, rows_are_slots=True)
        outputs.append(stack(torch.randn(2, 1, 64, generator=g), positions[:, None], caches, batch)[0])
    return outputs


def test_fused_projections_compute_what_the_separate_ones_do() -> None:
    for moe in (False, True):
        torch.manual_seed(0)
        stack = DecoderStack(_spec(moe)).eval()
        for parameter in stack.parameters():
            torch.nn.init.normal_(parameter, std=0.1)
        with torch.inference_mode():
            separate = _run(stack)
            weights_before = sum(p.numel() for p in stack.parameters())
            for layer in stack.layers:
                layer.self_attn.fuse_projections()
                for module in layer.mlp.modules():
                    if isinstance(module, GatedMLP):
                        module.fuse_projections()
            fused = _run(stack)
        attn = stack.layers[0].self_attn
        assert attn.qkv is not None and attn.q_proj.weight.data_ptr() == attn.qkv.data_ptr()  # views, no copy
        assert sum(p.numel() for p in stack.parameters()) == weights_before
        for a, b in zip(separate, fused):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _compiled_code(fn: object, *args: torch.Tensor) -> str:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(fn, dynamic=False), *args)
    return "\n".join(code)


def test_compiled_decode_writes_only_the_new_rows_of_the_kv_cache() -> None:
    """A compiled layer's KV write is a scatter of the step's new keys and values, whatever the cache size: no kernel
    copies the cache (or the first B slots of it). Writing through a slice of the cache made inductor copy that slice
    out and back in every layer of every step (O(cache), 54 µs per Thinker layer on an H200 with 2048-position
    slots). The probe: the cache's element counts never appear as a loop bound in the generated code."""
    from omni_ray.layers.attention import Attention

    torch.manual_seed(0)
    attention = Attention(64, 4, 2, 16, 1e-6).eval()
    slots, max_len, rows = 6, 1000, 4
    whole, first_rows = slots * max_len * 2 * 16, rows * max_len * 2 * 16

    def step(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             starts: torch.Tensor) -> torch.Tensor:
        batch = AttentionBatch.from_tensors(torch.arange(rows), starts, 1, 64, rows_are_slots=True)
        return attention(x, cos, sin, (k_cache, v_cache), batch)

    def write_through_a_slice(k_cache: torch.Tensor, k: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        view = k_cache[:rows]
        view[torch.arange(rows)[:, None], starts[:, None]] = k
        return view[:, :64].sum()

    caches = (torch.zeros(slots, max_len, 2, 16), torch.zeros(slots, max_len, 2, 16))
    eager_caches = tuple(c.clone() for c in caches)
    x, cos, sin = torch.randn(rows, 1, 64), torch.randn(rows, 1, 16), torch.randn(rows, 1, 16)
    starts = torch.tensor([3, 10, 0, 63])
    with torch.no_grad():
        code = _compiled_code(step, x, cos, sin, *caches, starts)
        expected = step(x, cos, sin, *eager_caches, starts)
        compiled = torch.compile(step, dynamic=False)(x, cos, sin, *caches, starts)
    assert torch.allclose(compiled, expected, atol=1e-5)
    assert all(torch.allclose(c, e, atol=1e-6) for c, e in zip(caches, eager_caches))
    assert f"{whole}" not in code and f"{first_rows}" not in code
    # the probe sees such a copy when there is one
    assert f"{first_rows}" in _compiled_code(write_through_a_slice, torch.zeros(slots, max_len, 2, 16),
                                             torch.randn(rows, 1, 2, 16), starts)
