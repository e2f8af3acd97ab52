"""GPU: the eight-kernel MoE layer (`layers/small_batch_moe.py`) against the layer's own decode code on the
full-size Thinker's and Talker's shapes, eagerly and replayed from a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import FULL_CONFIG
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers import small_batch_moe
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.layers.moe import SparseMoE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CACHE_POSITIONS = 640


@pytest.mark.parametrize("stage", ["thinker", "talker"])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_moe_layer_kernels_equal_the_layers_decode_on_the_gpu(stage: str, rows: int) -> None:
    """Two layers of Qwen3-Omni-30B's Thinker (2,048 wide, 32 query and 4 KV heads, 8 of 128 experts) or Talker
    (1,024 wide, 16 and 2 heads, 6 of 128 experts and a shared expert folded in as two more), random bf16 weights,
    rows at positions spread over 600 cached ones, three decode steps. Against the same layers evaluated in fp32, the
    kernels' hidden states, and the keys and values they write, are off by at most twice what the layers' own bf16
    decode (the expert kernels, as served without these) is off, or bf16 noise (3% of the largest hidden value or
    key), and never by more than 10%; a graph replay gives the kernels' eager output. With the combine inside the
    down projection's kernel and the routing inside the router GEMM's (`use_moe_layer_kernels(folds=True)`) the
    output is the eight kernels' bit for bit, eagerly and replayed.

    The routers pick by one channel of the residual stream, held at +10 or -10 in alternate rows: there a top-k of
    experts has logits near +3 and the others near 0 or -3, so every evaluation picks the same experts (one top-k per
    sign), and the logits stay small, as trained routers' are. With random routers (logits about 14 wide at the
    Thinker's 2,048 channels) both bf16 paths of the Thinker were 10-20% of its largest value off fp32 in some rows
    on an H200: bf16 rounds a logit of 30 to 0.125, so each path's routing weights moved by several percent, and
    close experts could swap."""
    pytest.importorskip("triton")
    torch.backends.cuda.matmul.allow_tf32 = False
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    text = config.thinker_config.text_config if stage == "thinker" else config.talker_config.text_config
    spec = dataclasses.replace(DecoderSpec.from_hf(text, always_moe=stage == "talker"), num_layers=2)
    torch.manual_seed(0)
    reference = DecoderStack(spec).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.03) + (1.0 if p.dim() == 1 else 0.0))
        top_k = spec.top_k
        for layer in reference.layers:
            router = layer.mlp.gate.weight  # [experts, hidden]
            router.copy_(torch.randn_like(router) * 1e-3)
            router[:, 0] = 0.0
            router[:top_k, 0] = 0.3 + 0.005 * torch.arange(top_k)  # picked by the rows held at +10
            router[top_k : 2 * top_k, 0] = -0.3 - 0.005 * torch.arange(top_k)  # by those at -10
    kernels, exact = copy.deepcopy(reference), copy.deepcopy(reference).float()
    for stack in (reference, exact):
        assert stack.use_moe_kernels()
        stack.fuse_projections()
    assert kernels.use_moe_layer_kernels()
    assert all(isinstance(layer.mlp, SparseMoE) for layer in kernels.layers)
    caches = [SlotKVCache(2, 32, CACHE_POSITIONS, spec.num_kv_heads, spec.head_dim, dtype, "cuda")
              for dtype in (torch.bfloat16, torch.bfloat16, torch.float32)]
    for k, v in caches[0].layers:
        k.normal_()
        v.normal_()
    for cache in caches[1:]:
        for (k0, v0), (k1, v1) in zip(caches[0].layers, cache.layers):
            k1.copy_(k0)
            v1.copy_(v0)
    slots = torch.randperm(32, device="cuda")[:rows]
    starts = torch.randint(0, 600, (rows,), device="cuda")
    for step in range(3):
        batch = AttentionBatch.from_tensors(slots, starts, 1, int(starts.max()) + 1)
        x = torch.randn(rows, 1, spec.hidden_size, device="cuda")
        x[:, 0, 0] = torch.where(torch.arange(rows, device="cuda") % 2 == 0, 10.0, -10.0)
        x = x.to(torch.bfloat16)
        positions = starts[:, None]
        positions = positions.unsqueeze(0).expand(3, -1, -1) if spec.mrope_section else positions
        assert all(small_batch_moe.applies(layer, x, batch) for layer in kernels.layers)
        outs = []
        for stack, cache, dtype in zip((reference, kernels, exact), caches, (torch.bfloat16,) * 2 + (torch.float32,)):
            outs.append(stack(x.to(dtype), None, cache.layers, batch, rope=reference.rotary(positions, dtype))[0].float())
        expected, got, truth = (out[..., 1:] for out in outs)  # without the routing channel
        largest = truth.abs().max().item()
        ours_off, theirs_off = (got - truth).abs().max().item(), (expected - truth).abs().max().item()
        keys_off = [max((ours[i].float() - exact_layer[i].float())[slots].abs().max().item()
                        for ours, exact_layer in zip(cache.layers, caches[2].layers) for i in (0, 1))
                    for cache in caches[:2]]
        largest_key = max(layer[i][slots].abs().max().item() for layer in caches[2].layers for i in (0, 1))
        print(f"step {step}: off the fp32 layers by at most: kernels {ours_off:.4f}, the layers' bf16 decode "
              f"{theirs_off:.4f} (largest value {largest:.3f}); keys and values: kernels {keys_off[1]:.4f}, the layers' "
              f"bf16 decode {keys_off[0]:.4f} (largest {largest_key:.3f})")
        assert ours_off <= min(max(2 * theirs_off, 3e-2 * largest), 0.1 * largest)
        assert keys_off[1] <= min(max(2 * keys_off[0], 3e-2 * largest_key), 0.1 * largest_key)
        starts = starts + 1

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = kernels(x, None, caches[1].layers, batch, rope=reference.rotary(positions, torch.bfloat16))[0]
    graph.replay()
    torch.testing.assert_close(replayed.float(), outs[1])

    # six kernels, the combine inside the down projection's kernel and the routing inside the router GEMM's: the same
    # bits, eagerly and replayed twice (their arrival counters left at zero by every launch)
    kernels.moe_combine_in_down = kernels.moe_route_in_router = True  # as `use_moe_layer_kernels(folds=True)` sets
    fewer = kernels(x, None, caches[1].layers, batch, rope=reference.rotary(positions, torch.bfloat16))[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = kernels(x, None, caches[1].layers, batch, rope=reference.rotary(positions, torch.bfloat16))[0]
    assert torch.equal(fewer.float(), outs[1])
    for _ in range(2):
        replayed.zero_()
        graph.replay()
        assert torch.equal(replayed.float(), outs[1])
