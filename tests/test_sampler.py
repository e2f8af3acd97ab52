"""Unit tests of per-request sampling: greedy, seeds, top-k/top-p, repetition penalty, suppressed ids."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from omni_ray.engine.sampler import (
    RequestSampler,
    SamplingParams,
    apply_repetition_penalty,
    filter_top_k_top_p,
    sample_batch,
)


def _rows(n: int, vocab: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_picks_argmax() -> None:
    sampler = RequestSampler(SamplingParams(temperature=0.0))
    assert sampler.params.greedy
    for row in _rows(20, 37, seed=1):
        assert sampler.pick(row) == int(torch.argmax(row))
    # bf16 input is accepted (an fp32 copy is made) and does not change the pick
    row = torch.tensor([0.5, 3.0, -1.0, 2.5]).to(torch.bfloat16)
    assert sampler.pick(row) == 1


def test_pick_does_not_modify_logits() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 4.0])
    original = row.clone()
    RequestSampler(SamplingParams(temperature=0.7, top_k=2, top_p=0.9, repetition_penalty=1.3, seed=0)).pick(
        row, torch.tensor([0, 1, 3])
    )
    assert torch.equal(row, original)


def test_same_seed_same_sequence_different_seeds_differ() -> None:
    rows = _rows(40, 50, seed=2, scale=0.3)  # fairly flat distributions: draws are genuinely random

    def draws(seed: int) -> list[int]:
        sampler = RequestSampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.pick(row) for row in rows]

    first = draws(1234)
    assert draws(1234) == first
    assert len(set(first)) > 5  # it really sampled, not argmax
    assert draws(1235) != first
    assert draws(99) != first


def test_each_request_has_its_own_generator() -> None:
    """Interleaving two seeded requests does not change either one's sequence."""
    rows = _rows(20, 30, seed=3, scale=0.3)
    alone = RequestSampler(SamplingParams(seed=7))
    expected = [alone.pick(r) for r in rows]
    a = RequestSampler(SamplingParams(seed=7))
    b = RequestSampler(SamplingParams(seed=8))
    got = []
    for r in rows:
        got.append(a.pick(r))
        b.pick(r)
    assert got == expected


def test_top_k_one_equals_greedy() -> None:
    greedy = RequestSampler(SamplingParams(temperature=0.0))
    top1 = RequestSampler(SamplingParams(temperature=1.5, top_k=1, seed=0))
    for row in _rows(50, 40, seed=4, scale=0.5):
        assert top1.pick(row) == greedy.pick(row)


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    for row in _rows(20, 40, seed=5, scale=0.5):
        filtered = filter_top_k_top_p(row, 0, 1e-4)
        finite = torch.isfinite(filtered).nonzero().flatten().tolist()
        assert finite == [int(torch.argmax(row))]
        assert filtered[finite[0]] == row[finite[0]]
    sampler = RequestSampler(SamplingParams(temperature=2.0, top_p=1e-4, seed=0))
    for row in _rows(30, 40, seed=6, scale=0.2):
        assert sampler.pick(row) == int(torch.argmax(row))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities 0.4, 0.3, 0.2, 0.1: top_p 0.5 keeps {0.4, 0.3} (cumulative 0.7 >= 0.5), top_p 0.75 adds 0.2
    row = torch.log(torch.tensor([0.3, 0.1, 0.4, 0.2]))
    assert torch.isfinite(filter_top_k_top_p(row, 0, 0.5)).tolist() == [True, False, True, False]
    assert torch.isfinite(filter_top_k_top_p(row, 0, 0.75)).tolist() == [True, False, True, True]
    assert torch.isfinite(filter_top_k_top_p(row, 0, 1.0)).all()
    # top-k first, then top-p over what is left (the order transformers applies them in)
    assert torch.isfinite(filter_top_k_top_p(row, 3, 0.5)).tolist() == [True, False, True, False]
    assert torch.isfinite(filter_top_k_top_p(row, 2, 1.0)).tolist() == [True, False, True, False]


def test_filter_matches_transformers_warpers() -> None:
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    for i, row in enumerate(_rows(20, 64, seed=7)):
        top_k = [0, 1, 5, 17][i % 4]
        top_p = [1.0, 0.3, 0.8, 0.95, 0.05][i % 5]
        ours = filter_top_k_top_p(row, top_k, top_p)
        ref = row[None].clone()
        if top_k > 0:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1.0:
            ref = TopPLogitsWarper(top_p)(None, ref)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref[0])), (top_k, top_p)


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.5), (4, 0.6), (4, 0.7)])
def test_masked_tokens_are_never_picked(top_k: int, top_p: float) -> None:
    # probabilities (by index) 0.05, 0.25, 0.10, 0.30, 0.20, 0.04, 0.06; top_p applies to the
    # renormalised top-k survivors (top-4: .353 .294 .235 .118, so 0.6 keeps two and 0.7 three)
    probs = torch.tensor([0.05, 0.25, 0.10, 0.30, 0.20, 0.04, 0.06])
    row = torch.log(probs)
    allowed = set(torch.isfinite(filter_top_k_top_p(row, top_k, top_p)).nonzero().flatten().tolist())
    expected = {(3, 1.0): {1, 3, 4}, (0, 0.5): {1, 3}, (4, 0.6): {1, 3}, (4, 0.7): {1, 3, 4}}[(top_k, top_p)]
    assert allowed == expected
    sampler = RequestSampler(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=11))
    picks = [sampler.pick(row) for _ in range(400)]
    assert set(picks) <= allowed
    assert set(picks) == allowed  # every kept token does get drawn


def test_repetition_penalty_by_hand() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, -3.0, 4.0, 0.0])
    history = torch.tensor([0, 1, 1, 3, 5])
    apply_repetition_penalty(row, history, 2.0)
    assert torch.equal(row, torch.tensor([1.0, -2.0, 0.5, -6.0, 4.0, 0.0]))
    # penalty 1 and an empty history leave the row alone
    row2 = torch.tensor([2.0, -1.0])
    apply_repetition_penalty(row2, torch.tensor([0, 1]), 1.0)
    apply_repetition_penalty(row2, torch.tensor([], dtype=torch.long), 3.0)
    assert torch.equal(row2, torch.tensor([2.0, -1.0]))


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    scores = _rows(1, 50, seed=8, scale=3.0)
    history = torch.tensor([3, 7, 7, 11, 0, 49, 3, 20])
    for penalty in (1.05, 1.3, 0.8):
        ours = scores[0].clone()
        apply_repetition_penalty(ours, history, penalty)
        ref = RepetitionPenaltyLogitsProcessor(penalty=penalty)(history[None], scores.clone())
        torch.testing.assert_close(ours, ref[0], rtol=0, atol=0)
        unseen = torch.ones(50, dtype=torch.bool)
        unseen[history] = False
        assert torch.equal(ours[unseen], scores[0][unseen])


def test_repetition_penalty_changes_the_greedy_pick() -> None:
    sampler = RequestSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0))
    row = torch.tensor([3.0, 2.0, -5.0])
    assert sampler.pick(row) == 0
    assert sampler.pick(row, torch.tensor([0])) == 1  # 3 / 2 < 2
    assert sampler.pick(row, torch.tensor([2])) == 0


def test_sample_batch_never_picks_suppressed_ids() -> None:
    vocab = 12
    logits = _rows(3, vocab, seed=9, scale=0.2)
    suppress = torch.tensor([4, 9])
    logits[:, 4] = 50.0  # the highest logit of every row, by far
    logits[1, 9] = 60.0
    original = logits.clone()
    samplers = [
        RequestSampler(SamplingParams(temperature=0.0)),
        RequestSampler(SamplingParams(temperature=1.0, seed=1)),
        RequestSampler(SamplingParams(temperature=3.0, top_k=5, top_p=0.9, repetition_penalty=1.2, seed=2)),
    ]
    histories = [None, torch.tensor([0, 1]), torch.tensor([4, 9, 2])]
    seen: set[int] = set()
    for _ in range(200):
        picks = sample_batch(logits, samplers, histories, suppress)
        assert len(picks) == 3
        assert not set(picks) & {4, 9}
        seen.update(picks[1:])
    assert len(seen) > 3
    masked = original.clone()
    masked[:, suppress] = float("-inf")
    assert picks[0] == int(torch.argmax(masked[0]))
    assert torch.equal(logits, original)  # the caller's logits are not modified
    # without suppression the suppressed id would have been the greedy pick
    assert sample_batch(logits, samplers[:1], [None])[0] == 4
    assert sample_batch(logits, samplers[:1], [None], torch.tensor([], dtype=torch.long))[0] == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": 11.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.2},
        {"top_k": -1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
        {"max_tokens": 5},
        {"temprature": 0.5},
    ],
)
def test_sampling_params_rejects_out_of_range(kwargs: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_boundaries_and_is_frozen() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    SamplingParams(temperature=10.0, top_p=1e-6, top_k=100, seed=0)
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_k == 0 and params.top_p == 1.0 and not params.greedy
    with pytest.raises(ValidationError):
        params.temperature = 0.0  # type: ignore[misc]
