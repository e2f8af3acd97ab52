"""GPU: the five-kernel dense layer (`layers/small_batch.py`) against the eager layer on the full-size code
predictor's shapes, eagerly and replayed from a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from _code_predictor import KV_LEN, frame_passes, random_code_predictor
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers import small_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_kernels_equal_the_eager_code_predictor_on_the_gpu(rows: int) -> None:
    """Qwen3-Omni-30B's code predictor (5 layers, 1,024 wide, 16 query and 8 KV heads of 128), random bf16 weights,
    a frame's first four passes (two tokens, then one): the hidden states and the keys and values written agree
    with the eager layers to bf16 rounding, and a graph replay gives the kernels' eager output. So do the last
    position's logits with the final norm inside the code head's GEMM."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    eager = random_code_predictor()
    fused = copy.deepcopy(eager)
    eager.fuse_projections()
    assert fused.use_small_batch_kernels()
    caches = [SlotKVCache(5, 32, KV_LEN, 8, 128, torch.bfloat16, "cuda") for _ in range(2)]
    for _, batch, x, cos, sin in frame_passes(eager, rows, 4):
        assert all(small_batch.applies(layer, x, batch) for layer in fused.layers)
        expected = eager(x, None, caches[0].layers, batch, rope=(cos, sin))[0].float()
        got = fused(x, None, caches[1].layers, batch, rope=(cos, sin))[0].float()
        assert (got - expected).abs().max().item() < 3e-2 * expected.abs().max().item()
        for (k0, v0), (k1, v1) in zip(caches[0].layers, caches[1].layers):
            assert (k0.float() - k1.float()).abs().max().item() < 0.1
            assert (v0.float() - v1.float()).abs().max().item() < 0.1

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused(x, None, caches[1].layers, batch, rope=(cos, sin))[0]
    graph.replay()
    torch.testing.assert_close(replayed.float(), got)

    # the final norm inside the code head's GEMM (2,048 codes), against the norm, then the GEMM
    head = torch.randn(2048, 1024, device="cuda").to(torch.bfloat16) * 0.03
    hidden = torch.randn(rows, 2, 1024, device="cuda").to(torch.bfloat16)
    expected = eager.head_logits(hidden, head).float()
    logits = fused.head_logits(hidden, head)
    assert (logits.float() - expected).abs().max().item() < 3e-2 * expected.abs().max().item()
