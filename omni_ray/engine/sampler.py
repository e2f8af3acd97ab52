"""Batched sampling on the device: per-row greedy/temperature/top-k/top-p/repetition penalty, noise-driven draws.

Every row of a batch has its own parameters (as tensors), so one call samples a whole step with no host sync and
the same code runs inside a CUDA graph. Randomness comes in as exponential noise drawn outside: a row's draw is
argmax(logits/T - log(noise)) (the Gumbel-max trick, an exact categorical sample), and each seeded request draws
its noise from its own generator, so its tokens do not depend on what it was batched with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field


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


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of a batch as device tensors."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float32
    penalty: torch.Tensor  # [B] float32

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str, rows: int | None = None) -> "SamplingBatch":
        """Rows past len(params) (batch padding) are greedy. One host→device copy."""
        rows = len(params) if rows is None else rows
        table = torch.tensor(
            [[p.temperature, p.top_k, p.top_p, p.repetition_penalty] for p in params]
            + [[0.0, 0.0, 1.0, 1.0]] * (rows - len(params)),
            dtype=torch.float64,
        ).reshape(rows, 4).to(device)
        return cls(table[:, 0].float(), table[:, 1].long(), table[:, 2].float(), table[:, 3].float())

    def as_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}{name}": getattr(self, name) for name in ("temperature", "top_k", "top_p", "penalty")}

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "SamplingBatch":
        return cls(*(tensors[f"{prefix}{name}"] for name in ("temperature", "top_k", "top_p", "penalty")))


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Transformers' repetition penalty on [B, V] rows: seen tokens' positive logits / p, negative ones * p."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)


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


def draw_from_top_k(x: torch.Tensor, params: SamplingBatch, noise: torch.Tensor, cap: int) -> torch.Tensor:
    """The draw of `sample` when every sampled row has 0 < top_k <= cap: top-k/top-p run over `cap` candidates
    instead of a sort of the whole vocabulary, with the same decisions (the top-p cumulative sum runs in the same
    ascending order, over the same nonzero probabilities) and the same noise per token."""
    values, index = torch.topk(x, cap, dim=-1)  # descending
    rank = torch.arange(cap, device=x.device)
    values = values.masked_fill(rank[None, :] >= params.top_k.clamp(1, cap)[:, None], float("-inf"))
    values = values.masked_fill(_outside_nucleus(values.flip(-1), params.top_p).flip(-1), float("-inf"))
    scores = values - noise.gather(-1, index).clamp_min(1e-30).log()
    return index.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]


def top_k_cap(params: Sequence[SamplingParams]) -> int | None:
    """A power-of-two bound on every sampled row's top_k when all of them use top-k (then `sample` filters that
    many candidates instead of sorting the vocabulary); None otherwise."""
    sampled = [p for p in params if not p.greedy]
    if not sampled or any(p.top_k == 0 for p in sampled):
        return None
    return 1 << (max(p.top_k for p in sampled) - 1).bit_length()


def sample(
    logits: torch.Tensor,
    params: SamplingBatch,
    noise: torch.Tensor,
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
    filtered: bool = True,
    top_k_cap: int | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V] → [B] long, on the device, with no host sync.

    noise [B, V]: Exp(1) draws (ignored by greedy rows); seen [B, V] bool: tokens the repetition penalty applies to;
    banned [B, V] or [V] bool: never picked. `filtered=False` skips top-k/top-p (when no row uses them);
    `top_k_cap` (see `top_k_cap()`) filters only that many candidates per row."""
    x = logits.to(torch.float32)
    if banned is not None:
        x = x.masked_fill(banned, float("-inf"))
    if seen is not None:
        x = penalize_repeats(x, seen, params.penalty)
    greedy = x.argmax(-1)
    x = x / params.temperature.clamp_min(1e-5)[:, None]
    if filtered and top_k_cap is not None and top_k_cap < x.shape[-1]:
        return torch.where(params.temperature > 0, draw_from_top_k(x, params, noise, top_k_cap), greedy)
    if filtered:
        x = filter_top_k_top_p(x, params.top_k, params.top_p)
    drawn = (x - noise.clamp_min(1e-30).log()).argmax(-1)
    return torch.where(params.temperature > 0, drawn, greedy)


class NoiseSource:
    """Where one request's random draws come from: its own seeded generator, or the device's default one."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.params.seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.params.seed)
        return self._generator


def draw_noise(
    sources: Sequence[NoiseSource], shape: tuple[int, ...], device: torch.device | str, rows: int | None = None
) -> torch.Tensor:
    """Exp(1) noise [rows, *shape]: unseeded rows in one draw, each seeded row from its own generator.
    Greedy rows and padding rows get ones (never read)."""
    rows = len(sources) if rows is None else rows
    device = torch.device(device)
    if all(s.params.greedy for s in sources):
        return torch.ones((rows, *shape), device=device)
    noise = torch.empty((rows, *shape), device=device).exponential_()
    for i, source in enumerate(sources):
        generator = source.generator(device)
        if generator is not None and not source.params.greedy:
            noise[i].exponential_(generator=generator)
    return noise


def needs_filter(params: Sequence[SamplingParams]) -> bool:
    return any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)


def sample_rows(
    logits: torch.Tensor,
    sources: Sequence[NoiseSource],
    seen: torch.Tensor | None = None,
    banned: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager convenience: sample [B, V] logits for B requests given their noise sources."""
    params = [s.params for s in sources]
    batch = SamplingBatch.of(params, logits.device)
    noise = draw_noise(sources, tuple(logits.shape[1:]), logits.device)
    if seen is not None and all(p.repetition_penalty == 1.0 for p in params):
        seen = None
    return sample(logits, batch, noise, seen, banned, needs_filter(params), top_k_cap(params))
