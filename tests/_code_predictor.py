"""The full-size code predictor for GPU tests: random bf16 weights, and a frame's passes (two tokens, then one)."""

from __future__ import annotations

from typing import Iterator

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import FULL_CONFIG
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack

KV_LEN = 17  # a frame's cache: 2 + 15 positions


def random_code_predictor() -> DecoderStack:
    """Qwen3-Omni-30B's code predictor (5 layers, 1,024 wide, 16 query and 8 KV heads of 128) on the GPU, random
    bf16 weights (norm scales near 1)."""
    cfg = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG).talker_config.code_predictor_config
    stack = DecoderStack(DecoderSpec.from_hf(cfg)).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.03) + (1.0 if p.dim() == 1 else 0.0))
    return stack


def frame_passes(
    stack: DecoderStack, rows: int, passes: int
) -> Iterator[tuple[int, AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A frame's first `passes` passes over rows 0..rows-1 (slot i is row i): two tokens at positions 0-1, then one a
    pass. Yields each pass's first position, its batch (grouped mask built), random inputs [rows, T, 1024] and
    their rotary (cos, sin)."""
    slots = torch.arange(rows, device="cuda")
    start, length = 0, 2
    for _ in range(passes):
        batch = AttentionBatch.from_tensors(slots, torch.full_like(slots, start), length, KV_LEN, rows_are_slots=True)
        batch.grouped_mask(2)
        x = torch.randn(rows, length, 1024, device="cuda").to(torch.bfloat16)
        cos, sin = stack.rotary((start + torch.arange(length, device="cuda"))[None].expand(rows, -1), torch.bfloat16)
        yield start, batch, x, cos, sin
        start, length = start + length, 1
