"""One decode thread per vocoder replica: concurrent streams' decode calls of the same shape run as one batched call."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Protocol, TypeVar

import torch

from omni_ray.engine.profiling import StepProfiler, StepTrace
from omni_ray.vocoder.reference_states import PrimedStates

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


class BatchDecoder(Protocol):
    """A causal codec that decodes a batch of equal-length windows: [B, Q, T] codes → [B, T*spf - trim] samples."""

    num_quantizers: int
    samples_per_frame: int
    sample_rate: int
    trim: int

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor: ...


class StatefulBatchDecoder(Protocol):
    """A causal codec that keeps each open stream's state in a slot: [B, Q, n] new frames of the streams in
    `slots` → [B, L] samples."""

    num_quantizers: int
    samples_per_frame: int
    sample_rate: int
    trim: int

    def open_stream(self) -> int: ...
    def close_stream(self, slot: int) -> None: ...
    def step_batch(self, codes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, first: bool) -> torch.Tensor: ...


@dataclass
class _Call(Generic[Item, Result]):
    item: Item
    future: Future[Result] = field(default_factory=Future)


class BatchWorker(Generic[Item, Result]):
    """`submit` may be called from many threads at once (one per stream) and blocks until its result is ready;
    `submit_nowait` returns a future (an event loop's streams submit without a thread each). A worker thread takes
    every waiting call, groups them by `key`, and runs each group (at most `max_batch` calls) as one `run_group`.
    Under load, calls gather while the previous group runs. `busy_s` and `frames` add up the work.

    With `gather_s`, the worker, once it has calls to take, keeps taking more while they come less than `gather_s`
    apart (for at most `gather_max_s`): the streams whose chunks one Talker step completes submit them one after
    another, and without the wait the first would run alone and the rest in a second call. With `urgent`, the groups
    of urgent calls run before the others taken with them."""

    def __init__(self, run_group: Callable[[list[Item]], list[Result]], key: Callable[[Item], Hashable],
                 frames: Callable[[Item], int], max_batch: int, gather_s: float = 0.0,
                 gather_max_s: float | None = None, urgent: Callable[[Item], bool] | None = None) -> None:
        self._run_group, self._key, self._frames = run_group, key, frames
        self._urgent = urgent  # groups of such calls run before the others taken with them
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.gather_max_s = 4 * gather_s if gather_max_s is None else gather_max_s
        self._pending: list[_Call[Item, Result]] = []
        self._cond = threading.Condition()
        self.batches = 0
        self.windows = 0
        self.frames = 0  # codec frames decoded (a window's left context included)
        self.busy_s = 0.0  # time spent in decode calls (with the GPU's results back on the host)
        self.profiler = StepProfiler("vocoder")  # inert unless OMNI_RAY_PROFILE_DIR is set
        self.trace = StepTrace("vocoder")  # inert unless OMNI_RAY_STEP_TRACE_DIR is set
        self._thread = threading.Thread(target=self._run, name="vocoder-batches", daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> Result:
        return self.submit_nowait(item).result()

    def submit_nowait(self, item: Item) -> Future[Result]:
        call: _Call[Item, Result] = _Call(item)
        with self._cond:
            self._pending.append(call)
            self._cond.notify()
        return call.future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                self._gather()
                taken, self._pending = self._pending, []
            groups: dict[Hashable, list[_Call[Item, Result]]] = {}
            for call in taken:
                groups.setdefault(self._key(call.item), []).append(call)
            ordered = list(groups.values())
            if self._urgent is not None:
                ordered.sort(key=lambda group: not self._urgent(group[0].item))  # type: ignore[misc]
            for group in ordered:
                for start in range(0, len(group), self.max_batch):
                    self._run_calls(group[start : start + self.max_batch])

    def _gather(self) -> None:
        """Under the lock, with calls pending: wait for more while they keep coming `gather_s` apart."""
        if self.gather_s <= 0:
            return
        deadline = time.monotonic() + self.gather_max_s
        seen = len(self._pending)
        while seen < self.max_batch:
            wait = min(self.gather_s, deadline - time.monotonic())
            if wait <= 0:
                return
            self._cond.wait(wait)
            if len(self._pending) == seen:  # quiet for a whole gap (or woken for nothing: close enough)
                return
            seen = len(self._pending)

    def _run_calls(self, group: list[_Call[Item, Result]]) -> None:
        started, wall = time.perf_counter(), time.time()
        results: list[Result] | None = None
        error: BaseException | None = None
        try:
            with self.profiler.step(len(group)):
                results = self._run_group([call.item for call in group])
        except BaseException as exc:  # every waiting stream gets the error; the worker keeps serving
            log.exception("vocoder batch of %d calls failed", len(group))
            error = exc
        busy_s = time.perf_counter() - started
        self.busy_s += busy_s
        self.batches += 1
        self.windows += len(group)
        frames = sum(self._frames(call.item) for call in group)
        self.frames += frames
        self.trace.record(wall, calls=len(group), frames=frames, round_ms=busy_s * 1000)
        for index, call in enumerate(group):
            if results is not None:
                call.future.set_result(results[index])
            else:
                assert error is not None
                call.future.set_exception(error)


def stacked(codes: list[torch.Tensor]) -> torch.Tensor:
    """The streams' codes as one batch, on the first one's device (streams fed by different relays may hold theirs
    on the GPU or on the host)."""
    device = codes[0].device
    return torch.stack([c.to(device) for c in codes])


class _CodecInfo:
    """The codec geometry a streaming decoder reads."""

    def __init__(self, decoder: BatchDecoder | StatefulBatchDecoder, max_batch: int) -> None:
        self.num_quantizers = decoder.num_quantizers
        self.samples_per_frame = decoder.samples_per_frame
        self.sample_rate = decoder.sample_rate
        self.trim = decoder.trim
        self.max_batch = max_batch


class BatchingCodec(_CodecInfo):
    """The window `Codec` protocol over a `BatchDecoder`: windows of equal length from different streams decode in
    one call."""

    def __init__(self, decoder: BatchDecoder, max_batch: int = 64, gather_s: float = 0.0) -> None:
        super().__init__(decoder, max_batch)
        self.worker: BatchWorker[torch.Tensor, torch.Tensor] = BatchWorker(
            lambda windows: list(decoder.decode_batch(stacked(windows))), key=lambda codes: int(codes.shape[1]),
            frames=lambda codes: int(codes.shape[1]), max_batch=max_batch, gather_s=gather_s,
        )

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.worker.submit(codes)


StepCall = tuple[torch.Tensor, int, int, bool]  # ([Q, n] codes, frames decoded before, state slot, first call)


class BatchingStatefulCodec(_CodecInfo):
    """The `StatefulCodec` protocol over a `StatefulBatchDecoder`: steps with the same number of new frames (and
    all first calls, or all later ones) from different streams run as one call; first calls (a stream's first chunk,
    or its reference's first call: its listener's first audio waits for them) before the later calls taken with them.
    With `primed_bytes` (and a decoder that can copy a slot's state), it keeps cloned voices' primed states
    (`primed_states`): the state copies run on the decode thread, before its next decode call, so they are ordered
    with the steps that read and write the slots."""

    def __init__(self, decoder: StatefulBatchDecoder, max_batch: int = 64, gather_s: float = 0.0,
                 primed_bytes: int = 0) -> None:
        super().__init__(decoder, max_batch)
        self.decoder = decoder
        self.worker: BatchWorker[StepCall, torch.Tensor] = BatchWorker(
            self._run, key=lambda call: (int(call[0].shape[1]), call[3]), frames=lambda call: int(call[0].shape[1]),
            max_batch=max_batch, gather_s=gather_s, urgent=lambda call: call[3],
        )
        copies_state = hasattr(decoder, "copy_state_out") and hasattr(decoder, "copy_state_in")
        self.primed_states = PrimedStates(primed_bytes) if primed_bytes > 0 and copies_state else None
        self._slot_work: list[Callable[[], None]] = []
        self._slot_work_lock = threading.Lock()

    def open_stream(self) -> int:
        return self.decoder.open_stream()

    def close_stream(self, slot: int) -> None:
        self.decoder.close_stream(slot)

    def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor:
        return self.worker.submit((codes, position, slot, first))

    def load_state(self, slot: int, state: torch.Tensor) -> None:
        """Write `state` into `slot` before the decode thread's next call (the stream's next step comes after)."""
        self._before_next_call(lambda: self.decoder.copy_state_in(slot, state))  # type: ignore[attr-defined]

    def save_state(self, slot: int, keep: Callable[[torch.Tensor], None]) -> None:
        """Hand `keep` a copy of `slot`'s state as it is before the decode thread's next call."""
        self._before_next_call(lambda: keep(self.decoder.copy_state_out(slot)))  # type: ignore[attr-defined]

    def _before_next_call(self, work: Callable[[], None]) -> None:
        with self._slot_work_lock:
            self._slot_work.append(work)

    def _run(self, calls: list[StepCall]) -> list[torch.Tensor]:
        with self._slot_work_lock:
            slot_work, self._slot_work = self._slot_work, []
        for work in slot_work:  # in the order asked: a slot saved and then reused is saved first
            work()
        codes = stacked([call[0] for call in calls])
        positions = torch.tensor([call[1] for call in calls], dtype=torch.long)
        slots = torch.tensor([call[2] for call in calls], dtype=torch.long)
        return list(self.decoder.step_batch(codes, positions, slots, calls[0][3]))
