"""One decode thread per vocoder replica: concurrent streams' windows of equal length run as one batched call."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class BatchDecoder(Protocol):
    """A causal codec that decodes a batch of equal-length windows: [B, Q, T] codes → [B, T*spf - trim] samples."""

    num_quantizers: int
    samples_per_frame: int
    sample_rate: int
    trim: int

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor: ...


@dataclass
class _Window:
    codes: torch.Tensor  # [Q, T]
    done: threading.Event = field(default_factory=threading.Event)
    samples: torch.Tensor | None = None
    error: BaseException | None = None


class BatchingCodec:
    """The streaming `Codec` protocol over a `BatchDecoder`: `decode` may be called from many threads at once (one
    per stream); a worker thread takes every waiting window, groups them by length and decodes each group in one
    call of at most `max_batch` windows. Under load, windows gather while the previous batch runs."""

    def __init__(self, decoder: BatchDecoder, max_batch: int = 64) -> None:
        self.decoder = decoder
        self.num_quantizers = decoder.num_quantizers
        self.samples_per_frame = decoder.samples_per_frame
        self.sample_rate = decoder.sample_rate
        self.trim = decoder.trim
        self.max_batch = max_batch
        self._pending: list[_Window] = []
        self._cond = threading.Condition()
        self.batches = 0
        self.windows = 0
        self._thread = threading.Thread(target=self._run, name="vocoder-batches", daemon=True)
        self._thread.start()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        window = _Window(codes)
        with self._cond:
            self._pending.append(window)
            self._cond.notify()
        window.done.wait()
        if window.error is not None:
            raise window.error
        assert window.samples is not None
        return window.samples

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                taken, self._pending = self._pending, []
            by_length: dict[int, list[_Window]] = {}
            for window in taken:
                by_length.setdefault(int(window.codes.shape[1]), []).append(window)
            for group in by_length.values():
                for start in range(0, len(group), self.max_batch):
                    self._decode(group[start : start + self.max_batch])

    def _decode(self, group: list[_Window]) -> None:
        try:
            samples = self.decoder.decode_batch(torch.stack([w.codes for w in group]))
            for window, row in zip(group, samples):
                window.samples = row
        except BaseException as exc:  # every waiting stream gets the error; the worker keeps serving
            log.exception("vocoder batch of %d windows failed", len(group))
            for window in group:
                window.error = exc
        self.batches += 1
        self.windows += len(group)
        for window in group:
            window.done.set()
