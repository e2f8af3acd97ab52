"""GPU: the Thinker and Talker(+MTP) runners give the CPU's tokens and codes on CUDA. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen3OmniMoeConfig

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence, load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reply(checkpoint: Path, device: str, dtype: torch.dtype) -> tuple[list[int], list[list[int]]]:
    config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there!"}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    tc = config.thinker_config.text_config
    thinker = ThinkerRunner(load_thinker(checkpoint, config, device, dtype), config,
                            SlotKVCache(tc.num_hidden_layers, 2, 256, tc.num_key_value_heads, tc.head_dim, dtype, device))
    seq = ThinkerSequence("a", ids, SamplingParams(temperature=0.0), 64, frozenset(), for_talker=True)
    thinker.admit(seq)
    outputs: list[Any] = []
    while seq.finish_reason is None:
        outputs += thinker.step([seq])
    kc = config.talker_config.text_config
    talker = TalkerRunner(load_talker(checkpoint, config, device, dtype), config,
                          SlotKVCache(kc.num_hidden_layers, 2, 512, kc.num_key_value_heads, kc.head_dim, dtype, device), 2)
    speech = TalkerSequence("a", SamplingParams(temperature=0.0, repetition_penalty=1.05), 2302, max_frames=64)
    talker.admit(speech)
    for out in outputs:
        speech.prefix = out.talker_prefix or speech.prefix
        if out.talker_embed is not None:
            speech.text_embeds.append(out.talker_embed)
    speech.thinker_done = True
    frames: list[list[int]] = []
    while speech.finish_reason is None:
        frames += [o.codes for o in talker.step([speech]) if o.codes is not None]
    return seq.output_ids, frames


def test_cuda_decode_matches_cpu_for_64_steps(tiny_checkpoint: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_tokens, cpu_frames = _reply(tiny_checkpoint, "cpu", torch.float32)
    gpu_tokens, gpu_frames = _reply(tiny_checkpoint, "cuda", torch.float32)
    assert len(cpu_tokens) == 64 and len(cpu_frames) == 64
    assert gpu_tokens == cpu_tokens
    assert gpu_frames == cpu_frames


def test_bfloat16_runs_end_to_end_on_cuda(tiny_checkpoint: Path) -> None:
    tokens, frames = _reply(tiny_checkpoint, "cuda", torch.bfloat16)
    assert len(tokens) == 64 and len(frames) == 64


def test_grouped_moe_matches_the_loop_on_a_full_size_layer() -> None:
    from omni_ray.layers.moe import Experts

    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = Experts(128, 2048, 768).to(torch.bfloat16)
        torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
        torch.nn.init.normal_(experts.down_proj, std=0.02)
        for tokens in (1, 8, 32, 100):
            x = torch.randn(tokens, 2048, dtype=torch.bfloat16)
            chosen = torch.stack([torch.randperm(128)[:8] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, 8), -1)
            grouped, looped = experts.grouped(x, chosen, weights), experts.looped(x, chosen, weights)
            # bf16 keeps ~3 significant digits; the two paths round and sum in different orders.
            error = (grouped.float() - looped.float()).norm() / looped.float().norm()
            assert error < 1e-2, error
