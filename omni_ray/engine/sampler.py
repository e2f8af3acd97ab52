"""Batched sampling on the device: per-row greedy/temperature/top-k/top-p/repetition penalty, noise-driven draws.

Every row of a batch has its own parameters (as tensors), so one call samples a whole step with no host sync and
the same code runs inside a CUDA graph. A row's draw is argmax(logits/T - log(noise)) with Exp(1) noise (the
Gumbel-max trick, an exact categorical sample). The noise is counter-based (`CounterNoise`): a hash of the row's key,
which comes from its request's seed and draw count, and of the token id. So it is computed on the device where it is
read (inside the graph, and only at the candidates a top-k draw looks at), and a request's tokens depend on its seed
alone, never on what it was batched with. Requests without a seed get a random one.

A model family picks where top-k/top-p sit relative to the temperature (`FilterOrder`), and may redraw repeats
(`RepetitionAwareSampling`).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from omni_ray.engine.host_inputs import upload

log = logging.getLogger(__name__)


class SamplingParams(BaseModel):
    """How one request picks its next token. temperature == 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)


class FilterOrder(str, Enum):
    """Where a draw's top-k/top-p filtering sits relative to its temperature: a model family's convention."""

    # transformers' warpers: divide by the temperature, keep the top k, then the smallest top-p nucleus of what is left
    # (the token that crosses top_p stays)
    TEMPERATURE_FIRST = "temperature_first"
    # fish-speech's: over the raw logits sorted descending, drop ranks past top_k and every token at which the mass
    # cumulated from the largest probability (softmax of all the raw logits) exceeds top_p (the largest stays); then
    # divide by the temperature
    RAW_LOGITS = "raw_logits"


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of a batch as device tensors."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float32
    penalty: torch.Tensor  # [B] float32

    @staticmethod
    def table(params: Sequence[SamplingParams], rows: int | None = None) -> torch.Tensor:
        """[rows, 4] float64 on the host: temperature, top_k, top_p, penalty per row; rows past len(params) (batch
        padding) are greedy."""
        rows = len(params) if rows is None else rows
        return torch.tensor(
            [[p.temperature, p.top_k, p.top_p, p.repetition_penalty] for p in params]
            + [[0.0, 0.0, 1.0, 1.0]] * (rows - len(params)),
            dtype=torch.float64,
        ).reshape(rows, 4)

    @classmethod
    def from_table(cls, table: torch.Tensor) -> "SamplingBatch":
        return cls(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(), table[:, 3].float())

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str, rows: int | None = None) -> "SamplingBatch":
        """`table(params, rows)` on `device` (one host→device copy)."""
        return cls.from_table(cls.table(params, rows).to(device))


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Transformers' repetition penalty on [B, V] rows: seen tokens' positive logits / p, negative ones * p."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


def mark_seen(seen: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """seen[rows[i], tokens[i]] = True, all on the device. (Setting a Python True at tensor indices copies it from the
    host first: a wait for the device's queued work, and an error inside a CUDA graph's capture.)"""
    seen.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.bool))


def _outside_nucleus(ascending: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Over rows of logits sorted ascending (-inf = already removed): what lies outside each row's top-p nucleus.
    The largest logit always stays."""
    cumulative = ascending.softmax(-1).cumsum(-1)
    remove = (cumulative <= (1 - top_p[:, None])) | torch.isinf(ascending)
    remove[:, -1] = False
    return remove


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what lies outside each row's top-k, then outside the top-p nucleus of what is left
    (the order and tie rules of transformers' TopK/TopP warpers). logits [B, V]; top_k [B] (0 = off); top_p [B]."""
    vocab = logits.shape[-1]
    ascending, order = torch.sort(logits, dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth_largest = ascending.gather(-1, (vocab - k)[:, None])
    ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    remove_sorted = _outside_nucleus(ascending, top_p)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def draw_from_top_k(x: torch.Tensor, params: SamplingBatch, noise: torch.Tensor | CounterNoise, cap: int) -> torch.Tensor:
    """The draw of `sample` when every sampled row has 0 < top_k <= cap: top-k/top-p run over `cap` candidates
    instead of a sort of the whole vocabulary, with the same decisions (the top-p cumulative sum runs in the same
    ascending order, over the same nonzero probabilities) and the same noise per token."""
    values, index = torch.topk(x, cap, dim=-1)  # descending
    rank = torch.arange(cap, device=x.device)
    values = values.masked_fill(rank[None, :] >= params.top_k.clamp(1, cap)[:, None], float("-inf"))
    values = values.masked_fill(_outside_nucleus(values.flip(-1), params.top_p).flip(-1), float("-inf"))
    scores = values - _noise_at(noise, index).clamp_min(1e-30).log()
    return index.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]


def _noise_at(noise: torch.Tensor | CounterNoise, ids: torch.Tensor) -> torch.Tensor:
    return noise.at(ids) if isinstance(noise, CounterNoise) else noise.gather(-1, ids)


def top_k_cap(params: Sequence[SamplingParams]) -> int | None:
    """A power-of-two bound on every sampled row's top_k when all of them use top-k (then `sample` filters that
    many candidates instead of sorting the vocabulary); None otherwise."""
    sampled = [p for p in params if not p.greedy]
    if not sampled or any(p.top_k == 0 for p in sampled):
        return None
    return 1 << (max(p.top_k for p in sampled) - 1).bit_length()


def _outside_raw_nucleus(descending: torch.Tensor, log_total: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """Over rows' largest raw logits sorted descending (of a row whose logsumexp is `log_total` [B, 1]): what
    `FilterOrder.RAW_LOGITS` drops, the ranks past the row's top_k (0 = off) and where the probability cumulated from
    the largest up exceeds its top_p. The largest logit always stays."""
    cumulative = (descending - log_total).exp().cumsum(-1)
    rank = torch.arange(descending.shape[-1], device=descending.device)
    k = torch.where(params.top_k > 0, params.top_k, descending.shape[-1])
    remove = (cumulative > params.top_p[:, None]) | (rank[None, :] >= k[:, None])
    remove[:, 0] = False
    return remove


def draw_raw_logits_order(
    x: torch.Tensor, params: SamplingBatch, noise: torch.Tensor | CounterNoise, filtered: bool, cap: int | None,
) -> torch.Tensor:
    """The draw of `sample` in `FilterOrder.RAW_LOGITS`: top-p (on the softmax of the raw logits) and top-k over the
    raw logits x [B, V], then the temperature (floor 1e-5), then argmax(logit/T - log(noise)). With `cap` (every
    sampled row has 0 < top_k <= cap) only the `cap` largest are ranked: the same decisions, since the mass is
    cumulated over the same largest probabilities of the whole row."""
    temperature = params.temperature.clamp_min(1e-5)[:, None]
    if not filtered:
        dense = noise.dense(x.shape[-1]) if isinstance(noise, CounterNoise) else noise
        return (x / temperature - dense.clamp_min(1e-30).log()).argmax(-1)
    if cap is not None and cap < x.shape[-1]:
        values, index = torch.topk(x, cap, dim=-1)
    else:
        values, index = torch.sort(x, dim=-1, descending=True)
    values = values.masked_fill(_outside_raw_nucleus(values, torch.logsumexp(x, -1, keepdim=True), params),
                                float("-inf"))
    scores = values / temperature - _noise_at(noise, index).clamp_min(1e-30).log()
    return index.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]


def sample(
    logits: torch.Tensor,
    params: SamplingBatch,
    noise: torch.Tensor | CounterNoise | None,
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    filtered: bool = True,
    top_k_cap: int | None = None,
    order: FilterOrder = FilterOrder.TEMPERATURE_FIRST,
) -> torch.Tensor:
    """One token per row of logits [B, V] → [B] long, on the device, with no host sync.

    noise: Exp(1) draws [B, V] or their `CounterNoise` (ignored by greedy rows; None when every row is greedy);
    seen [B, V] bool: tokens the repetition penalty applies to; banned [B, V] or [V] bool: never picked.
    `filtered=False` skips top-k/top-p (when no row uses them); `top_k_cap` (see `top_k_cap()`) filters only that
    many candidates per row; `order`: where the filtering sits relative to the temperature."""
    x = logits.to(torch.float32)
    if banned is not None:
        x = x.masked_fill(banned, float("-inf"))
    if seen is not None:
        x = penalize_repeats(x, seen, params.penalty)
    greedy = x.argmax(-1)
    if noise is None:
        return greedy
    if order is FilterOrder.RAW_LOGITS:
        return torch.where(params.temperature > 0, draw_raw_logits_order(x, params, noise, filtered, top_k_cap), greedy)
    x = x / params.temperature.clamp_min(1e-5)[:, None]
    if filtered and top_k_cap is not None and top_k_cap < x.shape[-1]:
        return torch.where(params.temperature > 0, draw_from_top_k(x, params, noise, top_k_cap), greedy)
    if filtered:
        x = filter_top_k_top_p(x, params.top_k, params.top_p)
    dense = noise.dense(x.shape[-1]) if isinstance(noise, CounterNoise) else noise
    drawn = (x - dense.clamp_min(1e-30).log()).argmax(-1)
    return torch.where(params.temperature > 0, drawn, greedy)


MASK32 = 0xFFFFFFFF


IntOrTensor = TypeVar("IntOrTensor", int, torch.Tensor, np.ndarray)


def mix32(x: IntOrTensor) -> IntOrTensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of values in [0, 2^32): Python ints or int64 arrays on the
    host, int64 tensors on the device. The multipliers are below 2^31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """The first of a row's two 32-bit keys: the same for every draw under `seed` (any int; only its low 64 bits
    count)."""
    low, high = seed & MASK32, (seed >> 32) & MASK32
    return mix32(low ^ mix32(high ^ 0x9E3779B9))


def draw_key(first: IntOrTensor, draw: IntOrTensor) -> IntOrTensor:
    """The second key of the `draw`-th draw of rows whose first key is `first`."""
    return mix32(first ^ mix32((draw & MASK32) ^ 0x85EBCA6B))


def row_key(seed: int, draw: int) -> tuple[int, int]:
    """The two 32-bit keys of a row's `draw`-th draw under `seed`."""
    first = seed_key(seed)
    return first, draw_key(first, draw)


def exponential_from_hash(keys: torch.Tensor, ids: torch.Tensor, offset: int) -> torch.Tensor:
    """Exp(1) noise of token `ids` [B, K] for rows with `keys` [B, 2]: -log of a 24-bit uniform from the hash."""
    h = mix32(((ids + offset) & MASK32) ^ keys[:, :1])
    h = mix32((h + keys[:, 1:]) & MASK32)
    uniform = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


Fn = TypeVar("Fn", bound=Callable[..., torch.Tensor])


def compiled_or_eager(fn: Fn, what: str) -> Fn:
    """`fn` compiled by inductor on its first call (dynamic shapes, one graph per guard set, no graph breaks); if
    compiling fails, `fn` eagerly from then on."""
    compiled: Callable[..., torch.Tensor] | None = None  # made on first use: importing the compiler takes a while
    eager = False

    def run(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal compiled, eager
        if not eager:
            try:
                if compiled is None:
                    compiled = torch.compile(fn, dynamic=True, fullgraph=True)
                return compiled(*args, **kwargs)
            except Exception:  # no working compiler here: the same ops, eagerly
                log.warning("compiling %s failed; it runs eagerly", what, exc_info=True)
                eager = True
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


fused_noise = compiled_or_eager(exponential_from_hash, "the sampling noise")


@dataclass
class CounterNoise:
    """Exp(1) noise that is a pure function of a row's keys and a token id: `at(ids)` is the noise of those tokens,
    `dense(vocab)` of all of them. `offset` separates several draws that share one key (the MTP's groups)."""

    keys: torch.Tensor  # [B, 2] int64, each in [0, 2^32)
    offset: int = 0

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, K] long → [B, K] float32 noise, each strictly positive (24-bit uniforms, never 0 or 1).
        On CUDA one fused kernel (about 30 elementwise ops otherwise, and a frame draws 16 times); inside a compiled
        caller (`fused_sample`), part of the caller's kernels."""
        if ids.is_cuda and not torch.compiler.is_compiling():
            return fused_noise(self.keys, ids, self.offset)
        return exponential_from_hash(self.keys, ids, self.offset)

    def dense(self, vocab: int) -> torch.Tensor:
        return self.at(torch.arange(vocab, device=self.keys.device).expand(self.keys.shape[0], -1))


class NoiseSource:
    """Where one request's random draws come from: its seed (a random one when it gave none) and a draw count."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.first_key = seed_key(self.seed)
        self.draws = 0


def draw_keys(sources: Sequence[NoiseSource], rows: int | None = None) -> torch.Tensor:
    """[rows, 2] int64 on the host: each source's next draw's keys (its draw count advances); padding rows get
    zeros. The hashes run over the batch at once (NumPy), not row by row: a step makes one to three of these."""
    count = len(sources)
    keys = np.zeros((count if rows is None else rows, 2), dtype=np.int64)
    if count:
        first = np.fromiter((source.first_key for source in sources), dtype=np.int64, count=count)
        draws = np.fromiter((source.draws for source in sources), dtype=np.int64, count=count)
        keys[:count, 0], keys[:count, 1] = first, draw_key(first, draws)
        for source in sources:
            source.draws += 1
    return torch.from_numpy(keys)


def needs_filter(params: Sequence[SamplingParams]) -> bool:
    return any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)


# `sample` as a few inductor kernels (about 20 otherwise, for a top-k draw): the Talker's frame draws with it where
# the one-kernel draw (`top_k_draw.KernelDraw`) does not apply or is turned off.
fused_sample = compiled_or_eager(sample, "sampling")


@dataclass(frozen=True)
class RepetitionAwareSampling:
    """Repetition-aware sampling (RAS, fish-speech's): a row's draw that is a token in [first, last] and among the
    row's last `window` drawn tokens (a window that starts as zeros) is replaced by a second draw at `temperature`
    and `top_p` (the row's top_k, the same order and banned tokens; a greedy row stays greedy), from noise of its own."""

    first: int
    last: int
    window: int = 10
    temperature: float = 1.0
    top_p: float = 0.9

    def redraw(
        self, drawn: torch.Tensor, logits: torch.Tensor, params: SamplingBatch, noise: CounterNoise,
        recent: torch.Tensor, draw: Callable[..., torch.Tensor], seen: torch.Tensor | None = None,
        banned: torch.Tensor | None = None, top_k_cap: int | None = None,
    ) -> torch.Tensor:
        """`drawn` [B] from `logits` [B, V] with `params` and `noise`, its repeats of `recent` [B, window] redrawn by
        `draw` (`sample`'s signature). Graph-capturable."""
        repeats = (recent == drawn[:, None]).any(-1) & (drawn >= self.first) & (drawn <= self.last)
        hotter = SamplingBatch(
            torch.where(params.temperature > 0, torch.full_like(params.temperature, self.temperature), params.temperature),
            params.top_k, torch.full_like(params.top_p, self.top_p), params.penalty,
        )
        second = draw(logits, hotter, CounterNoise(noise.keys, noise.offset + logits.shape[-1]), seen, banned, True,
                      top_k_cap)
        return torch.where(repeats, second, drawn)

    def recent_tokens(self, rows: int, device: torch.device | str) -> torch.Tensor:
        """Each slot's window of drawn tokens [rows, window] long, zeros to start."""
        return torch.zeros(rows, self.window, dtype=torch.long, device=device)

    @staticmethod
    def remember(recent: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, records: torch.Tensor) -> None:
        """Slide `tokens` [B] into the windows of `recent` at `rows` [B] where `records` [B] bool, on the device."""
        window = recent[rows]
        recent[rows] = torch.where(records[:, None], torch.cat([window[:, 1:], tokens[:, None]], dim=1), window)


@dataclass(frozen=True)
class DrawMode:
    """What a batch's draw does that its parameter table cannot say, and so changes its code (one CUDA graph per
    mode): noise (some row samples), the repetition penalty (some row's is not 1), top-k/top-p filtering (some
    sampled row uses it) and the candidate cap of a top-k draw (`top_k_cap`)."""

    sampled: bool
    penalized: bool = False
    filtered: bool = False
    top_k_cap: int | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> "DrawMode":
        return cls(any(not p.greedy for p in params), any(p.repetition_penalty != 1.0 for p in params),
                   needs_filter(params), top_k_cap(params))


def sample_in_mode(
    logits: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, mode: DrawMode, seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sample` for rows whose parameters are `table` (`SamplingBatch.table`) and noise keys `keys` (`draw_keys`),
    both on the device, as `mode` says (`seen` is read only when it penalizes). Graph-capturable."""
    noise = CounterNoise(keys) if mode.sampled else None
    return sample(logits, SamplingBatch.from_table(table), noise, seen if mode.penalized else None, banned,
                  mode.filtered, mode.top_k_cap)


def sample_rows(
    logits: torch.Tensor,
    sources: Sequence[NoiseSource],
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager: sample [B, V] logits for B requests given their noise sources (their parameters and keys reach the
    device without waiting for it)."""
    params = [s.params for s in sources]
    inputs = upload({"table": SamplingBatch.table(params), "keys": draw_keys(sources)}, logits.device)
    return sample_in_mode(logits, inputs["table"], inputs["keys"], DrawMode.of(params), seen, banned)
