"""S2 Pro's Dual-AR on the shared codec Talker engine: greedy frames equal the official code's (goldens of fish-speech
3dd1f85 on the tiny checkpoints), requests stepped together equal each alone, the frame cap, seeded sampling, and
fish-speech's draw order and repetition-aware sampling in the shared sampler; seeded draws follow the official
sampler's distributions (the goldens' `sampling_distribution`: support and chi-square)."""

from __future__ import annotations

import functools
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chi2

from omni_ray.engine.codec_sequence import TalkerStepOutput
from omni_ray.engine.loop import run_to_end
from omni_ray.engine.sampler import (
    CounterNoise, FilterOrder, RepetitionAwareSampling, SamplingBatch, SamplingParams, draw_keys, NoiseSource, sample,
    top_k_cap,
)
from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint
from omni_ray.models.s2_pro.dual_ar_runner import (
    DEFAULT_SAMPLING, DualARRunner, DualARSequence, dual_ar_sequence, frame_codes, load,
)

GOLDENS = Path(__file__).parent / "goldens" / "s2_pro"
SEEDS = (0, 1)
CASES = ("plain", "one_reference", "two_references", "long_text")
TOP_K_1 = SamplingParams(temperature=1.0, top_k=1, top_p=1.0)  # the goldens' greedy draw


@lru_cache(maxsize=None)
def golden(seed: int) -> dict[str, Any]:
    return json.loads((GOLDENS / f"dual_ar_seed{seed}.json").read_text())


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> dict[int, DualARRunner]:
    """One four-slot runner per tiny checkpoint, float32 on the CPU."""
    directory = tmp_path_factory.mktemp("s2_pro_engine")
    return {seed: load(write_tiny_checkpoint(directory / f"seed{seed}", seed), 4, dtype=torch.float32,
                       cuda_graphs=False) for seed in SEEDS}


def prompt_of(seed: int, case: str) -> torch.Tensor:
    return torch.tensor(golden(seed)["cases"][case]["prompt"], dtype=torch.long)


def frames_of(outputs: list[TalkerStepOutput]) -> list[list[int]]:
    return [out.codes for out in outputs if out.codes is not None]


def speak_alone(run: DualARRunner, seq: DualARSequence) -> list[TalkerStepOutput]:
    run.admit(seq)
    return run_to_end(run, [seq])[seq.request_id]


def speak_staggered(run: DualARRunner, seqs: list[DualARSequence], join_at: int) -> dict[str, list[TalkerStepOutput]]:
    """The first two sequences from step 0, the others joining at step `join_at`; each released as it ends."""
    outputs: dict[str, list[TalkerStepOutput]] = {seq.request_id: [] for seq in seqs}
    active: list[DualARSequence] = []
    step = 0
    while step <= join_at or any(seq.finish_reason is None for seq in active):
        joining = seqs[:2] if step == 0 else seqs[2:] if step == join_at else []
        for seq in joining:
            run.admit(seq)
        active += joining
        for out in run.step([seq for seq in active if seq.finish_reason is None]):
            outputs[out.request_id].append(out)
        for seq in active:
            if seq.finish_reason is not None and seq.slot >= 0:
                run.release(seq)
        step += 1
    return outputs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES)
def test_greedy_frames_equal_the_official_code(runners: dict[int, DualARRunner], seed: int, case: str) -> None:
    """Every frame [token, code 0..9] up to the official `<|im_end|>` frame, which ends the reply unspoken."""
    expected = golden(seed)["cases"][case]["frames"]
    eos = golden(seed)["eos_id"]
    ends = next((i for i, frame in enumerate(expected) if frame[0] == eos), None)
    outputs = speak_alone(runners[seed], dual_ar_sequence(case, prompt_of(seed, case), len(expected), TOP_K_1))
    assert frames_of(outputs) == expected[:ends]
    assert outputs[-1].finish_reason == ("length" if ends is None else "stop")


def test_four_requests_together_and_staggered_each_equal_their_own(runners: dict[int, DualARRunner]) -> None:
    run = runners[0]
    prompts = [prompt_of(0, case) for case in CASES[:3]] + [run.prompt("A second, longer sentence to speak.")]

    def requests() -> list[DualARSequence]:
        sampled = [DEFAULT_SAMPLING.model_copy(update={"seed": 11 + i}) for i in range(3)] + [TOP_K_1]
        return [dual_ar_sequence(f"r{i}", prompt, 8, sampling) for i, (prompt, sampling) in enumerate(zip(prompts, sampled))]

    alone = {seq.request_id: frames_of(speak_alone(run, seq)) for seq in requests()}
    assert all(alone.values()) and len({str(frames) for frames in alone.values()}) == 4
    batch = requests()
    for seq in batch:
        run.admit(seq)
    together = run_to_end(run, batch)
    assert {key: frames_of(outs) for key, outs in together.items()} == alone
    staggered = speak_staggered(run, requests(), join_at=3)
    assert {key: frames_of(outs) for key, outs in staggered.items()} == alone


def test_a_reply_the_frame_cap_ends_finishes_with_length(runners: dict[int, DualARRunner]) -> None:
    outputs = speak_alone(runners[0], dual_ar_sequence("capped", prompt_of(0, "plain"), 3, TOP_K_1))
    assert frames_of(outputs) == golden(0)["cases"]["plain"]["frames"][:3]
    assert [out.finish_reason for out in outputs] == [None, None, "length"]
    assert frame_codes(outputs[0]) == outputs[0].codes[1:] and len(frame_codes(outputs[0]) or []) == 10


def test_seeded_sampling_repeats_for_its_seed_and_differs_for_another(runners: dict[int, DualARRunner]) -> None:
    run = runners[1]

    def frames(seed: int) -> list[list[int]]:
        sampling = DEFAULT_SAMPLING.model_copy(update={"seed": seed})
        seq = dual_ar_sequence(f"seed{seed}", prompt_of(1, "one_reference"), 8, sampling, ignore_eos=True)
        return frames_of(speak_alone(run, seq))

    first = frames(5)
    assert len(first) == 8 and frames(5) == first and frames(6) != first
    tokens = {frame[0] for frame in first}
    config = run.config
    assert all(config.semantic_begin <= token <= config.semantic_end for token in tokens)
    assert all(frame[1] == frame[0] - config.semantic_begin for frame in first)


def test_the_engine_redraws_repeats_of_a_replys_recent_tokens(runners: dict[int, DualARRunner]) -> None:
    """A reply whose draws repeat its recent tokens speaks differently without repetition-aware sampling."""
    run = runners[0]

    def tokens() -> list[int]:
        sampling = DEFAULT_SAMPLING.model_copy(update={"seed": 12})
        seq = dual_ar_sequence("ras", prompt_of(0, "one_reference"), 8, sampling, ignore_eos=True)
        return [frame[0] for frame in frames_of(speak_alone(run, seq))]

    redrawn = tokens()
    ras, run.repetition_aware = run.repetition_aware, None
    try:
        plain = tokens()
    finally:
        run.repetition_aware = ras
    assert redrawn != plain and redrawn[0] == plain[0]  # the first frame has no window yet


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.of(params, "cpu")


def test_repetition_aware_sampling_redraws_exactly_a_semantic_repeat_of_the_window() -> None:
    ras = RepetitionAwareSampling(first=10, last=19, window=3)
    recent = torch.tensor([[12, 0, 0], [0, 0, 0], [4, 14, 15], [0, 15, 0]])
    drawn = torch.tensor([12, 12, 4, 15])  # a semantic repeat, semantic new, a repeat outside the range, a repeat
    logits = torch.zeros(4, 32)
    seen: dict[str, Any] = {}

    def second_draw(logits: torch.Tensor, params: SamplingBatch, noise: CounterNoise, *rest: Any) -> torch.Tensor:
        seen.update(temperature=params.temperature.tolist(), top_p=params.top_p.tolist(), offset=noise.offset)
        return torch.full((logits.shape[0],), 30)

    params = _batch([DEFAULT_SAMPLING, DEFAULT_SAMPLING, DEFAULT_SAMPLING, SamplingParams(temperature=0.0)])
    noise = CounterNoise(torch.zeros(4, 2, dtype=torch.long))
    out = ras.redraw(drawn, logits, params, noise, recent, second_draw)
    assert out.tolist() == [30, 12, 4, 30]
    assert seen == {"temperature": [1.0, 1.0, 1.0, 0.0], "top_p": pytest.approx([0.9] * 4), "offset": 32}
    RepetitionAwareSampling.remember(recent, torch.tensor([0, 2]), torch.tensor([16, 17]), torch.tensor([True, False]))
    assert recent.tolist() == [[0, 0, 16], [0, 0, 0], [4, 14, 15], [0, 15, 0]]


def test_the_raw_logits_order_filters_before_the_temperature_and_a_cap_draws_the_same() -> None:
    """top_p on the softmax of the raw logits: a token past the nucleus is never drawn, however hot the draw; the
    transformers order at that temperature draws it."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5] + [-1.0] * 12]).repeat(64, 1)
    hot = [SamplingParams(temperature=5.0, top_k=8, top_p=0.8, seed=seed) for seed in range(64)]
    keys = draw_keys([NoiseSource(p) for p in hot])
    raw = sample(logits, _batch(hot), CounterNoise(keys), order=FilterOrder.RAW_LOGITS)
    capped = sample(logits, _batch(hot), CounterNoise(keys), top_k_cap=8, order=FilterOrder.RAW_LOGITS)
    warped = sample(logits, _batch(hot), CounterNoise(keys))
    assert set(raw.tolist()) == {0, 1} and torch.equal(raw, capped)  # raw mass 0.55, then 0.76, then 0.83 > 0.8
    assert set(warped.tolist()) - {0, 1}


DRAWS = 4000  # seeded draws per distribution: a few seconds on the CPU


def _official(seed: int, name: str) -> tuple[torch.Tensor, SamplingParams, torch.Tensor | None, dict[int, float]]:
    """One of the goldens' official sampling distributions: its logits [V], sampling, banned ids ([V] bool: those the
    official bias sets to -inf, for the token) and the official probabilities of the ids it keeps."""
    record = golden(seed)["sampling_distribution"]
    entry = record["distributions"][name]
    banned = None
    if entry["logits"] == "token":
        logits = torch.tensor(golden(seed)["cases"][record["case"]]["prefill_logits"])
        first, last = golden(seed)["semantic_ids"]
        banned = torch.ones(logits.shape[0], dtype=torch.bool)
        banned[first: last + 1] = False
        banned[golden(seed)["eos_id"]] = False
    else:
        logits = torch.tensor(record["codebook1_logits"])
    return logits, SamplingParams(**entry["sampling"]), banned, dict(zip(entry["ids"], entry["probs"]))


def _seeded_draws(logits: torch.Tensor, params: SamplingParams, banned: torch.Tensor | None, n: int = DRAWS,
                  order: FilterOrder = FilterOrder.RAW_LOGITS) -> torch.Tensor:
    """n draws from one row of logits, each a request of its own seed (0..n-1), as the engine draws a frame."""
    rows = [params.model_copy(update={"seed": seed}) for seed in range(n)]
    noise = CounterNoise(draw_keys([NoiseSource(p) for p in rows]))
    return sample(logits.expand(n, -1), _batch(rows), noise, banned=banned, top_k_cap=top_k_cap(rows), order=order)


def _chi_square(draws: torch.Tensor, probs: dict[int, float]) -> float:
    """Pearson's statistic of the draws against the official probabilities, over the official support (a draw
    outside it is infinitely unlikely)."""
    counts = torch.bincount(draws, minlength=max(probs) + 1).double()
    if counts.sum() > sum(counts[i] for i in probs):
        return float("inf")
    return sum(float((counts[i] - len(draws) * p) ** 2 / (len(draws) * p)) for i, p in probs.items())


def _chi_square_bound(probs: dict[int, float]) -> float:
    """The statistic a correct sampler exceeds with probability 1e-3 (len(probs) - 1 degrees of freedom); the draws
    are seeded, so the test's outcome is fixed."""
    return float(chi2.ppf(0.999, max(len(probs) - 1, 1)))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["token_default", "token_ras", "codebook1_default", "codebook1_ras",
                                  "codebook1_top_p_0.95"])
def test_seeded_draws_follow_the_official_samplers_distribution(seed: int, name: str) -> None:
    """The official sampler draws with torch's RNG, ours with counter-based noise, so no draw can be matched; over
    DRAWS seeded draws ours keeps exactly the ids the official `logits_to_probs` keeps (every one of them is expected
    at least 20 times) and their counts pass Pearson's chi-square test against its probabilities at level 1e-3."""
    logits, params, banned, probs = _official(seed, name)
    assert min(probs.values()) * DRAWS >= 20 or len(probs) == 1
    draws = _seeded_draws(logits, params, banned)
    assert set(draws.tolist()) == set(probs)
    assert _chi_square(draws, probs) < _chi_square_bound(probs)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_distribution_check_rejects_another_filter_order_and_temperature(seed: int) -> None:
    """The check has the power to tell: transformers' order (temperature before the filters) and the default draw
    taken for RAS's redraw both fail against the official codebook 1 distributions."""
    logits, params, banned, probs = _official(seed, "codebook1_default")
    warped = _seeded_draws(logits, params, banned, order=FilterOrder.TEMPERATURE_FIRST)
    assert set(warped.tolist()) != set(probs) or _chi_square(warped, probs) >= _chi_square_bound(probs)
    _, _, _, ras_probs = _official(seed, "codebook1_ras")
    default = _seeded_draws(logits, params, banned)
    assert _chi_square(default, ras_probs) >= _chi_square_bound(ras_probs)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_repetition_aware_redraw_follows_the_official_redraws_distribution(seed: int) -> None:
    """RAS's redraw has the official RAS_HIGH_TEMP and RAS_HIGH_TOP_P and the row's top_k; every draw that repeats the
    window is redrawn, and the redraws follow the official distribution at those parameters."""
    logits, params, banned, probs = _official(seed, "codebook1_ras")
    default = golden(seed)["sampling_distribution"]["distributions"]["codebook1_default"]["sampling"]
    ras = RepetitionAwareSampling(first=0, last=logits.shape[0] - 1)
    assert {"temperature": ras.temperature, "top_p": ras.top_p, "top_k": default["top_k"]} == params.model_dump(
        include={"temperature", "top_p", "top_k"})
    rows = [SamplingParams(**default, seed=seed) for seed in range(DRAWS)]
    noise = CounterNoise(draw_keys([NoiseSource(p) for p in rows]))
    x = logits.expand(DRAWS, -1)
    drawn = sample(x, _batch(rows), noise, top_k_cap=top_k_cap(rows), order=FilterOrder.RAW_LOGITS)
    recent = drawn[:, None].repeat(1, ras.window)  # every draw repeats its window
    redrawn = ras.redraw(drawn, x, _batch(rows), noise, recent,
                         functools.partial(sample, order=FilterOrder.RAW_LOGITS), top_k_cap=top_k_cap(rows))
    assert set(redrawn.tolist()) == set(probs)
    assert _chi_square(redrawn, probs) < _chi_square_bound(probs)
