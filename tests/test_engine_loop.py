"""Unit tests of the engine loop's continuous batching, with a fake runner (sequences that finish after N steps)."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import pytest

from _engine_fakes import TIMEOUT, FakeRunner, FakeSeq, Harness
from omni_ray.engine.kv_cache import KVCacheFull
from omni_ray.engine.loop import GIL_SWITCH_INTERVAL_S, AdmissionWindow, EngineLoop, EngineUnhealthy, run_to_end


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def factory(max_batch: int = 8, admission: AdmissionWindow = AdmissionWindow(), stall_timeout_s: float = 0.0,
                **runner_kwargs: object) -> Harness:
        h = Harness(FakeRunner(**runner_kwargs), max_batch, admission, stall_timeout_s)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield factory
    for h in made:
        h.runner.allow(100)  # unblock a gated step so stop() returns quickly
        h.loop.stop()
        assert not h.loop._thread.is_alive()
        assert h.runner.errors == []


def test_later_request_joins_running_batch_and_leaves_when_done(make: Callable[..., Harness]) -> None:
    h = make(gated=True)
    h.loop.start()
    h.add(FakeSeq("A", steps_needed=6))
    h.runner.wait_batches(1)
    h.runner.allow(2)
    h.runner.wait_batches(3)  # step 3 is under way with its batch already chosen
    h.add(FakeSeq("B", steps_needed=2))
    h.runner.allow(10)
    h.wait_finished("A", "B")
    assert h.runner.batches == [["A"], ["A"], ["A"], ["A", "B"], ["A", "B"], ["A"]]
    assert [[rid for rid, _ in out] for out in h.outputs] == h.runner.batches
    assert h.outputs[4] == [("A", 5), ("B", 2)]
    assert Counter(h.runner.released) == Counter({"A": 1, "B": 1})
    assert h.runner.released == ["B", "A"]  # B left first, while A was still running
    assert h.failures == []
    assert h.loop.max_batch_seen == 2
    # a step's timing is recorded once its outputs are handed on, just after the test can see them
    h.wait(lambda: h.loop.stats()["running"] == 0 and len(h.loop._recent) == 6)
    stats = h.loop.stats()
    assert {k: stats[k] for k in ("running", "waiting", "steps", "max_batch_seen")} == {
        "running": 0, "waiting": 0, "steps": 6, "max_batch_seen": 2}
    assert stats["batch_mean"] == (1 + 1 + 1 + 2 + 2 + 1) / 6 and stats["step_ms_p50"] > 0


def test_requests_arriving_apart_are_admitted_one_by_one_by_default(make: Callable[..., Harness]) -> None:
    h = make()
    h.loop.start()
    h.add(FakeSeq("A", steps_needed=1))
    h.wait_finished("A")
    h.add(FakeSeq("B", steps_needed=1))
    h.wait_finished("B")
    assert h.runner.batches == [["A"], ["B"]]


def test_an_admission_window_takes_a_burst_in_at_once_after_its_last_arrival(make: Callable[..., Harness]) -> None:
    """Three requests 20 ms apart under a 500 ms quiet window: one first step for all three, not before 500 ms after
    the last arrival."""
    h = make(admission=AdmissionWindow(quiet_s=0.5, max_wait_s=5.0))
    h.loop.start()
    for name in "ABC":
        before_arrival = time.monotonic()  # no later than the loop's own stamp of this arrival, taken inside add()
        h.add(FakeSeq(name, steps_needed=1))
        time.sleep(0.02)
    h.runner.wait_batches(1)
    step_seen = time.monotonic()
    # ordering, on the loop's own clock: its arrival stamp follows ours, and the quiet window ran out before the step
    assert before_arrival <= h.loop._last_arrival
    assert h.loop._last_arrival + 0.5 <= step_seen
    h.wait_finished("A", "B", "C")
    assert h.runner.batches == [["A", "B", "C"]]


def test_an_admission_window_waits_no_longer_than_its_cap(make: Callable[..., Harness]) -> None:
    h = make(admission=AdmissionWindow(quiet_s=10.0, max_wait_s=0.2))
    h.loop.start()
    arrived = time.monotonic()
    h.add(FakeSeq("A", steps_needed=1))
    h.wait_finished("A")  # within the harness's 1.5 s, not the 10 s quiet window
    assert time.monotonic() - arrived >= 0.2


def test_running_sequences_keep_stepping_while_an_arrival_waits_for_admission(make: Callable[..., Harness]) -> None:
    h = make(gated=True, admission=AdmissionWindow(quiet_s=0.3, max_wait_s=5.0))
    h.loop.start()
    h.add(FakeSeq("A", steps_needed=10))
    h.runner.wait_batches(1)
    h.add(FakeSeq("B", steps_needed=1))
    h.runner.allow(1)
    h.runner.wait_batches(2)  # chosen at once: B is still inside its window
    time.sleep(0.4)
    h.runner.allow(1)
    h.runner.wait_batches(3)
    assert h.runner.batches == [["A"], ["A"], ["A", "B"]]
    assert h.loop.stats()["waiting"] == 0


def test_max_batch_is_respected_and_stats_report_waiting(make: Callable[..., Harness]) -> None:
    h = make(max_batch=2, gated=True)
    for i in range(5):
        h.add(FakeSeq(f"r{i}", steps_needed=2))
    assert h.loop.stats()["waiting"] == 5
    h.loop.start()
    h.runner.wait_batches(1)
    assert h.loop.stats() == {"running": 2, "waiting": 3, "steps": 0, "steps_launched_ahead": 0, "max_batch_seen": 2,
                              "batch_mean": 0.0, "step_ms_p50": 0.0, "step_ms_mean": 0.0, "step_ms_p90": 0.0,
                              "launch_ms_p50": 0.0, "launch_ms_mean": 0.0, "outputs_ms_p50": 0.0,
                              "outputs_ms_mean": 0.0, "launch_cpu_ms_p50": 0.0, "outputs_cpu_ms_p50": 0.0,
                              "collect_ms_p50": 0.0, "collect_ms_mean": 0.0, "expected_wait_s": 0.0}
    h.runner.allow(2)
    h.runner.wait_batches(3)
    assert h.loop.stats()["running"] == 2 and h.loop.stats()["waiting"] == 1
    assert h.loop.stats()["expected_wait_s"] > 0  # once a step has been timed: one request's work queued
    h.runner.allow(10)
    h.wait_finished(*(f"r{i}" for i in range(5)))
    assert h.runner.batches == [["r0", "r1"], ["r0", "r1"], ["r2", "r3"], ["r2", "r3"], ["r4"], ["r4"]]
    assert all(len(b) <= 2 for b in h.runner.batches)
    assert h.runner.admitted == [f"r{i}" for i in range(5)]
    assert sorted(h.runner.released) == [f"r{i}" for i in range(5)]
    assert h.loop.max_batch_seen == 2


def test_abort_removes_running_and_waiting_requests_releasing_once(make: Callable[..., Harness]) -> None:
    h = make(max_batch=2, gated=True)
    h.add(FakeSeq("A", steps_needed=100))
    h.add(FakeSeq("B", steps_needed=3))
    h.add(FakeSeq("C", steps_needed=2))  # waits: max_batch 2
    h.loop.start()
    h.runner.wait_batches(1)
    h.loop.abort("A")  # while A is inside a step
    h.loop.abort("C")  # still waiting
    h.runner.allow(10)
    h.wait_finished("B")
    h.wait(lambda: h.loop.stats()["running"] == 0)
    h.loop.abort("B")  # already finished and released: no second release
    h.loop.abort("nobody")
    h.add(FakeSeq("D", steps_needed=1))  # the loop still serves after the aborts
    h.wait_finished("D")
    assert h.runner.batches == [["A", "B"], ["B"], ["B"], ["D"]]
    assert h.runner.admitted == ["A", "B", "D"]  # C never admitted
    assert Counter(h.runner.released) == Counter({"A": 1, "B": 1, "D": 1})
    assert h.failures == []
    assert h.loop.stats()["waiting"] == 0


def test_abort_of_request_between_steps(make: Callable[..., Harness]) -> None:
    h = make(gated=True)
    h.add(FakeSeq("A", steps_needed=100))
    h.add(FakeSeq("B", steps_needed=100))
    h.loop.start()
    h.runner.wait_batches(1)
    h.runner.allow(1)
    h.runner.wait_batches(2)
    h.loop.abort("B")
    h.runner.allow(1)
    h.runner.wait_batches(3)
    assert h.runner.batches[2] == ["A"]
    assert h.runner.released == ["B"]
    h.loop.abort("A")
    h.runner.allow(1)
    h.wait(lambda: h.loop.stats()["running"] == 0)
    assert Counter(h.runner.released) == Counter({"A": 1, "B": 1})


def test_admit_failure_fails_only_that_request(make: Callable[..., Harness]) -> None:
    h = make(fail_admit={"bad"})
    h.add(FakeSeq("good1", steps_needed=3))
    h.add(FakeSeq("bad", steps_needed=3))
    h.add(FakeSeq("good2", steps_needed=2))
    h.loop.start()
    h.wait_finished("good1", "good2")
    assert [rid for rid, _ in h.failures] == ["bad"]
    assert isinstance(h.failures[0][1], KVCacheFull)
    assert all("bad" not in b for b in h.runner.batches)
    assert h.runner.batches[0] == ["good1", "good2"]
    assert "bad" not in h.runner.released and "bad" not in h.runner.admitted
    assert Counter(h.runner.released) == Counter({"good1": 1, "good2": 1})


def test_step_exception_fails_that_step_and_loop_keeps_serving(make: Callable[..., Harness]) -> None:
    h = make(max_batch=2)
    h.add(FakeSeq("A", steps_needed=5))
    h.add(FakeSeq("P", steps_needed=5, poison=True))
    h.add(FakeSeq("W", steps_needed=1))  # waiting during the failing step: unaffected
    h.loop.start()
    h.wait(lambda: len(h.failures) == 2)
    assert sorted(rid for rid, _ in h.failures) == ["A", "P"]
    assert all(isinstance(exc, RuntimeError) and str(exc) == "boom" for _, exc in h.failures)
    h.wait_finished("W")
    h.add(FakeSeq("N", steps_needed=2))
    h.wait_finished("N")
    assert h.runner.batches[0] == ["A", "P"]
    assert all("A" not in b and "P" not in b for b in h.runner.batches[1:])
    assert Counter(h.runner.released) == Counter({"A": 1, "P": 1, "W": 1, "N": 1})
    assert len(h.failures) == 2
    assert h.loop._thread.is_alive()
    assert h.loop.stats()["steps"] == len(h.runner.batches) - 1  # the failed step is not counted


def test_a_step_stuck_past_the_stall_timeout_fails_the_health_check_until_it_ends(
    make: Callable[..., Harness],
) -> None:
    """A step that waits on the device (here: on a permit) longer than the stall timeout makes `check_health` raise,
    and so the stage's Serve health check (which Serve answers by replacing the replica); once the step ends, the
    loop is healthy again. Between steps and with no timeout, it never raises."""
    from types import SimpleNamespace

    from omni_ray.engine.lanes import EngineLanes
    from omni_ray.stages.base import StageBase

    h = make(stall_timeout_s=0.2, gated=True)
    h.loop.check_health()  # not started: between rounds
    h.add(FakeSeq("A", steps_needed=2))
    h.loop.start()
    h.runner.wait_batches(1)
    h.loop.check_health()  # within the limit
    time.sleep(0.3)
    with pytest.raises(EngineUnhealthy, match=r"engine loop 'test' has waited \d+ s .*1 requests running.*stuck"):
        h.loop.check_health()
    with pytest.raises(EngineUnhealthy):
        EngineLanes([h.loop]).check_health()
    with pytest.raises(EngineUnhealthy):
        StageBase.check_health(SimpleNamespace(engine=h.loop))  # type: ignore[arg-type]
    h.runner.allow(2)
    h.wait_finished("A")
    h.loop.check_health()
    StageBase.check_health(SimpleNamespace(engine=h.loop))  # type: ignore[arg-type]

    untimed = make(gated=True)  # stall_timeout_s 0: no limit
    untimed.add(FakeSeq("B", steps_needed=1))
    untimed.loop.start()
    untimed.runner.wait_batches(1)
    time.sleep(0.3)
    untimed.loop.check_health()
    untimed.runner.allow(1)
    untimed.wait_finished("B")


def test_a_step_that_loses_the_cuda_context_fails_the_health_check_for_good(make: Callable[..., Harness]) -> None:
    """A step that fails with a CUDA error that loses the process's context (a kernel's fault or trap) fails its
    requests, and from then on the health check, with what the runner's kernels reported (`describe_failure`); a
    step's other errors fail only that step."""
    h = make(max_batch=1)
    h.runner.describe_failure = lambda: "the persistent pass stalled at a grid barrier"  # type: ignore[attr-defined]
    h.add(FakeSeq("P", steps_needed=2, poison=True))  # RuntimeError("boom"): the device is fine
    h.loop.start()
    h.wait(lambda: len(h.failures) == 1)
    h.loop.check_health()
    lost = RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be asynchronously reported")
    original_step = h.runner.step

    def losing_step(seqs: list[FakeSeq]) -> list[tuple[str, int]]:
        raise lost

    h.runner.step = losing_step  # type: ignore[method-assign]
    h.add(FakeSeq("L", steps_needed=2))
    h.wait(lambda: len(h.failures) == 2)
    assert h.failures[1] == ("L", lost)
    with pytest.raises(EngineUnhealthy, match="(?s)lost its device: CUDA error: unspecified launch failure.*"
                                              "the persistent pass stalled at a grid barrier"):
        h.loop.check_health()
    h.runner.step = original_step  # type: ignore[method-assign]
    h.add(FakeSeq("A", steps_needed=1))
    h.wait_finished("A")
    with pytest.raises(EngineUnhealthy):  # a lost context is never got back: Serve replaces the replica
        h.loop.check_health()


def test_not_ready_sequence_is_kept_out_of_steps_until_notified(make: Callable[..., Harness]) -> None:
    h = make()
    r = FakeSeq("R", steps_needed=2, is_ready=False)
    h.add(r)
    h.add(FakeSeq("A", steps_needed=3))
    h.loop.start()
    h.wait_finished("A")
    assert h.runner.batches == [["A"], ["A"], ["A"]]
    h.wait(lambda: h.loop.stats()["running"] == 1)
    assert h.loop.stats()["waiting"] == 0
    assert h.runner.admitted == ["R", "A"]  # admitted (holds its slot) but not stepped
    r.is_ready = True
    h.loop.notify()
    h.wait_finished("R")
    assert h.runner.batches[3:] == [["R"], ["R"]]
    assert h.runner.released == ["A", "R"]


def test_stop_ends_the_thread(make: Callable[..., Harness]) -> None:
    h = make()
    h.loop.start()
    h.add(FakeSeq("A", steps_needed=1))
    h.wait_finished("A")
    h.loop.stop()
    assert not h.loop._thread.is_alive()


def test_starting_a_loop_shortens_the_gil_switch_interval(make: Callable[..., Harness]) -> None:
    """The engine thread gets the GIL back from a busy event loop within the short interval, not Python's 5 ms; a
    shorter interval someone set already is kept."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        make().loop.start()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S, rel=0.05)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S / 2)
        make().loop.start()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S / 2, rel=0.05)  # kept in whole µs
        configured = make()
        configured.loop.gil_switch_interval_s = 0.00005  # as `engine.gil_switch_interval_ms: 0.05` passes it
        configured.loop.start()
        assert sys.getswitchinterval() == pytest.approx(0.00005, rel=0.05)
    finally:
        sys.setswitchinterval(before)


def test_the_gil_switch_interval_is_set_per_stage_within_bounds() -> None:
    """Engine and vocoder settings take it in ms, between a positive value and Python's default; the stages pass it
    to the process (`lower_gil_switch_interval`)."""
    from pydantic import ValidationError

    from omni_ray.config import EngineSettings, VocoderSettings

    assert EngineSettings().gil_switch_interval_ms == VocoderSettings().gil_switch_interval_ms == 0.2
    assert EngineSettings(gil_switch_interval_ms=0.05).gil_switch_interval_ms == 0.05
    for bad in (0, -1, 6):
        with pytest.raises(ValidationError):
            VocoderSettings(gil_switch_interval_ms=bad)


def test_abort_that_arrives_before_the_request_still_applies(make: Callable[..., Harness]) -> None:
    h = make(gated=True)
    h.loop.start()
    h.loop.abort("early")  # e.g. the client left while the request was still on its way to this stage
    h.add(FakeSeq("early", steps_needed=5))
    h.add(FakeSeq("other", steps_needed=1))
    h.runner.allow(10)
    h.wait_finished("other")
    assert "early" not in [rid for batch in h.runner.batches for rid in batch]



def test_lanes_spread_requests_and_hear_every_abort() -> None:
    """Engine lanes: each request goes to the lane with the fewest, steps only there, and finishes there; an abort
    reaches the lane that holds its request (and one that arrives first still applies); stats add up."""
    from omni_ray.engine.lanes import EngineLanes

    runners = [FakeRunner(gated=True), FakeRunner(gated=True)]
    outputs: list[tuple[str, int]] = []
    done = threading.Condition()

    def on_outputs(out: list[tuple[str, int]]) -> None:
        with done:
            outputs.extend(out)
            done.notify_all()

    lanes: EngineLanes[FakeSeq, tuple[str, int]] = EngineLanes(
        [EngineLoop(runner, on_outputs, lambda rid, exc: None, max_batch=4, name=f"lane{i}") for i, runner in enumerate(runners)]
    )
    lanes.start()
    try:
        lanes.abort("late")  # before its request exists
        for rid in ("a", "b", "c", "late"):
            lanes.add(FakeSeq(rid, steps_needed=3))
        for runner in runners:
            runner.wait_batches(1)
        assert sorted(runners[0].admitted + runners[1].admitted) == ["a", "b", "c"]  # "late" was aborted on arrival
        assert {len(runners[0].admitted), len(runners[1].admitted)} == {1, 2}  # spread, not stacked
        assert lanes.stats()["running"] == 3
        aborted = runners[0].admitted[0]
        lanes.abort(aborted)
        for runner in runners:
            runner.allow(10)
        rest = set(runners[0].admitted + runners[1].admitted) - {aborted}
        with done:  # lane 0 applies the abort before its second step, so its other request ends after that
            assert done.wait_for(lambda: {rid for rid, n in outputs if n == 3} >= rest, timeout=TIMEOUT)
        for runner in runners:  # a request only ever stepped in its own lane
            stepped = {rid for batch in runner.batches for rid in batch}
            assert stepped <= set(runner.admitted)
        assert aborted in runners[0].released and aborted not in {rid for rid, n in outputs if n > 1}  # stepped once, before the abort
        stats = lanes.stats()
        assert stats["steps"] == sum(loop.steps for loop in lanes.loops) and stats["waiting"] == 0
    finally:
        for runner in runners:
            runner.allow(100)
        lanes.stop()


@dataclass
class Output:
    request_id: str
    step: int


class OutputRunner(FakeRunner):
    def step(self, seqs: list[FakeSeq]) -> list[Output]:  # type: ignore[override]
        return [Output(request_id, done) for request_id, done in super().step(seqs)]


def test_run_to_end_steps_until_every_sequence_ends_releasing_each_once() -> None:
    runner = OutputRunner()
    seqs = [FakeSeq("short", 1), FakeSeq("long", 3)]
    outputs = run_to_end(runner, seqs)
    assert {request: [out.step for out in outs] for request, outs in outputs.items()} == {"short": [1], "long": [1, 2, 3]}
    assert runner.batches == [["short", "long"], ["long"], ["long"]]  # an ended sequence leaves the batch
    assert runner.released == ["short", "long"]
