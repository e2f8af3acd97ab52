"""The engine loop: one thread per stage replica running continuous batching over a model runner."""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Generic, Protocol, TypeVar

import torch

from omni_ray.engine.profiling import StepProfiler, StepTrace, cuda_allocator_stats, host_range

log = logging.getLogger(__name__)


class Sequence(Protocol):
    request_id: str
    finish_reason: str | None


S = TypeVar("S", bound=Sequence)
ABORT_MEMORY_S = 30.0  # an abort that arrives before its request is remembered this long
STEP_EWMA = 0.2  # the weight of the latest round in the engine's running mean of a step's seconds
# An engine thread shares its process's GIL with the replica's event loop. Each time it lets the GIL go (a CUDA graph
# replay, a wait for the device) and the event loop is busy, it waits up to Python's switch interval (5 ms by default)
# to get it back: on this project's CPU a call that lets the GIL go took 5.3 ms next to a busy thread at 5 ms, and
# 0.46 ms at 0.2 ms. The loop lowers its process's interval to this (by
# default: `EngineSettings.gil_switch_interval_ms`), as the vocoder stage does for its decode thread.
GIL_SWITCH_INTERVAL_S = 0.0002


def lower_gil_switch_interval(interval_s: float = GIL_SWITCH_INTERVAL_S) -> None:
    """This process's GIL switch interval down to `interval_s` (process-wide, so never raised: the shortest asked
    for wins)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), interval_s))


O = TypeVar("O")


@dataclass(frozen=True)
class AdmissionWindow:
    """When newly arrived requests are admitted: once none has arrived for `quiet_s`, or once the first of them has
    waited `max_wait_s`, whichever comes first; `quiet_s` 0: at once (each step admits whatever has arrived). A burst
    whose requests reach the engine a few ms apart then prefills in fewer batches, each of which reads the weights
    again, at the cost of up to `quiet_s` more for a request that arrives alone. Running sequences keep stepping
    meanwhile."""

    quiet_s: float = 0.0
    max_wait_s: float = 0.0


class Runner(Protocol[S, O]):  # type: ignore[misc]
    def admit(self, seq: S) -> None: ...
    def release(self, seq: S) -> None: ...
    def step(self, seqs: list[S]) -> list[O]: ...


class PipelinedRunner(Runner[S, O], Protocol[S, O]):  # type: ignore[misc]
    """A runner whose step is queued by `launch` and read back by `collect`. Whatever the next launch needs from a
    step must stay on the device; a sequence's end learnt in `collect` comes one step late, and `collect` drops the
    output of a row stepped after its end."""

    def launch(self, seqs: list[S]) -> Any: ...
    def collect(self, handle: Any) -> list[O]: ...


class EarlyCollectingRunner(PipelinedRunner[S, O], Protocol[S, O]):  # type: ignore[misc]
    """A pipelined runner whose step may finish part of its outputs on the device before the rest (a prefill's
    first tokens ahead of the decode queued behind it): `collect_early` waits for that part alone and returns its
    outputs, `collect` then the rest."""

    def collect_early(self, handle: Any) -> list[O]: ...


class EngineUnhealthy(RuntimeError):
    """An engine loop's device is stuck (a step waited past the stall timeout) or lost (a kernel faulted or trapped)."""


# a CUDA error after which the process's context is lost (every later call fails): a fault or a trap in a kernel
CONTEXT_LOST = ("unspecified launch failure", "illegal memory access", "illegal instruction", "misaligned address",
                "device-side assert", "launch timed out")


def loses_the_device(error: BaseException) -> bool:
    """Whether `error` is a CUDA error that leaves the process's context unusable."""
    text = str(error).lower()
    return "cuda" in text and any(marker in text for marker in CONTEXT_LOST)


class EngineLoop(Generic[S, O]):
    """Requests join and leave between steps. Each step runs every running sequence that is ready.

    A runner may split `step` into `launch` (queue the work, return a handle) and `collect` (wait for it, return the
    outputs): a `PipelinedRunner`. With `launch_ahead` the loop then launches step N+1 before collecting step N;
    otherwise it runs `step`.

    `on_outputs(outputs)` is called from the loop thread after each step; `on_failure(request_id, error)`
    when a request cannot be admitted or its step raised. Neither may block. With a `stream`, the loop thread queues
    all its GPU work there (one loop per stream: see `EngineLanes`).
    """

    def __init__(
        self,
        runner: Any,
        on_outputs: Callable[[list[O]], None],
        on_failure: Callable[[str, Exception], None],
        max_batch: int,
        name: str = "engine",
        stream: torch.cuda.Stream | None = None,
        launch_ahead: bool = False,
        gil_switch_interval_s: float = GIL_SWITCH_INTERVAL_S,
        admission: AdmissionWindow = AdmissionWindow(),
        stall_timeout_s: float = 0.0,
        work_of: Callable[[S], float] | None = None,
    ) -> None:
        self.runner = runner
        # a sequence's work in rows of steps (its token or frame budget): what `expected_wait_s` adds up; 1 each
        self.work_of: Callable[[S], float] = work_of or (lambda seq: 1.0)
        self.step_s = 0.0  # running mean (EWMA) of a round that stepped rows, in seconds; 0 until one has
        self.stall_timeout_s = stall_timeout_s  # `check_health`'s limit on one round of device work (0: none)
        self._round_started: float | None = None  # perf_counter s the round under way began (None: between rounds)
        self.device_lost: str | None = None  # the CUDA error that lost this process's context, once one has
        self.admission = admission
        self._last_arrival = 0.0  # monotonic s of the latest add()
        self._first_waiting = 0.0  # of the oldest sequence still waiting for admission
        self.gil_switch_interval_s = gil_switch_interval_s
        self.on_outputs = on_outputs
        self.on_failure = on_failure
        self.max_batch = max_batch
        self.name = name
        self._cond = threading.Condition()
        self._waiting: list[S] = []
        self._running: list[S] = []
        self._aborts: dict[str, float] = {}  # request id -> when asked; kept a while in case add() comes later
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self.steps = 0
        self.steps_launched_ahead = 0  # steps queued while the previous one was still to be collected
        self.max_batch_seen = 0
        # (step ms, batch size, host ms in launch, host ms in on_outputs, this thread's CPU ms in launch and in
        # on_outputs, ms waiting in the runner's collect) of the latest steps
        self._recent: deque[tuple[float, int, float, float, float, float, float]] = deque(maxlen=256)
        self._launch_ms = 0.0  # of the step being run
        self._launch_cpu_ms = 0.0
        self._outputs_ms = 0.0
        self._outputs_cpu_ms = 0.0
        self._collect_ms = 0.0
        self.profiler = StepProfiler(name)  # inert unless OMNI_RAY_PROFILE_DIR is set
        self.trace = StepTrace(name)  # inert unless OMNI_RAY_STEP_TRACE_DIR is set
        self.stream = stream
        # a runner with launch/collect lets the loop queue a step before reading the previous one back (and time the
        # host's part of a step, the launch, on its own)
        self.split = hasattr(runner, "launch") and hasattr(runner, "collect")
        self.pipelined = launch_ahead and self.split

    def start(self) -> None:
        lower_gil_switch_interval(self.gil_switch_interval_s)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def add(self, seq: S) -> None:
        with self._cond:
            self._last_arrival = time.monotonic()
            if not self._waiting:
                self._first_waiting = self._last_arrival
            self._waiting.append(seq)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts[request_id] = time.monotonic()
            self._cond.notify()

    def notify(self) -> None:
        """Wake the loop: new input arrived for a sequence that was waiting on it."""
        with self._cond:
            self._cond.notify()

    def load(self) -> int:
        """Sequences running or waiting here."""
        with self._cond:
            return len(self._running) + len(self._waiting)

    def queued_work(self) -> float:
        """The work (`work_of`) of the sequences waiting for admission."""
        with self._cond:
            return float(sum(self.work_of(seq) for seq in self._waiting))

    def rate(self) -> float:
        """Rows this loop steps per second with a full batch: `max_batch` / the running mean of a step's seconds
        (0 before any step). A waiting queue exists only while the batch is full, so this is the rate it drains at."""
        return self.max_batch / self.step_s if self.step_s > 0 else 0.0

    def expected_wait_s(self) -> float:
        """How long a request added now would wait for admission: the waiting sequences' work (their token or frame
        budgets) over `rate()`. In steady state a slot frees each time a running sequence's budget's worth of rows
        has been stepped, so the queue drains at that rate. Budgets are upper bounds (a reply may stop early), so
        this errs long. 0 before the first step has been timed (nothing to go by: admit)."""
        rate = self.rate()
        return self.queued_work() / rate if rate > 0 else 0.0

    def stats(self) -> dict[str, float]:
        with self._cond:
            recent = list(self._recent)
            counts = {"running": len(self._running), "waiting": len(self._waiting), "steps": self.steps,
                      "steps_launched_ahead": self.steps_launched_ahead, "max_batch_seen": self.max_batch_seen}
        counts["expected_wait_s"] = self.expected_wait_s()
        # per step: the whole round (`step_ms`), the host queueing its device work (`launch`), the runner's collect
        # (`collect`: the wait for the device, then reading the step's results back; in a loop that does not launch
        # ahead, inside `launch`), handing its outputs on (`outputs`); the engine thread's own CPU time in the launch
        # and the hand-on (the rest of those it waited: for the GIL, when another thread of the process ran Python,
        # or inside CUDA calls)
        columns = {"step_ms": 0, "launch_ms": 2, "outputs_ms": 3, "launch_cpu_ms": 4, "outputs_cpu_ms": 5,
                   "collect_ms": 6}
        out: dict[str, float] = {**counts, "batch_mean": statistics.fmean(r[1] for r in recent) if recent else 0.0}
        for name, column in columns.items():
            values = sorted(r[column] for r in recent)
            out[f"{name}_p50"] = statistics.median(values) if values else 0.0
            if name in ("step_ms", "launch_ms", "outputs_ms", "collect_ms"):  # a mean above the median: a slow tail
                out[f"{name}_mean"] = statistics.fmean(values) if values else 0.0
            if name == "step_ms":
                out["step_ms_p90"] = values[int(0.9 * (len(values) - 1))] if values else 0.0
        return out

    def check_health(self) -> None:
        """Raise `EngineUnhealthy` once the device is lost (a step failed with a CUDA error that loses the context: a
        kernel that faulted or trapped) or stuck: one round (a step's launch and the previous step's read-back) has
        taken longer than `stall_timeout_s` (a step takes milliseconds, a shape's first capture seconds). The
        process's CUDA context cannot get either back. The stage's Serve health check calls this, so that Serve
        replaces the replica and its requests fail instead of hanging."""
        if self.device_lost is not None:
            raise EngineUnhealthy(f"engine loop {self.name!r} lost its device: {self.device_lost}")
        started = self._round_started
        if self.stall_timeout_s <= 0 or started is None:
            return
        waited = time.perf_counter() - started
        if waited > self.stall_timeout_s:
            with self._cond:
                running = len(self._running)
            message = (f"engine loop {self.name!r} has waited {waited:.0f} s on one step's device work "
                       f"(limit {self.stall_timeout_s:.0f} s, {running} requests running): the GPU is stuck")
            log.error(message)
            raise EngineUnhealthy(message)

    def _ready(self, seq: S) -> bool:
        ready = getattr(self.runner, "ready", None)
        return True if ready is None else bool(ready(seq))

    def _admission_held_s(self) -> float:
        """Under the lock: how much longer the waiting sequences stay unadmitted (`AdmissionWindow`); 0: admit now."""
        if not self._waiting or self.admission.quiet_s <= 0:
            return 0.0
        until = min(self._last_arrival + self.admission.quiet_s, self._first_waiting + self.admission.max_wait_s)
        return max(0.0, until - time.monotonic())

    def _schedule(self) -> list[S]:
        """Under the lock: apply aborts, admit waiting sequences (once the admission window lets them in), pick the
        ready ones."""
        if self._aborts:
            for seq in [s for s in self._running if s.request_id in self._aborts]:
                self._running.remove(seq)
                self.runner.release(seq)
                del self._aborts[seq.request_id]
            for seq in [s for s in self._waiting if s.request_id in self._aborts]:
                self._waiting.remove(seq)
                del self._aborts[seq.request_id]
            expired = time.monotonic() - ABORT_MEMORY_S
            self._aborts = {rid: t for rid, t in self._aborts.items() if t > expired}
        while self._waiting and len(self._running) < self.max_batch and not self._admission_held_s():
            seq = self._waiting.pop(0)
            try:
                self.runner.admit(seq)
            except Exception as exc:  # a request that cannot fit fails alone
                self.on_failure(seq.request_id, exc)
                continue
            self._running.append(seq)
        return [s for s in self._running if self._ready(s)]

    def _run(self) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():  # this thread's stream
            self._serve()

    def _serve(self) -> None:
        """Each round launches a step for the ready sequences, then collects the step launched the round before (or,
        for a runner without `launch`/`collect`, this round's own step), so the host prepares step N+1 while the
        device runs step N."""
        pending: tuple[list[S], Any] | None = None
        while True:
            with self._cond:
                if self._stopped:
                    return
                batch = self._schedule()
                if not batch and pending is None:
                    self._cond.wait(timeout=self._admission_held_s() or 0.1)
                    continue
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            started = self._round_started = time.perf_counter()
            wall, prefilled, retries = (time.time(), self._prefilled(), self._alloc_retries()) if self.trace.active \
                else (0.0, 0, 0)
            self._launch_ms = self._outputs_ms = self._launch_cpu_ms = self._outputs_cpu_ms = self._collect_ms = 0.0
            with self.profiler.step(len(batch)):
                launched = self._launch(batch) if batch else None
                if launched is not None:  # counted before its outputs go out (a failed step is not counted)
                    self.steps += 1
                if launched is not None and pending is not None:
                    self.steps_launched_ahead += 1
                if pending is not None:
                    self._collect(*pending)
                pending = launched
                if not self.pipelined and pending is not None:
                    self._collect(*pending)
                    pending = None
            self._round_started = None
            round_ms = (time.perf_counter() - started) * 1000
            if launched is not None:
                round_s = round_ms / 1000
                self.step_s = round_s if self.step_s <= 0 else self.step_s + STEP_EWMA * (round_s - self.step_s)
                with self._cond:
                    self._recent.append((round_ms, len(batch), self._launch_ms, self._outputs_ms, self._launch_cpu_ms,
                                         self._outputs_cpu_ms, self._collect_ms))
            if self.trace.active:  # the round: this step's launch, the previous one's collect and hand-on
                self.trace.record(wall, batch=len(batch), prefilled=self._prefilled() - prefilled,
                                  launch_ms=self._launch_ms, launch_cpu_ms=self._launch_cpu_ms,
                                  collect_ms=self._collect_ms, outputs_ms=self._outputs_ms, round_ms=round_ms,
                                  alloc_retries=self._alloc_retries() - retries)

    def _prefilled(self) -> int:
        """Sequences the runner has prefilled so far (0 for a runner that does not count them)."""
        tally = getattr(self.runner, "prefills", None)
        return int(tally.sequences) if tally is not None else 0

    @staticmethod
    def _alloc_retries() -> int:
        """This process's CUDA allocator retries so far (0 off CUDA): a retry syncs the device inside its round."""
        return cuda_allocator_stats().get("cuda_alloc_retries", 0)

    def _launch(self, batch: list[S]) -> tuple[list[S], Any] | None:
        """Queue a step (or run it whole: launch, then collect, as the runners' `step` does, with the launch timed);
        sequences it ended leave the batch (their last output is still due)."""
        try:
            if self.split:
                started, cpu_started = time.perf_counter(), time.thread_time()
                with host_range("launch"):
                    handle = self.runner.launch(batch)
                self._launch_ms = (time.perf_counter() - started) * 1000
                self._launch_cpu_ms = (time.thread_time() - cpu_started) * 1000
                if not self.pipelined:
                    handle = self._timed_collect(self.runner.collect, handle)
            else:
                handle = self.runner.step(batch)
        except Exception as exc:
            self._fail(batch, exc)
            return None
        self._retire(batch)
        return batch, handle

    def _collect(self, batch: list[S], handle: Any) -> None:
        """Read a launched step back and hand its outputs on: for an `EarlyCollectingRunner`, the part the device
        finishes first is handed on while the rest still runs."""
        try:
            if self.pipelined and hasattr(self.runner, "collect_early"):
                with host_range("collect early"):
                    early = self._timed_collect(self.runner.collect_early, handle)
                if early:
                    self._hand_on(early)
            with host_range("collect"):
                outputs = self._timed_collect(self.runner.collect, handle) if self.pipelined else handle
        except Exception as exc:
            self._fail(batch, exc)
            return
        self._retire(batch)
        self._hand_on(outputs)

    def _timed_collect(self, collect: Callable[[Any], Any], handle: Any) -> Any:
        started = time.perf_counter()
        try:
            return collect(handle)
        finally:
            self._collect_ms += (time.perf_counter() - started) * 1000

    def _hand_on(self, outputs: list[O]) -> None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        with host_range("hand outputs on"):
            self.on_outputs(outputs)
        self._outputs_ms += (time.perf_counter() - started) * 1000
        self._outputs_cpu_ms += (time.thread_time() - cpu_started) * 1000

    def _retire(self, batch: list[S]) -> None:
        with self._cond:
            for seq in batch:
                if seq.finish_reason is not None and seq in self._running:
                    self._running.remove(seq)
                    self.runner.release(seq)

    def _fail(self, batch: list[S], exc: Exception) -> None:
        log.exception("%s step failed", self.name)
        describe = getattr(self.runner, "describe_failure", None)  # what the runner's kernels reported, if anything
        detail = describe() if describe is not None else None
        if detail:
            log.error("%s step failed: %s", self.name, detail)
        if loses_the_device(exc) and self.device_lost is None:
            self.device_lost = f"{exc}" + (f" ({detail})" if detail else "")
        with self._cond:
            for seq in batch:
                if seq in self._running:
                    self._running.remove(seq)
                    self.runner.release(seq)
        for seq in batch:
            self.on_failure(seq.request_id, exc)


def run_to_end(runner: Runner[S, O], seqs: list[S]) -> dict[str, list[O]]:
    """The loop's stepping for one admitted batch, on the caller's thread (tests, benchmarks): step every unfinished
    sequence until all have ended, releasing each as it ends. Each request's outputs, in order."""
    outputs: dict[str, list[O]] = {seq.request_id: [] for seq in seqs}
    released: set[str] = set()
    while any(seq.finish_reason is None for seq in seqs):
        for out in runner.step([seq for seq in seqs if seq.finish_reason is None]):
            outputs[out.request_id].append(out)  # type: ignore[attr-defined]
        for seq in seqs:
            if seq.finish_reason is not None and seq.request_id not in released:
                released.add(seq.request_id)
                runner.release(seq)
    return outputs
