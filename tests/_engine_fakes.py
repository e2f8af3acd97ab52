"""The engine loop's unit-test fakes: sequences that finish after N steps, a runner that steps them, and a harness that
collects what the loop hands on."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from omni_ray.engine.kv_cache import KVCacheFull
from omni_ray.engine.loop import AdmissionWindow, EngineLoop

TIMEOUT = 1.5


@dataclass(eq=False)
class FakeSeq:
    request_id: str
    steps_needed: int
    finish_reason: str | None = None
    done: int = 0
    is_ready: bool = True
    poison: bool = False


@dataclass
class FakeRunner:
    """Finishes a sequence after `steps_needed` steps. In gated mode each step waits for a permit."""

    gated: bool = False
    fail_admit: set[str] = field(default_factory=set)
    batches: list[list[str]] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self.permits = threading.Semaphore(0)

    def admit(self, seq: FakeSeq) -> None:
        if seq.request_id in self.fail_admit:
            raise KVCacheFull(f"{seq.request_id} does not fit")
        self.admitted.append(seq.request_id)

    def release(self, seq: FakeSeq) -> None:
        self.released.append(seq.request_id)

    def ready(self, seq: FakeSeq) -> bool:
        return seq.is_ready

    def step(self, seqs: list[FakeSeq]) -> list[tuple[str, int]]:
        with self.cond:
            self.batches.append([s.request_id for s in seqs])
            self.cond.notify_all()
        if self.gated and not self.permits.acquire(timeout=TIMEOUT):
            self.errors.append("step never got a permit")
        if any(s.poison for s in seqs):
            raise RuntimeError("boom")
        out = []
        for s in seqs:
            s.done += 1
            if s.done >= s.steps_needed:
                s.finish_reason = "length"
            out.append((s.request_id, s.done))
        return out

    # test helpers
    def wait_batches(self, n: int) -> None:
        """Until step n has been entered (its batch chosen)."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.batches) >= n, timeout=TIMEOUT), self.batches

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()


class Harness:
    def __init__(self, runner: FakeRunner, max_batch: int, admission: AdmissionWindow = AdmissionWindow(),
                 stall_timeout_s: float = 0.0) -> None:
        self.runner = runner
        self.outputs: list[list[tuple[str, int]]] = []
        self.failures: list[tuple[str, Exception]] = []
        self.cond = threading.Condition()
        self.needed: dict[str, int] = {}
        self.loop = EngineLoop(runner, self._on_outputs, self._on_failure, max_batch=max_batch, name="test",
                               admission=admission, stall_timeout_s=stall_timeout_s)

    def _on_outputs(self, outputs: list[tuple[str, int]]) -> None:
        with self.cond:
            self.outputs.append(outputs)
            self.cond.notify_all()

    def _on_failure(self, request_id: str, error: Exception) -> None:
        with self.cond:
            self.failures.append((request_id, error))
            self.cond.notify_all()

    def wait(self, pred: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, timeout=TIMEOUT), (self.runner.batches, self.outputs, self.failures)

    def finished(self) -> set[str]:
        """Requests whose last step's output has been reported."""
        return {rid for out in self.outputs for rid, n in out if n >= self.needed[rid]}

    def add(self, seq: FakeSeq) -> FakeSeq:
        with self.cond:
            self.needed[seq.request_id] = seq.steps_needed
        self.loop.add(seq)
        return seq

    def wait_finished(self, *rids: str) -> None:
        self.wait(lambda: set(rids) <= self.finished())


