"""Unit tests of batched sampling: greedy, seeds, top-k/top-p, repetition penalty, banned ids, per-row parameters."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from omni_ray.engine.sampler import (
    GREEDY,
    CounterNoise,
    NoiseSource,
    SamplingBatch,
    SamplingParams,
    draw_keys,
    filter_top_k_top_p,
    penalize_repeats,
    row_key,
    sample,
    sample_rows,
)


def _rows(n: int, vocab: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _pick(row: torch.Tensor, source: NoiseSource, history: list[int] | None = None) -> int:
    seen = None
    if history is not None:
        seen = torch.zeros(1, row.shape[-1], dtype=torch.bool)
        seen[0, history] = True
    return int(sample_rows(row[None], [source], seen)[0])


def _filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    return filter_top_k_top_p(row[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]


def test_greedy_picks_argmax() -> None:
    source = NoiseSource(SamplingParams(temperature=0.0))
    assert source.params.greedy
    for row in _rows(20, 37, seed=1):
        assert _pick(row, source) == int(torch.argmax(row))
    # bf16 input is accepted (an fp32 copy is made) and does not change the pick
    row = torch.tensor([0.5, 3.0, -1.0, 2.5]).to(torch.bfloat16)
    assert _pick(row, source) == 1


def test_sampling_does_not_modify_logits() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 4.0])
    original = row.clone()
    _pick(row, NoiseSource(SamplingParams(temperature=0.7, top_k=2, top_p=0.9, repetition_penalty=1.3, seed=0)), [0, 1, 3])
    assert torch.equal(row, original)


def test_same_seed_same_sequence_different_seeds_differ() -> None:
    rows = _rows(40, 50, seed=2, scale=0.3)  # fairly flat distributions: draws are genuinely random

    def draws(seed: int) -> list[int]:
        source = NoiseSource(SamplingParams(temperature=1.0, seed=seed))
        return [_pick(row, source) for row in rows]

    first = draws(1234)
    assert draws(1234) == first
    assert len(set(first)) > 5  # it really sampled, not argmax
    assert draws(1235) != first
    assert draws(99) != first


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    """A seeded request draws the same tokens alone and when batched with others (its own keys per row)."""
    rows = _rows(20, 30, seed=3, scale=0.3)
    alone = NoiseSource(SamplingParams(seed=7))
    expected = [_pick(r, alone) for r in rows]
    a, b, c = NoiseSource(SamplingParams(seed=7)), NoiseSource(SamplingParams(seed=8)), NoiseSource(SamplingParams())
    got = [int(sample_rows(torch.stack([r, r, r]), [b, a, c])[1]) for r in rows]
    assert got == expected


def test_draws_follow_the_distribution() -> None:
    """Gumbel-max draws are categorical samples: frequencies match softmax(logits / T)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    temperature = 0.8
    logits = torch.log(probs) * temperature  # softmax(logits / T) == probs
    params = SamplingParams(temperature=temperature, seed=5)
    sources = [NoiseSource(params.model_copy(update={"seed": seed})) for seed in range(8000)]
    noise = CounterNoise(draw_keys(sources))
    picks = sample(logits.expand(8000, -1), SamplingBatch.of([params] * 8000, "cpu"), noise)
    freq = torch.bincount(picks, minlength=4).float() / 8000
    assert torch.allclose(freq, probs, atol=0.02), freq


def test_top_k_one_equals_greedy() -> None:
    greedy = NoiseSource(SamplingParams(temperature=0.0))
    top1 = NoiseSource(SamplingParams(temperature=1.5, top_k=1, seed=0))
    for row in _rows(50, 40, seed=4, scale=0.5):
        assert _pick(row, top1) == _pick(row, greedy)


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    for row in _rows(20, 40, seed=5, scale=0.5):
        filtered = _filter(row, 0, 1e-4)
        finite = torch.isfinite(filtered).nonzero().flatten().tolist()
        assert finite == [int(torch.argmax(row))]
        assert filtered[finite[0]] == row[finite[0]]
    source = NoiseSource(SamplingParams(temperature=2.0, top_p=1e-4, seed=0))
    for row in _rows(30, 40, seed=6, scale=0.2):
        assert _pick(row, source) == int(torch.argmax(row))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probabilities 0.4, 0.3, 0.2, 0.1: top_p 0.5 keeps {0.4, 0.3} (cumulative 0.7 >= 0.5), top_p 0.75 adds 0.2
    row = torch.log(torch.tensor([0.3, 0.1, 0.4, 0.2]))
    assert torch.isfinite(_filter(row, 0, 0.5)).tolist() == [True, False, True, False]
    assert torch.isfinite(_filter(row, 0, 0.75)).tolist() == [True, False, True, True]
    assert torch.isfinite(_filter(row, 0, 1.0)).all()
    # top-k first, then top-p over what is left (the order transformers applies them in)
    assert torch.isfinite(_filter(row, 3, 0.5)).tolist() == [True, False, True, False]
    assert torch.isfinite(_filter(row, 2, 1.0)).tolist() == [True, False, True, False]


def test_filter_matches_transformers_warpers_row_by_row_in_one_batch() -> None:
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    rows = _rows(20, 64, seed=7)
    top_k = torch.tensor([[0, 1, 5, 17][i % 4] for i in range(20)])
    top_p = torch.tensor([[1.0, 0.3, 0.8, 0.95, 0.05][i % 5] for i in range(20)])
    ours = filter_top_k_top_p(rows, top_k, top_p)
    for i, row in enumerate(rows):
        ref = row[None].clone()
        if top_k[i] > 0:
            ref = TopKLogitsWarper(int(top_k[i]))(None, ref)
        if top_p[i] < 1.0:
            ref = TopPLogitsWarper(float(top_p[i]))(None, ref)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(ref[0])), (top_k[i], top_p[i])


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (0, 0.5), (4, 0.6), (4, 0.7)])
def test_masked_tokens_are_never_picked(top_k: int, top_p: float) -> None:
    # probabilities (by index) 0.05, 0.25, 0.10, 0.30, 0.20, 0.04, 0.06; top_p applies to the
    # renormalised top-k survivors (top-4: .353 .294 .235 .118, so 0.6 keeps two and 0.7 three)
    probs = torch.tensor([0.05, 0.25, 0.10, 0.30, 0.20, 0.04, 0.06])
    row = torch.log(probs)
    allowed = set(torch.isfinite(_filter(row, top_k, top_p)).nonzero().flatten().tolist())
    expected = {(3, 1.0): {1, 3, 4}, (0, 0.5): {1, 3}, (4, 0.6): {1, 3}, (4, 0.7): {1, 3, 4}}[(top_k, top_p)]
    assert allowed == expected
    source = NoiseSource(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=11))
    picks = [_pick(row, source) for _ in range(400)]
    assert set(picks) <= allowed
    assert set(picks) == allowed  # every kept token does get drawn


def test_repetition_penalty_by_hand() -> None:
    row = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 0.0]])
    seen = torch.tensor([[True, True, False, True, False, True]])
    assert torch.equal(penalize_repeats(row, seen, torch.tensor([2.0])), torch.tensor([[1.0, -2.0, 0.5, -6.0, 4.0, 0.0]]))
    # penalty 1 and an empty history leave the row alone
    assert torch.equal(penalize_repeats(row, seen, torch.tensor([1.0])), row)
    assert torch.equal(penalize_repeats(row, torch.zeros_like(seen), torch.tensor([3.0])), row)


def test_repetition_penalty_matches_transformers() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    scores = _rows(1, 50, seed=8, scale=3.0)
    history = torch.tensor([3, 7, 7, 11, 0, 49, 3, 20])
    seen = torch.zeros(1, 50, dtype=torch.bool)
    seen[0, history] = True
    for penalty in (1.05, 1.3, 0.8):
        ours = penalize_repeats(scores, seen, torch.tensor([penalty]))
        ref = RepetitionPenaltyLogitsProcessor(penalty=penalty)(history[None], scores.clone())
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)
        assert torch.equal(ours[~seen], scores[~seen])


def test_repetition_penalty_changes_the_greedy_pick() -> None:
    source = NoiseSource(SamplingParams(temperature=0.0, repetition_penalty=2.0))
    row = torch.tensor([3.0, 2.0, -5.0])
    assert _pick(row, source) == 0
    assert _pick(row, source, [0]) == 1  # 3 / 2 < 2
    assert _pick(row, source, [2]) == 0


def test_one_batch_mixes_per_row_parameters_and_never_picks_banned_ids() -> None:
    vocab = 12
    logits = _rows(3, vocab, seed=9, scale=0.2)
    banned = torch.zeros(vocab, dtype=torch.bool)
    banned[[4, 9]] = True
    logits[:, 4] = 50.0  # the highest logit of every row, by far
    logits[1, 9] = 60.0
    original = logits.clone()
    sources = [
        NoiseSource(SamplingParams(temperature=0.0)),
        NoiseSource(SamplingParams(temperature=1.0, seed=1)),
        NoiseSource(SamplingParams(temperature=3.0, top_k=5, top_p=0.9, repetition_penalty=1.2, seed=2)),
    ]
    seen = torch.zeros(3, vocab, dtype=torch.bool)
    seen[1, [0, 1]] = True
    seen[2, [4, 9, 2]] = True
    drawn: set[int] = set()
    for _ in range(200):
        picks = sample_rows(logits, sources, seen, banned).tolist()
        assert len(picks) == 3
        assert not set(picks) & {4, 9}
        drawn.update(picks[1:])
    assert len(drawn) > 3
    masked = original.clone()
    masked[:, banned] = float("-inf")
    assert picks[0] == int(torch.argmax(masked[0]))
    assert torch.equal(logits, original)  # the caller's logits are not modified
    # without the ban the banned id would have been the greedy pick
    assert int(sample_rows(logits, sources[:1])[0]) == 4


def test_padding_rows_are_greedy() -> None:
    batch = SamplingBatch.of([SamplingParams(temperature=0.5, top_k=3)], "cpu", rows=4)
    assert batch.temperature.tolist() == [0.5, 0.0, 0.0, 0.0]
    assert batch.top_k.tolist() == [3, 0, 0, 0]
    keys = draw_keys([NoiseSource(SamplingParams(temperature=0.5, seed=1))], rows=4)
    assert keys.shape == (4, 2) and keys[0].tolist() != [0, 0] and keys[1:].eq(0).all()


def test_a_batchs_keys_are_each_rows_own_and_each_draw_has_new_ones() -> None:
    """The batched hash gives each row `row_key(seed, draw)` (seeds past 32 bits too) and advances its count."""
    sources = [NoiseSource(SamplingParams(temperature=0.5, seed=seed)) for seed in (0, 7, 2**40 + 3, 2**62 + 5)]
    sources[2].draws = 1000
    expected = [list(row_key(s.seed, s.draws)) for s in sources]
    assert draw_keys(sources).tolist() == expected
    again = draw_keys(sources).tolist()
    assert again == [list(row_key(s.seed, s.draws - 1)) for s in sources] and again != expected
    assert [s.draws for s in sources] == [2, 2, 1002, 2]


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


def test_top_k_candidates_path_draws_exactly_what_the_full_sort_draws() -> None:
    """With every sampled row using top-k, filtering `cap` candidates gives the same tokens as sorting the whole
    vocabulary, for the same noise, across temperatures, top-k, top-p, greedy rows and a repetition penalty."""
    from omni_ray.engine.sampler import top_k_cap

    g = torch.Generator().manual_seed(21)
    rows, vocab = 64, 3072
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.05) if i % 7 == 0 else
              SamplingParams(temperature=[0.6, 0.9, 1.3][i % 3], top_k=[1, 5, 50, 64][i % 4],
                             top_p=[1.0, 0.8, 0.3, 0.95][i % 4], repetition_penalty=[1.0, 1.05][i % 2])
              for i in range(rows)]
    cap = top_k_cap(params)
    assert cap == 64
    batch = SamplingBatch.of(params, "cpu")
    seen = torch.rand(rows, vocab, generator=g) < 0.01
    for trial in range(5):
        logits = torch.randn(rows, vocab, generator=g) * (1 + trial)
        noise = torch.empty(rows, vocab).exponential_(generator=g)
        full = sample(logits, batch, noise, seen)
        candidates = sample(logits, batch, noise, seen, top_k_cap=cap)
        assert torch.equal(full, candidates)
    assert top_k_cap([SamplingParams(temperature=1.0)]) is None  # a row without top-k needs the full sort
    assert top_k_cap([SamplingParams(temperature=0.0)]) is None


def test_counter_noise_is_exponential_and_independent_across_rows_draws_and_tokens() -> None:
    """The hash-made noise: mean and variance of Exp(1), no correlation between neighbouring tokens, rows or
    consecutive draws of one row, and the noise of a token does not depend on which other tokens are asked."""
    source = NoiseSource(SamplingParams(seed=3))
    first, second = (CounterNoise(draw_keys([source])).dense(200_000)[0] for _ in range(2))
    for noise in (first, second):
        assert noise.min() > 0 and abs(noise.mean() - 1) < 0.01 and abs(noise.var() - 1) < 0.02
    rows = CounterNoise(draw_keys([NoiseSource(SamplingParams(seed=s)) for s in range(2)])).dense(200_000)

    def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([a, b]))[0, 1])

    assert abs(correlation(first[:-1], first[1:])) < 0.01  # neighbouring tokens
    assert abs(correlation(first, second)) < 0.01  # consecutive draws
    assert abs(correlation(rows[0], rows[1])) < 0.01  # seeds 0 and 1
    keys = draw_keys([NoiseSource(SamplingParams(seed=s)) for s in range(2)])
    ids = torch.tensor([[7, 199_999, 3], [5, 0, 123_456]])
    dense = CounterNoise(keys).dense(200_000)
    assert torch.equal(CounterNoise(keys).at(ids), dense.gather(-1, ids))  # a token's noise alone = in the whole row
    assert torch.equal(CounterNoise(keys, offset=100).at(ids[:, :1]), dense.gather(-1, ids[:, :1] + 100))


def test_fused_sample_draws_what_eager_sampling_draws() -> None:
    """The compiled sampler (the Talker's frame graph uses it with compiled layers) makes the same top-k/top-p
    decisions and noise as eager `sample`, with and without a repetition penalty and banned tokens, across draw
    offsets (one compiled graph serves them all)."""
    from omni_ray.engine.sampler import fused_sample

    torch.manual_seed(0)
    rows, vocab = 16, 2048
    params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.8, repetition_penalty=1.05)] * (rows - 2) + [GREEDY] * 2
    batch = SamplingBatch.from_table(SamplingBatch.table(params))
    banned = torch.zeros(vocab, dtype=torch.bool)
    banned[-100:] = True
    for draw in range(4):
        keys = torch.randint(0, 2**32, (rows, 2))
        logits = torch.randn(rows, vocab) * 3
        seen = torch.rand(rows, vocab) < 0.05
        noise = CounterNoise(keys, draw * vocab)
        fused = fused_sample(logits, batch, noise, seen, banned, True, 64)
        assert torch.equal(fused, sample(logits, batch, noise, seen, banned, True, 64))
        assert not banned[fused].any()
        assert torch.equal(fused_sample(logits, batch, noise, filtered=True, top_k_cap=64),
                           sample(logits, batch, noise, filtered=True, top_k_cap=64))
