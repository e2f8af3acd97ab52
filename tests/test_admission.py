"""Admission by expected work: the engine loop's wait estimate (queued budgets over its measured rate) and a stage's
refusal when it is over `max_queue_wait_s`, with the engine's fakes."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from _engine_fakes import FakeRunner, FakeSeq
from omni_ray.engine.lanes import EngineLanes
from omni_ray.engine.loop import EngineLoop
from omni_ray.errors import CapacityError
from omni_ray.stages.admission import refuse_if_queue_too_long

STEP_S = 0.01


class Stage:
    def __init__(self, name: str) -> None:
        self.stage_name, self.refused = name, 0


class SlowRunner(FakeRunner):
    """A fake runner whose every step takes STEP_S."""

    def step(self, seqs: list[FakeSeq]) -> list[tuple[str, int]]:
        time.sleep(STEP_S)
        return super().step(seqs)


@pytest.fixture
def loop() -> Iterator[EngineLoop[FakeSeq, tuple[str, int]]]:
    """Two slots; a sequence's work is its step count."""
    engine: EngineLoop[FakeSeq, tuple[str, int]] = EngineLoop(
        SlowRunner(), lambda outputs: None, lambda rid, exc: None, max_batch=2, name="test",
        work_of=lambda seq: seq.steps_needed)
    yield engine
    if engine._thread.is_alive():
        engine.stop()


def test_nothing_is_refused_before_the_first_step_is_timed(loop: EngineLoop[FakeSeq, tuple[str, int]]) -> None:
    for i in range(10):  # not started: everything waits, nothing measured
        loop.add(FakeSeq(f"r{i}", steps_needed=1000))
    assert loop.queued_work() == 10_000 and loop.rate() == 0 and loop.expected_wait_s() == 0
    refuse_if_queue_too_long(Stage("thinker"), loop, max_queue_wait_s=0.001)


def test_expected_wait_is_the_queued_work_over_the_full_batch_rate(
    loop: EngineLoop[FakeSeq, tuple[str, int]],
) -> None:
    loop.start()
    for i in range(2):  # fill both slots for long
        loop.add(FakeSeq(f"running{i}", steps_needed=10_000))
    deadline = time.monotonic() + 5
    while loop.steps < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert loop.expected_wait_s() == 0  # nothing waits: a new request is admitted at the next step
    step_s = loop.step_s
    assert STEP_S <= step_s < 20 * STEP_S  # measured (a shared CPU can be slow)
    assert loop.rate() == pytest.approx(2 / step_s)
    loop.add(FakeSeq("waiting0", steps_needed=300))
    loop.add(FakeSeq("waiting1", steps_needed=100))
    assert loop.queued_work() == 400
    # 400 rows of queued budget, two rows a step: about 200 steps ahead of a request added now
    assert loop.expected_wait_s() == pytest.approx(400 / loop.rate(), rel=0.5)
    assert 200 * STEP_S * 0.9 <= loop.expected_wait_s() < 200 * 20 * STEP_S
    assert loop.stats()["expected_wait_s"] > 0


def test_a_stage_refuses_once_the_expected_wait_passes_its_bound(loop: EngineLoop[FakeSeq, tuple[str, int]]) -> None:
    loop.step_s = 0.01  # as measured: 2 slots, 200 rows a second
    loop.add(FakeSeq("waiting", steps_needed=400))  # 2 s of queued work (the loop is not started: it stays queued)
    talker = Stage("talker")
    refuse_if_queue_too_long(talker, loop, max_queue_wait_s=2.5)  # under the bound: admitted
    refuse_if_queue_too_long(talker, loop, max_queue_wait_s=0)  # 0: no bound
    assert talker.refused == 0
    with pytest.raises(CapacityError, match=r"talker is at capacity: .* about 2.0 s") as refused:
        refuse_if_queue_too_long(talker, loop, max_queue_wait_s=0.5)
    assert refused.value.retry_after_s == 2  # the excess (1.5 s), rounded up to whole seconds
    loop.add(FakeSeq("more", steps_needed=2000))  # 12 s in all
    with pytest.raises(CapacityError) as refused:
        refuse_if_queue_too_long(talker, loop, max_queue_wait_s=2)
    assert refused.value.retry_after_s == 10 and talker.refused == 2


def test_lanes_estimate_the_wait_of_the_lane_a_request_would_join() -> None:
    lanes = [EngineLoop(FakeRunner(), lambda o: None, lambda r, e: None, max_batch=1, name=f"lane{i}",
                        work_of=lambda seq: seq.steps_needed) for i in range(2)]
    for lane in lanes:
        lane.step_s = 0.1
    engine = EngineLanes(lanes)
    engine.add(FakeSeq("a", steps_needed=50))  # 5 s queued on one lane
    assert engine.expected_wait_s() == 0  # the other lane is empty: a request goes there
    engine.add(FakeSeq("b", steps_needed=20))  # 2 s on the other
    assert engine.expected_wait_s() == pytest.approx(5.0)  # equal loads: the first lane's, as `add` picks
