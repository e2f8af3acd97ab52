"""Unit tests of the slot KV cache, attention over it (prefill/decode/batching), grouped MoE and weight loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_ray.engine.kv_cache import KVCacheFull, SlotKVCache
from omni_ray.layers.attention import AttentionBatch, small_key_attention
from omni_ray.layers.basic import GatedMLP
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.layers.moe import Experts, SparseMoE
from omni_ray.weights import fuse_expert_weights, load_module

CPU = torch.device("cpu")


# ---- SlotKVCache ---------------------------------------------------------------------------------------------
def _cache(num_slots: int = 3, max_len: int = 16, layers: int = 2) -> SlotKVCache:
    return SlotKVCache(layers, num_slots, max_len, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")


def test_cache_shapes() -> None:
    cache = _cache(num_slots=3, max_len=16, layers=2)
    assert len(cache.layers) == 2
    for k, v in cache.layers:
        assert k.shape == v.shape == (4, 16, 2, 8)  # 3 slots + the scratch slot that padding rows use
        assert k.data_ptr() != v.data_ptr()
    assert cache.layers[0][0].data_ptr() != cache.layers[1][0].data_ptr()
    assert cache.scratch_slot == 3
    assert sorted(cache.allocate() for _ in range(3)) == [0, 1, 2]  # the scratch slot is never handed out


def test_cache_allocate_release_full() -> None:
    cache = _cache(num_slots=3)
    assert (cache.free_slots, cache.used_slots) == (3, 0)
    slots = [cache.allocate() for _ in range(3)]
    assert slots == [0, 1, 2]  # always the lowest free slot
    assert (cache.free_slots, cache.used_slots) == (0, 3)
    with pytest.raises(KVCacheFull):
        cache.allocate()
    assert cache.release(2) is None  # the highest slot: nothing moves
    assert cache.allocate() == 2
    for s in (2, 1, 0):
        cache.release(s)
    assert cache.free_slots == 3


def test_cache_release_keeps_used_slots_compact() -> None:
    """Releasing a middle slot moves the highest used slot's keys and values into it."""
    cache = _cache(num_slots=3, max_len=4, layers=2)
    for slot in (cache.allocate(), cache.allocate(), cache.allocate()):
        for k, v in cache.layers:
            k[slot].fill_(slot + 1)
            v[slot].fill_(-(slot + 1))
    assert cache.release(0) == 2  # slot 2's owner now lives in slot 0
    assert cache.used_slots == 2
    for k, v in cache.layers:
        assert bool((k[0] == 3).all()) and bool((v[0] == -3).all())
        assert bool((k[1] == 2).all())
    assert cache.allocate() == 2


def test_cache_double_release_and_bad_slot_raise() -> None:
    cache = _cache(num_slots=2)
    slot = cache.allocate()
    cache.release(slot)
    with pytest.raises(ValueError):
        cache.release(slot)
    with pytest.raises(ValueError):
        cache.release(1)  # never allocated
    with pytest.raises(ValueError):
        cache.release(5)
    with pytest.raises(ValueError):
        cache.release(-1)
    assert cache.free_slots == 2


def test_cache_check_fits() -> None:
    cache = _cache(max_len=16)
    cache.check_fits(0)
    cache.check_fits(16)
    with pytest.raises(KVCacheFull):
        cache.check_fits(17)
    assert issubclass(KVCacheFull, RuntimeError)


# ---- attention over the slot cache ----------------------------------------------------------------------------
def _spec(moe: bool, mrope: bool) -> DecoderSpec:
    return DecoderSpec(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        mrope_section=(2, 1, 1) if mrope else None,
        intermediate_size=48,
        num_experts=4 if moe else 0,
        top_k=2 if moe else 0,
        moe_intermediate_size=16 if moe else 0,
        shared_expert_intermediate_size=24 if moe else 0,
        mlp_only_layers=(0,) if moe else (),
    )


def _stack(moe: bool, mrope: bool, seed: int = 0) -> DecoderStack:
    stack = DecoderStack(_spec(moe, mrope)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    if moe:
        assert isinstance(stack.layers[1].mlp, SparseMoE) and isinstance(stack.layers[0].mlp, GatedMLP)
    return stack


def _garbage_cache(num_slots: int = 4, max_len: int = 32) -> SlotKVCache:
    """A cache whose unused positions hold noise, so attending to a stale position changes the output."""
    cache = SlotKVCache(2, num_slots, max_len, 2, 8, torch.float32, "cpu")
    g = torch.Generator().manual_seed(123)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape, generator=g) * 3)
        v.copy_(torch.randn(v.shape, generator=g) * 3)
    return cache


def _positions(spec: DecoderSpec, length: int) -> torch.Tensor:
    """One sequence's positions: [T], or [3, T] with distinct t/h/w axes under M-RoPE."""
    base = torch.arange(length)
    if spec.mrope_section is None:
        return base
    return torch.stack([base, base // 2 + 1, base % 3 + 2])


def _run(
    stack: DecoderStack, cache: SlotKVCache, rows: list[tuple[int, int, torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """rows: (slot, start, embeds [T, H], positions [..., T]) with equal T. Returns [B, T, H]."""
    num_tokens = rows[0][2].shape[0]
    embeds = torch.stack([r[2] for r in rows])
    positions = torch.stack([r[3] for r in rows], dim=-2)  # [B, T] or [3, B, T]
    batch = AttentionBatch.build([r[0] for r in rows], [r[1] for r in rows], num_tokens, CPU)
    with torch.no_grad():
        out, _ = stack(embeds, positions, cache.layers, batch)
    return out


def test_attention_batch_build() -> None:
    batch = AttentionBatch.build([2, 0], [3, 1], 2, CPU)
    assert batch.kv_len == 5
    assert batch.write_index.tolist() == [[3, 4], [1, 2]]
    assert batch.mask.shape == (2, 1, 2, 5)
    assert batch.mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    assert batch.mask[1, 0].tolist() == [[True, True, False, False, False], [True, True, True, False, False]]


def test_rows_as_slots_view_equals_the_gathered_path() -> None:
    """Decode rows that are slots 0..B-1 read keys as a cache view; same output as gathering those slots,
    including a dummy row that writes past the key range."""
    torch.manual_seed(0)
    stack = _stack(True, False)
    out = []
    embeds = torch.randn(3, 1, 32)
    for view in (False, True):
        cache = _garbage_cache(num_slots=4, max_len=32)
        positions = torch.tensor([5, 2, 31])  # the last row is a dummy at the last cache position
        batch = AttentionBatch.from_tensors(torch.arange(3), positions, 1, 8, rows_are_slots=view)
        with torch.no_grad():
            hidden, _ = stack(embeds, positions[:, None], cache.layers, batch)
        out.append((hidden[:2], [k[:2, :8].clone() for k, _ in cache.layers]))
    torch.testing.assert_close(out[0][0], out[1][0])
    for a, b in zip(out[0][1], out[1][1]):
        assert torch.equal(a, b)


CASES = [(False, False), (False, True), (True, False), (True, True)]
IDS = ["dense", "dense-mrope", "moe", "moe-mrope"]


@pytest.mark.parametrize(("moe", "mrope"), CASES, ids=IDS)
def test_prefill_equals_prefill_then_decode(moe: bool, mrope: bool) -> None:
    torch.manual_seed(0)
    stack = _stack(moe, mrope)
    total, k = 9, 3
    embeds = torch.randn(total, 32)
    pos = _positions(stack.spec, total)

    cache = _garbage_cache()
    full = _run(stack, cache, [(1, 0, embeds, pos)])[0]

    cache2 = _garbage_cache()
    parts = [_run(stack, cache2, [(2, 0, embeds[:k], pos[..., :k])])[0]]
    for t in range(k, total):
        parts.append(_run(stack, cache2, [(2, t, embeds[t : t + 1], pos[..., t : t + 1])])[0])
    incremental = torch.cat(parts)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)
    # the K/V written for the sequence are the same either way
    for (k1, v1), (k2, v2) in zip(cache.layers, cache2.layers):
        torch.testing.assert_close(k2[2, :total], k1[1, :total], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v2[2, :total], v1[1, :total], rtol=1e-5, atol=1e-5)

    # sanity: the test can fail — changing one early token changes later outputs
    other = embeds.clone()
    other[0] += 1.0
    changed = _run(stack, _garbage_cache(), [(0, 0, other, pos)])[0]
    assert not torch.allclose(changed[-1], full[-1], atol=1e-3)


@pytest.mark.parametrize(("moe", "mrope"), CASES, ids=IDS)
def test_batched_decode_equals_decoding_alone(moe: bool, mrope: bool) -> None:
    """Two sequences at different positions in one step give what each gives alone (continuous batching)."""
    torch.manual_seed(1)
    stack = _stack(moe, mrope, seed=3)
    len_a, len_b, steps = 5, 9, 3
    emb_a = torch.randn(len_a + steps + 2, 32)
    emb_b = torch.randn(len_b + steps + 2, 32)
    pos_a = _positions(stack.spec, len_a + steps + 2)
    pos_b = _positions(stack.spec, len_b + steps + 2)

    def alone(emb: torch.Tensor, pos: torch.Tensor, length: int) -> list[torch.Tensor]:
        cache = _garbage_cache()
        outs = [_run(stack, cache, [(0, 0, emb[:length], pos[..., :length])])[0]]
        for t in range(length, length + steps):
            outs.append(_run(stack, cache, [(0, t, emb[t : t + 1], pos[..., t : t + 1])])[0])
        t = length + steps  # a two-token chunk at the end
        outs.append(_run(stack, cache, [(0, t, emb[t : t + 2], pos[..., t : t + 2])])[0])
        return outs

    ref_a = alone(emb_a, pos_a, len_a)
    ref_b = alone(emb_b, pos_b, len_b)

    cache = _garbage_cache()
    slot_a, slot_b = 3, 1
    out_a = _run(stack, cache, [(slot_a, 0, emb_a[:len_a], pos_a[..., :len_a])])[0]
    out_b = _run(stack, cache, [(slot_b, 0, emb_b[:len_b], pos_b[..., :len_b])])[0]
    torch.testing.assert_close(out_a, ref_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_b, ref_b[0], rtol=1e-5, atol=1e-5)
    for i in range(steps):
        ta, tb = len_a + i, len_b + i
        out = _run(
            stack,
            cache,
            [
                (slot_a, ta, emb_a[ta : ta + 1], pos_a[..., ta : ta + 1]),
                (slot_b, tb, emb_b[tb : tb + 1], pos_b[..., tb : tb + 1]),
            ],
        )
        torch.testing.assert_close(out[0], ref_a[1 + i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1], ref_b[1 + i], rtol=1e-5, atol=1e-5)
    # order of rows in the batch does not matter either; two new tokens per row
    ta, tb = len_a + steps, len_b + steps
    out = _run(
        stack,
        cache,
        [
            (slot_b, tb, emb_b[tb : tb + 2], pos_b[..., tb : tb + 2]),
            (slot_a, ta, emb_a[ta : ta + 2], pos_a[..., ta : ta + 2]),
        ],
    )
    torch.testing.assert_close(out[1], ref_a[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], ref_b[-1], rtol=1e-5, atol=1e-5)


def test_decode_must_not_see_other_slots_or_stale_positions() -> None:
    """Sanity for the property above: a wrong start (reading stale cache rows) does change the output."""
    stack = _stack(False, False)
    emb = torch.randn(4, 32)
    pos = _positions(stack.spec, 4)
    cache = _garbage_cache()
    _run(stack, cache, [(0, 0, emb[:3], pos[:3])])
    right = _run(stack, cache, [(0, 3, emb[3:], pos[3:])])[0]
    cache2 = _garbage_cache()
    _run(stack, cache2, [(0, 0, emb[:3], pos[:3])])
    wrong = _run(stack, cache2, [(0, 5, emb[3:], pos[3:])])[0]  # attends to noise at positions 3, 4
    assert not torch.allclose(right, wrong, atol=1e-3)


@pytest.mark.parametrize(("moe", "mrope"), CASES, ids=IDS)
def test_prefill_from_zero_equals_the_masked_cache_read(moe: bool, mrope: bool) -> None:
    """A prefill batch (whole prompts from position 0, causal over its own keys, no mask) computes what the general
    masked read of the cache computes, and writes the same keys and values."""
    torch.manual_seed(0)
    stack = _stack(moe, mrope)
    embeds = torch.randn(3, 6, 32)
    positions = _positions(stack.spec, 6)
    positions = positions.expand(3, -1) if positions.dim() == 1 else positions[:, None].expand(-1, 3, -1)
    slots = torch.tensor([2, 0, 3])
    outputs, caches = [], []
    for batch in (AttentionBatch.prefill(slots, 6), AttentionBatch.from_tensors(slots, torch.zeros(3, dtype=torch.long), 6, 6)):
        cache = _garbage_cache()
        with torch.no_grad():
            outputs.append(stack(embeds, positions, cache.layers, batch)[0])
        caches.append(cache)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for (k0, v0), (k1, v1) in zip(caches[0].layers, caches[1].layers):
        torch.testing.assert_close(k0, k1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v0, v1, rtol=1e-5, atol=1e-5)


def test_small_key_attention_equals_sdpa_and_never_makes_nan() -> None:
    """The broadcast-and-sum attention that short key ranges take (the code predictor's) against torch's kernel,
    with masks of every shape a step makes, and a row that may attend nowhere (a padding row) stays finite."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 4, 8, generator=g) for _ in range(3))
    mask = torch.rand(3, 1, 4, 4, generator=g) > 0.3
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(small_key_attention(q, k, v, mask), expected, rtol=1e-5, atol=1e-5)
    mask[1, 0, 2] = False
    out = small_key_attention(q, k, v, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1, :, 2], v[1].mean(1), rtol=1e-5, atol=1e-5)


# ---- grouped MoE ----------------------------------------------------------------------------------------------
def _naive_expert(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    inter = down.shape[1]
    gate = gate_up[:inter] @ x
    up = gate_up[inter:] @ x
    return down @ (F.silu(gate) * up)


def test_experts_equal_naive_per_token_loop() -> None:
    g = torch.Generator().manual_seed(5)
    num_experts, hidden, inter, top_k, tokens = 6, 16, 12, 2, 11
    experts = Experts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.3)
    x = torch.randn(tokens, hidden, generator=g)
    # only experts 0..4 are hit (5 never is): exercises the empty-expert skip
    chosen = torch.stack([torch.randperm(5, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    with torch.no_grad():
        out = experts(x, chosen, weights)
    expected = torch.zeros_like(x)
    for n in range(tokens):
        for j in range(top_k):
            e = int(chosen[n, j])
            gate_up, down = experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()
            expected[n] += weights[n, j] * _naive_expert(gate_up, down, x[n])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sparse_moe_equals_hand_computation() -> None:
    g = torch.Generator().manual_seed(6)
    hidden, num_experts, top_k, inter, shared = 16, 5, 2, 8, 10
    moe = SparseMoE(hidden, num_experts, top_k, inter, norm_topk_prob=True, shared_intermediate_size=shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, 3, hidden, generator=g)
    with torch.no_grad():
        out = moe(x)
    assert out.shape == x.shape
    flat = x.reshape(-1, hidden)
    expected = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        probs = torch.softmax(moe.gate.weight.detach() @ flat[n], dim=-1)
        w, idx = torch.topk(probs, top_k)
        w = w / w.sum()
        for j in range(top_k):
            e = int(idx[j])
            gate_up, down = moe.experts.gate_up_proj[e].detach(), moe.experts.down_proj[e].detach()
            expected[n] += w[j] * _naive_expert(gate_up, down, flat[n])
        se = moe.shared_expert
        assert se is not None
        with torch.no_grad():
            shared_out = se.down_proj(F.silu(se.gate_proj(flat[n])) * se.up_proj(flat[n]))
            expected[n] += torch.sigmoid(moe.shared_expert_gate(flat[n])) * shared_out
    torch.testing.assert_close(out.reshape(-1, hidden), expected, rtol=1e-5, atol=1e-5)


# ---- weights ----------------------------------------------------------------------------------------------
def _expert_tensors(base: str, indices: list[int], hidden: int = 4, inter: int = 3) -> dict[str, torch.Tensor]:
    out = {}
    for e in indices:
        out[f"{base}.{e}.gate_proj.weight"] = torch.full((inter, hidden), 100.0 * e + 1)
        out[f"{base}.{e}.up_proj.weight"] = torch.full((inter, hidden), 100.0 * e + 2)
        out[f"{base}.{e}.down_proj.weight"] = torch.full((hidden, inter), 100.0 * e + 3)
    return out


def test_fuse_expert_weights_stacks_in_expert_order() -> None:
    tensors: dict[str, torch.Tensor] = {}
    # insertion order deliberately not expert order, two separate expert groups, plus an ordinary key
    tensors.update(_expert_tensors("layers.1.mlp.experts", [2, 0, 10, 1, 3, 4, 5, 6, 7, 8, 9]))
    tensors.update(_expert_tensors("layers.0.mlp.experts", [1, 0]))
    tensors["layers.0.mlp.gate.weight"] = torch.zeros(2, 4)
    fused = fuse_expert_weights(tensors)
    assert set(fused) == {
        "layers.0.mlp.gate.weight",
        "layers.0.mlp.experts.gate_up_proj",
        "layers.0.mlp.experts.down_proj",
        "layers.1.mlp.experts.gate_up_proj",
        "layers.1.mlp.experts.down_proj",
    }
    gate_up = fused["layers.1.mlp.experts.gate_up_proj"]
    down = fused["layers.1.mlp.experts.down_proj"]
    assert gate_up.shape == (11, 6, 4) and down.shape == (11, 4, 3)
    for e in range(11):  # numeric order (10 after 9, not after 1); gate rows first, then up rows
        assert torch.all(gate_up[e, :3] == 100.0 * e + 1)
        assert torch.all(gate_up[e, 3:] == 100.0 * e + 2)
        assert torch.all(down[e] == 100.0 * e + 3)
    assert fused["layers.0.mlp.experts.gate_up_proj"].shape == (2, 6, 4)


def test_fused_weights_load_into_experts_and_compute_the_same() -> None:
    g = torch.Generator().manual_seed(7)
    hidden, inter, num = 8, 6, 3
    per_expert = {}
    for e in range(num):
        per_expert[f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(inter, hidden, generator=g)
        per_expert[f"mlp.experts.{e}.up_proj.weight"] = torch.randn(inter, hidden, generator=g)
        per_expert[f"mlp.experts.{e}.down_proj.weight"] = torch.randn(hidden, inter, generator=g)
    holder = torch.nn.Module()  # checkpoint keys always have a prefix before ".experts."
    holder.mlp = moe = SparseMoE(hidden, num, 2, inter, norm_topk_prob=False)
    tensors = fuse_expert_weights({**per_expert, "mlp.gate.weight": torch.randn(num, hidden, generator=g)})
    load_module(holder, tensors)
    x = torch.randn(hidden, generator=g)
    with torch.no_grad():
        got = F.linear(F.silu(x @ moe.experts.gate_up_proj[1, :inter].T) * (x @ moe.experts.gate_up_proj[1, inter:].T),
                       moe.experts.down_proj[1])
    mlp = GatedMLP(hidden, inter)
    load_module(mlp, {
        "gate_proj.weight": per_expert["mlp.experts.1.gate_proj.weight"],
        "up_proj.weight": per_expert["mlp.experts.1.up_proj.weight"],
        "down_proj.weight": per_expert["mlp.experts.1.down_proj.weight"],
    })
    with torch.no_grad():
        torch.testing.assert_close(got, mlp(x))


@pytest.mark.parametrize("indices", [[0, 2], [1, 2], [0, 1, 3]])
def test_fuse_expert_weights_rejects_non_contiguous(indices: list[int]) -> None:
    with pytest.raises(KeyError):
        fuse_expert_weights(_expert_tensors("mlp.experts", indices))


def test_load_module_is_strict() -> None:
    mlp = GatedMLP(4, 6)
    good = {k: torch.randn(v.shape) for k, v in mlp.state_dict().items()}
    load_module(mlp, good)
    for k, v in mlp.state_dict().items():
        assert torch.equal(v, good[k])

    missing = dict(good)
    del missing["up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj.weight"):
        load_module(mlp, missing)

    unexpected = {**good, "extra.weight": torch.zeros(1)}
    with pytest.raises(KeyError, match="extra.weight"):
        load_module(mlp, unexpected)

    wrong_shape = {**good, "down_proj.weight": torch.zeros(6, 4)}
    with pytest.raises(ValueError, match="down_proj.weight"):
        load_module(mlp, wrong_shape)
    # a failed load leaves the module untouched
    for k, v in mlp.state_dict().items():
        assert torch.equal(v, good[k])


def test_grouped_experts_equal_the_per_expert_loop() -> None:
    """The grouped-GEMM path (used on CUDA in half precision) computes what the exact loop computes."""
    from omni_ray.layers.moe import Experts

    g = torch.Generator().manual_seed(5)
    experts = Experts(num_experts=6, hidden_size=16, intermediate_size=8)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.3)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.3)
        x = torch.randn(11, 16, generator=g)
        chosen = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(11)])
        chosen[:, 0] = 3  # one expert shared by all tokens, some experts unused
        weights = torch.rand(11, 2, generator=g)
        assert torch.allclose(experts.grouped(x, chosen, weights), experts.looped(x, chosen, weights), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_combine_adds_what_the_eager_one_sums(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each token's k expert results back from expert order: the unrolled sum a compiled layer runs equals the eager
    gather-and-sum (fp32 sums in another order, one rounding to the output dtype)."""
    from omni_ray.layers.moe import Experts

    g = torch.Generator().manual_seed(11)
    tokens, picks, hidden = 13, 8, 32
    experts = torch.stack([torch.randperm(16, generator=g)[:picks] for _ in range(tokens)])
    place = torch.randperm(tokens * picks, generator=g)  # each pair's row among the expert-ordered results
    y = torch.randn(tokens * picks, hidden, generator=g).to(dtype)
    weights = torch.rand(tokens, picks, generator=g).to(dtype)
    eager = Experts._combine(y, place, experts, weights, dtype)
    expected = sum(y[place.view(tokens, picks)[:, j]].double() * weights[:, j : j + 1].double() for j in range(picks))
    assert torch.allclose(eager.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    unrolled = Experts._combine(y, place, experts, weights, dtype)
    if dtype == torch.float32:
        assert torch.allclose(unrolled, eager, rtol=1e-6, atol=1e-6)
    else:  # fp32 sums that differ in their last bits round to the same bf16 or a neighbour
        assert (unrolled.float() - eager.float()).abs().le(eager.float().abs() * 2**-7 + 1e-6).all()


def test_rms_norm_equals_transformers_in_fp32_and_within_a_bf16_ulp_in_bf16() -> None:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRMSNorm

    from omni_ray.layers.basic import RMSNorm

    g = torch.Generator().manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-6), Qwen3OmniMoeThinkerTextRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64, generator=g))
        ref.weight.copy_(ours.weight)
    x = torch.randn(5, 64, generator=g) * 3
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        ours_bf16, ref_bf16 = ours.to(torch.bfloat16)(x.bfloat16()).float(), ref.to(torch.bfloat16)(x.bfloat16()).float()
    ulp = 2.0 ** (torch.floor(torch.log2(ref_bf16.abs().clamp_min(1e-30))) - 7)  # bf16 keeps 8 significant bits
    assert bool(((ours_bf16 - ref_bf16).abs() <= ulp).all())


def test_rotary_frequencies_stay_float32_when_the_model_is_cast() -> None:
    """A bfloat16 copy of the frequencies would shift the angles of late positions (transformers keeps them float32)."""
    from omni_ray.layers.basic import RotaryEmbedding

    exact = RotaryEmbedding(128, 1e6)
    cast = RotaryEmbedding(128, 1e6).to(torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast.inv_freq, exact.inv_freq)
    positions = torch.arange(4000, 4096)[None]
    assert torch.equal(cast(positions, torch.float32)[0], exact(positions, torch.float32)[0])
