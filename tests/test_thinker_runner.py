"""The Thinker runner's batched draws: a request's tokens do not depend on what it is batched with, whatever the mix
of greedy, sampled, penalized and filtered rows, and whether its step's draw runs inside the decode step (greedy and
temperature-only batches) or apart from it (penalized or filtered ones, and prefills)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
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
    "sampled": SamplingParams(temperature=0.7, seed=13),
}
# Decodes that draw apart from the decode step (a penalized or a filtered row among them) and inside it (greedy and
# temperature-only rows); with prefills spread over steps, the second mix's early decodes draw inside theirs too.
MIXES = [["greedy", "penalized", "filtered"], ["greedy", "sampled", "filtered"], ["greedy", "sampled"]]


def _admitted(
    checkpoint: Path, names: list[str], tokens: int = 10, prefill_graph_tokens: int | None = None,
    prompt_lengths: tuple[int, ...] = (20, 20, 20, 20), max_prefill_tokens: int = 8192, early_first_tokens: bool = True,
    split_large_prefills: bool = False,
) -> tuple[ThinkerRunner, list[ThinkerSequence]]:
    """The requests `names` admitted together: the runner and the sequences."""
    config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
    text = config.thinker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, 4, 128, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    runner = ThinkerRunner(load_thinker(checkpoint, config, "cpu", torch.float32), config, cache,
                           max_prefill_tokens=max_prefill_tokens, prefill_graph_tokens=prefill_graph_tokens,
                           early_first_tokens=early_first_tokens, split_large_prefills=split_large_prefills)
    seqs = [ThinkerSequence(name, benchmark_prompt_ids(config, prompt_lengths[i], i), REQUESTS[name], tokens, frozenset())
            for i, name in enumerate(REQUESTS) if name in names]
    for seq in seqs:
        runner.admit(seq)
    return runner, seqs


def _stepped(checkpoint: Path, names: list[str], **options: Any) -> tuple[ThinkerRunner, list[ThinkerSequence]]:
    """The requests `names` admitted together (`_admitted`) and stepped to their ends."""
    runner, seqs = _admitted(checkpoint, names, **options)
    while any(s.finish_reason is None for s in seqs):
        runner.step([s for s in seqs if s.finish_reason is None])
    return runner, seqs


def _replies(checkpoint: Path, names: list[str], **options: Any) -> dict[str, list[int]]:
    _, seqs = _stepped(checkpoint, names, **options)
    return {s.request_id: s.output_ids for s in seqs}


@pytest.mark.parametrize("names", MIXES[::2], ids="+".join)
def test_a_requests_tokens_do_not_depend_on_its_batch(tiny_checkpoint: Path, names: list[str]) -> None:
    together = _replies(tiny_checkpoint, names)  # two or three rows: a padded bucket of two or four
    alone = {name: _replies(tiny_checkpoint, [name])[name] for name in names}
    assert together == alone
    assert all(len(tokens) == 10 for tokens in together.values())
    assert len(set(together[names[1]])) > 1  # sampled, not stuck on one token


def test_a_prefill_without_bucket_padding_makes_the_same_tokens(tiny_checkpoint: Path) -> None:
    """Prompts of 20, 37 and 9 tokens prefilled as one batch at their bucket (4 rows x 64 positions) and at their own
    shape (3 rows x 48: `prefill_graph_tokens=0`) make the same replies."""
    lengths = (20, 37, 9, 30)
    bucketed = _replies(tiny_checkpoint, MIXES[0], prompt_lengths=lengths)
    assert _replies(tiny_checkpoint, MIXES[0], prefill_graph_tokens=0, prompt_lengths=lengths) == bucketed


def test_a_prefill_split_into_graph_sized_parts_makes_the_same_tokens(tiny_checkpoint: Path) -> None:
    """Four prompts of 20, 37, 9 and 30 tokens past a 128-token graph limit at their bucket (4 rows x 64), with
    `split_large_prefills`: two parts of two rows at the batch's length, one prefill batch, the same replies (and
    so the same Talker prefixes, which the parts' rows make) as the whole bucket."""
    lengths = (20, 37, 9, 30)
    names = MIXES[0] + ["sampled"]
    bucketed = _replies(tiny_checkpoint, names, prompt_lengths=lengths)
    runner, seqs = _admitted(tiny_checkpoint, names, prefill_graph_tokens=128, prompt_lengths=lengths,
                             split_large_prefills=True)
    keys: list[object] = []
    run = runner.graphs.run
    runner.graphs.run = lambda key, fn, inputs: keys.append(key) or run(key, fn, inputs)  # type: ignore[method-assign]
    while any(s.finish_reason is None for s in seqs):
        runner.step([s for s in seqs if s.finish_reason is None])
    assert {s.request_id: s.output_ids for s in seqs} == bucketed
    assert [k for k in keys if k[0] == "prefill"] == [("prefill", 2, 64), ("prefill", 2, 64)]  # type: ignore[index]
    assert runner.prefills.batches == 1 and runner.prefills.sequences == 4


@pytest.mark.parametrize("names", MIXES[:2], ids="+".join)
def test_prompts_past_the_prefill_budget_prefill_in_later_steps_with_the_same_tokens(
    tiny_checkpoint: Path, names: list[str],
) -> None:
    """Three admitted prompts and a budget of one prompt's bucket (32 positions): each later step prefills the next
    prompt while the earlier ones decode (their slots in between held by prompts not yet prefilled), so a step draws
    twice, its prefill's row and its decode's rows. The replies equal those of one prefill of all three."""
    runner, seqs = _stepped(tiny_checkpoint, names)
    assert (runner.prefills.batches, runner.prefills.sequences) == (1, len(names))
    runner, split = _stepped(tiny_checkpoint, names, max_prefill_tokens=32)
    assert {s.request_id: s.output_ids for s in split} == {s.request_id: s.output_ids for s in seqs}
    assert (runner.prefills.batches, runner.prefills.sequences) == (len(names), len(names))  # one prompt a step


def test_a_steps_prefill_is_read_back_ahead_of_its_decode_with_the_same_tokens(tiny_checkpoint: Path) -> None:
    """A budget of one prompt: the second step prefills the second request while the first decodes. Its prefill's
    reads are queued ahead of the decode: `collect_early` gives the new request's first token alone, `collect` the
    decode's row, and the replies equal those of steps read back whole (`early_first_tokens=False`)."""
    names = MIXES[2]
    runner, seqs = _admitted(tiny_checkpoint, names, max_prefill_tokens=32)
    runner.step(seqs)  # the first prompt's prefill
    pending = runner.launch(seqs)
    assert pending.early is not None
    early = runner.collect_early(pending)
    assert [(out.request_id, out.token) for out in early] == [(seqs[1].request_id, seqs[1].output_ids[0])]
    assert pending.early is None and runner.collect_early(pending) == []
    rest = runner.collect(pending)
    assert [out.request_id for out in rest] == [seqs[0].request_id] and len(seqs[0].output_ids) == 2
    while any(s.finish_reason is None for s in seqs):
        runner.step([s for s in seqs if s.finish_reason is None])  # `collect` reads an early part itself too
    whole = _replies(tiny_checkpoint, names, max_prefill_tokens=32, early_first_tokens=False)
    assert {s.request_id: s.output_ids for s in seqs} == whole
    assert all(len(tokens) == 10 for tokens in whole.values())
