"""The Thinker runner's batched draw: a request's tokens do not depend on what it is batched with, whatever the mix
of greedy, penalized and filtered rows (one draw per step over a padded row bucket)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import benchmark_prompt_ids
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

REQUESTS = {
    "greedy": SamplingParams(temperature=0.0),
    "penalized": SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=11),
    "filtered": SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=12),
}


def _replies(
    checkpoint: Path, names: list[str], tokens: int = 10, prefill_graph_tokens: int | None = None,
    prompt_lengths: tuple[int, ...] = (20, 20, 20), max_prefill_tokens: int = 8192,
) -> dict[str, list[int]]:
    config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
    text = config.thinker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, 4, 128, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    runner = ThinkerRunner(load_thinker(checkpoint, config, "cpu", torch.float32), config, cache,
                           max_prefill_tokens=max_prefill_tokens, prefill_graph_tokens=prefill_graph_tokens)
    seqs = [ThinkerSequence(name, benchmark_prompt_ids(config, prompt_lengths[i], i), REQUESTS[name], tokens, frozenset())
            for i, name in enumerate(REQUESTS) if name in names]
    for seq in seqs:
        runner.admit(seq)
    while any(s.finish_reason is None for s in seqs):
        runner.step([s for s in seqs if s.finish_reason is None])
    return {s.request_id: s.output_ids for s in seqs}


def test_a_requests_tokens_do_not_depend_on_its_batch(tiny_checkpoint: Path) -> None:
    together = _replies(tiny_checkpoint, list(REQUESTS))  # three rows: a bucket of four with a padding row
    alone = {name: _replies(tiny_checkpoint, [name])[name] for name in REQUESTS}
    assert together == alone
    assert all(len(tokens) == 10 for tokens in together.values())
    assert len(set(together["penalized"])) > 1  # sampled, not stuck on one token


def test_a_prefill_without_bucket_padding_makes_the_same_tokens(tiny_checkpoint: Path) -> None:
    """Prompts of 20, 37 and 9 tokens prefilled as one batch at their bucket (4 rows x 64 positions) and at their own
    shape (3 rows x 48: `prefill_graph_tokens=0`) make the same replies."""
    lengths = (20, 37, 9)
    bucketed = _replies(tiny_checkpoint, list(REQUESTS), prompt_lengths=lengths)
    assert _replies(tiny_checkpoint, list(REQUESTS), prefill_graph_tokens=0, prompt_lengths=lengths) == bucketed


def test_prompts_past_the_prefill_budget_prefill_in_later_steps_with_the_same_tokens(tiny_checkpoint: Path) -> None:
    """Three admitted prompts and a budget of one prompt's bucket (32 positions): each later step prefills the next
    prompt while the earlier ones decode (their slots in between held by prompts not yet prefilled). The replies
    equal those of one prefill of all three."""
    together = _replies(tiny_checkpoint, list(REQUESTS))
    assert _replies(tiny_checkpoint, list(REQUESTS), max_prefill_tokens=32) == together
