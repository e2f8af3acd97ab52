"""One codebook-completion pass (Qwen3-Omni's MTP, a Dual-AR fast AR): decoder stack → code head → sample → embedding."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from omni_ray.engine.sampler import CounterNoise, SamplingBatch, sample
from omni_ray.engine.top_k_draw import KernelDraw
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderStack
from omni_ray.layers.persistent_pass import CodeDraw


def codebook_pass(
    stack: DecoderStack,
    embeds: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    batch: AttentionBatch,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head: torch.Tensor,
    table: torch.Tensor,
    feedback: torch.Tensor | None,
    params: SamplingBatch,
    noise_keys: torch.Tensor,
    noise_offset: int,
    filtered: bool,
    top_k_cap: int | None,
    draw: Callable[..., torch.Tensor] = sample,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One code group for every row: `embeds` [B, T, h] through the stack (its keys into `kv_caches` as `batch` says),
    the last position's logits by `head` [V, h], one draw per row (noise from `noise_keys` shifted by
    `noise_offset`), and that code's embedding in `table` [V, h]. Returns codes [B], their embeddings [B, 1, h] (the
    next pass's input) and `feedback` [B, h] plus those embeddings (a frame's summed code embedding, built as it goes;
None where the caller makes a frame's embedding from its codes instead).
    `draw`: `sample`, or a faster draw with its signature (`fused_sample`, `top_k_draw.KernelDraw`).
    Graph-capturable.

    Compiling the whole pass as one inductor graph made a Talker step 0.6-1.0 ms faster on an H200 in the same GPU
    time, and the service's startup over 80 s longer: compiled layers and a one-kernel draw are what the Talker
    uses."""
    if isinstance(draw, KernelDraw) and feedback is not None and filtered and top_k_cap is not None:
        # the persistent pass's launch draws too, where it runs this pass and takes the cap (`draw_applies`)
        drawn = stack.last_draw(embeds, kv_caches, batch, (cos, sin), head, CodeDraw(
            params.temperature, params.top_k, params.top_p, noise_keys, noise_offset, top_k_cap, table, feedback))
        if drawn is not None:
            return drawn[0], drawn[1][:, None], drawn[2]
    logits = stack.last_logits(embeds, kv_caches, batch, (cos, sin), head)
    noise = CounterNoise(noise_keys, noise_offset)
    if isinstance(draw, KernelDraw) and feedback is not None:  # the lookup and the sum inside the draw's kernel
        code, embedded, feedback = draw.draw_and_embed(logits, params, noise, filtered, top_k_cap, table, feedback)
        return code, embedded[:, None], feedback
    code = draw(logits, params, noise, filtered=filtered, top_k_cap=top_k_cap)
    embedded = F.embedding(code, table)
    return code, embedded[:, None], None if feedback is None else feedback + embedded
