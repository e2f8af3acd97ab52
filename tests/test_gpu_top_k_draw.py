"""GPU: the Triton top-k draw against eager `sample` on full-size Talker rows (3,072 group-0 logits with penalty and
banned ids, 2,048 code-predictor logits), eagerly and replayed from a CUDA graph. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from omni_ray.engine.sampler import CounterNoise, NoiseSource, SamplingBatch, draw_keys, sample
from omni_ray.engine.top_k_draw import top_k_draw
from omni_ray.models.qwen3_omni.orchestrator import DEFAULT_TALKER_SAMPLING
from omni_ray.models.qwen3_omni.talker import MTP_SAMPLING

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("group0", [True, False], ids=["group0", "code-predictor"])
def test_kernel_draws_eagers_tokens_on_the_gpu(group0: bool) -> None:
    """64 rounds of 32 rows: the kernel's token equals eager `sample`'s, but for the rare draw where the GPU's fast
    exp/log moves a top-p cumulative or a noisy score across a tie (at most 2 of 2,048), and a graph replay of the
    kernel draws what its eager call drew."""
    pytest.importorskip("triton")
    rows, vocab = 32, 3072 if group0 else 2048
    params = [(DEFAULT_TALKER_SAMPLING if group0 else MTP_SAMPLING).model_copy(update={"seed": i}) for i in range(rows)]
    batch = SamplingBatch.of(params, "cuda")
    sources = [NoiseSource(p) for p in params]
    generator = torch.Generator(device="cuda").manual_seed(0)
    banned = torch.zeros(rows, vocab, dtype=torch.bool, device="cuda")
    if group0:
        banned[:, 2048:] = True
        banned[:, 2150] = False
    kernel, eager = [], []
    for _ in range(64):
        logits = (4 * torch.randn(rows, vocab, device="cuda", generator=generator)).to(torch.bfloat16)
        seen = torch.rand(rows, vocab, device="cuda", generator=generator) < 0.05 if group0 else None
        noise = CounterNoise(draw_keys(sources).cuda(), 0 if group0 else 4096)
        ban = banned if group0 else None
        kernel.append(top_k_draw(logits, batch, noise, 64, seen, ban))
        eager.append(sample(logits, batch, noise, seen, ban, True, 64))
    kernel_tokens, eager_tokens = torch.stack(kernel), torch.stack(eager)
    differing = int((kernel_tokens != eager_tokens).sum())
    print(f"{differing} of {kernel_tokens.numel()} draws differ")
    assert differing <= 2
    assert len(set(kernel_tokens[-1].tolist())) > 16  # rows draw their own tokens

    graph = torch.cuda.CUDAGraph()
    top_k_draw(logits, batch, noise, 64, seen, ban)  # compiled for these arguments before the capture
    with torch.cuda.graph(graph):
        replayed = top_k_draw(logits, batch, noise, 64, seen, ban)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, kernel[-1])


def test_the_draw_that_embeds_its_codes_on_the_gpu() -> None:
    """A code-predictor draw for 32 rows over 2,048 logits with the codebook's 1,024-wide table: the kernel's codes
    are `top_k_draw`'s, its embeddings the table's rows, and feedback + embeddings torch's bf16 sum bit for bit
    (both round to nearest even); a graph replay gives the eager call's outputs."""
    pytest.importorskip("triton")
    from omni_ray.engine.top_k_draw import top_k_draw_and_embed

    rows, vocab, width = 32, 2048, 1024
    params = [MTP_SAMPLING.model_copy(update={"seed": i}) for i in range(rows)]
    batch = SamplingBatch.of(params, "cuda")
    noise = CounterNoise(draw_keys([NoiseSource(p) for p in params]).cuda(), 4096)
    generator = torch.Generator(device="cuda").manual_seed(1)
    logits = (4 * torch.randn(rows, vocab, device="cuda", generator=generator)).to(torch.bfloat16)
    table = torch.randn(vocab, width, device="cuda", generator=generator).to(torch.bfloat16)
    feedback = torch.randn(rows, width, device="cuda", generator=generator).to(torch.bfloat16)
    codes, embedded, summed = top_k_draw_and_embed(logits, batch, noise, 64, table, feedback)
    assert torch.equal(codes, top_k_draw(logits, batch, noise, 64))
    assert len(set(codes.tolist())) > 16
    assert torch.equal(embedded, table[codes]) and torch.equal(summed, feedback + table[codes])

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = top_k_draw_and_embed(logits, batch, noise, 64, table, feedback)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(replayed, (codes, embedded, summed)))
