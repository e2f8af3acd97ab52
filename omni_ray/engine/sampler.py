"""Per-request sampling: greedy, temperature, top-k, top-p, repetition penalty, seeds, suppressed ids."""

from __future__ import annotations

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


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> None:
    """In place on one row: divide positive / multiply negative logits of tokens already seen."""
    if penalty == 1.0 or history.numel() == 0:
        return
    seen = torch.unique(history.to(logits.device))
    scores = logits[seen]
    logits[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row of logits."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[-1] = False
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


class RequestSampler:
    """Sampling state for one request: its params and its own random generator (seeded if asked).

    The generator lives on the device of the logits it first samples from."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self.params.seed is not None:
                self._generator.manual_seed(self.params.seed)
            else:
                self._generator.seed()
        return self._generator

    def pick(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        """logits: one row [V] (fp32 copy is made); history: ids that the repetition penalty applies to."""
        row = logits.to(torch.float32).clone()
        if history is not None:
            apply_repetition_penalty(row, history, self.params.repetition_penalty)
        if self.params.greedy:
            return int(torch.argmax(row))
        row = row / self.params.temperature
        row = filter_top_k_top_p(row, self.params.top_k, self.params.top_p)
        probs = torch.softmax(row, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator(probs.device)))


def sample_batch(
    logits: torch.Tensor,
    samplers: list[RequestSampler],
    histories: list[torch.Tensor | None],
    suppress: torch.Tensor | None = None,
) -> list[int]:
    """Pick one token per row of logits [B, V]; `suppress` ids (shared by all rows) are never picked."""
    if suppress is not None and suppress.numel() > 0:
        logits = logits.clone()
        logits[:, suppress] = float("-inf")
    return [s.pick(logits[i], histories[i]) for i, s in enumerate(samplers)]
