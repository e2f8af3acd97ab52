"""Unit tests of the engine loop with a runner split into launch and collect: steps launched ahead, a step's early
outputs, and what the loop's step statistics say about where a slow step waited."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from _engine_fakes import TIMEOUT, FakeRunner, FakeSeq, Harness
from omni_ray.engine.loop import EngineLoop


@dataclass
class FakePipelinedRunner(FakeRunner):
    """`launch` queues a step and `collect` reads it, as a GPU runner does; a sequence with `stops_at` learns its end
    (an EOS) only when that step is collected, so the step launched meanwhile steps it once more and drops its row."""

    calls: list[str] = field(default_factory=list)
    stops_at: dict[str, int] = field(default_factory=dict)

    def launch(self, seqs: list[FakeSeq]) -> list[tuple[FakeSeq, int]]:
        self.calls.append("launch " + ",".join(s.request_id for s in seqs))
        self.batches.append([s.request_id for s in seqs])
        rows = []
        for s in seqs:
            s.done += 1
            rows.append((s, s.done))
            if s.done >= s.steps_needed:
                s.finish_reason = "length"
        return rows

    def collect(self, rows: list[tuple[FakeSeq, int]]) -> list[tuple[str, int]]:
        self.calls.append("collect " + ",".join(s.request_id for s, _ in rows))
        out = []
        for s, n in rows:
            if s.finish_reason == "stop" and n > self.stops_at[s.request_id]:
                continue  # stepped after its end
            if self.stops_at.get(s.request_id) == n:
                s.finish_reason = "stop"
            out.append((s.request_id, n))
        return out


def test_pipelined_runner_launches_the_next_step_before_collecting_the_last() -> None:
    runner = FakePipelinedRunner(stops_at={"E": 2})
    h = Harness(runner, max_batch=4)
    h.loop = EngineLoop(runner, h._on_outputs, h._on_failure, max_batch=4, name="test", launch_ahead=True)
    h.needed.update({"A": 3, "E": 2})
    h.loop.add(FakeSeq("A", steps_needed=3))
    h.loop.add(FakeSeq("E", steps_needed=10))  # ends at its step 2, learnt when that step is collected
    try:
        h.loop.start()
        h.wait(lambda: len(runner.released) == 2)
        h.wait(lambda: runner.calls[-1].startswith("collect") and len(h.outputs) == len(runner.batches))
    finally:
        h.loop.stop()
    assert runner.calls == [
        "launch A,E",
        "launch A,E", "collect A,E",  # step 2 is queued before step 1 is read back
        "launch A,E", "collect A,E",  # step 3 steps E once more: its EOS (step 2) is not known yet
        "collect A,E",  # nothing left to launch: the last step is read back
    ]
    assert h.outputs == [[("A", 1), ("E", 1)], [("A", 2), ("E", 2)], [("A", 3)]]  # E's step-3 row is dropped
    assert Counter(runner.released) == Counter({"A": 1, "E": 1}) and h.failures == []
    assert h.loop.stats()["steps"] == 3 and h.loop.stats()["steps_launched_ahead"] == 2


@dataclass
class FakeEarlyRunner(FakePipelinedRunner):
    """A step's rows of sequences at their first step (a prefill) come back through `collect_early`, the others
    through `collect`, as the Thinker's runner reads a prefill's first tokens ahead of the decode behind it. Each
    launch waits for a permit."""

    def launch(self, seqs: list[FakeSeq]) -> list[tuple[FakeSeq, int]]:
        if not self.permits.acquire(timeout=TIMEOUT):
            self.errors.append("launch never got a permit")
        return super().launch(seqs)

    def collect_early(self, rows: list[tuple[FakeSeq, int]]) -> list[tuple[str, int]]:
        first = [row for row in rows if row[1] == 1]
        for row in first:
            rows.remove(row)
        self.calls.append("collect early " + ",".join(s.request_id for s, _ in first))
        return [(s.request_id, n) for s, n in first]


def test_a_steps_early_outputs_are_handed_on_before_the_rest_is_collected() -> None:
    """B joins while A decodes: the step that prefills B hands B's first output on by itself, then A's output of
    the same step."""
    runner = FakeEarlyRunner()
    h = Harness(runner, max_batch=4)
    h.loop = EngineLoop(runner, h._on_outputs, h._on_failure, max_batch=4, name="test", launch_ahead=True)
    h.needed.update({"A": 4, "B": 2})
    h.loop.add(FakeSeq("A", steps_needed=4))
    try:
        h.loop.start()
        runner.allow(2)
        h.wait(lambda: len(runner.batches) == 2)
        h.loop.add(FakeSeq("B", steps_needed=2))
        runner.allow(100)
        h.wait_finished("A", "B")
    finally:
        h.loop.stop()
    joined = next(i for i, batch in enumerate(runner.batches) if "B" in batch)  # A's step joined + 1
    assert runner.batches[joined] == ["A", "B"] and runner.errors == [] and h.failures == []
    assert runner.calls[runner.calls.index("collect early B") + 1] == "collect A"  # then the same step's rest
    handed_on = [out for out in h.outputs if out]
    at = handed_on.index([("B", 1)])  # alone
    assert handed_on[at - 1] == [("A", joined)] and handed_on[at + 1] == [("A", joined + 1)]
    assert sorted(o for out in handed_on for o in out) == [("A", 1), ("A", 2), ("A", 3), ("A", 4), ("B", 1), ("B", 2)]


@dataclass
class SlowCollectRunner(FakePipelinedRunner):
    """A pipelined runner whose collect waits `collect_s` (as for the device), every `slow_every`-th one `slow_s`."""

    collect_s: float = 0.004
    slow_every: int = 5
    slow_s: float = 0.03
    collected: int = 0

    def collect(self, rows: list[tuple[FakeSeq, int]]) -> list[tuple[str, int]]:
        self.collected += 1
        time.sleep(self.slow_s if self.collected % self.slow_every == 0 else self.collect_s)
        return super().collect(rows)


def test_step_stats_split_a_slow_tail_into_the_wait_for_the_device_and_the_host() -> None:
    runner = SlowCollectRunner()
    h = Harness(runner, max_batch=4)
    h.loop = EngineLoop(runner, h._on_outputs, h._on_failure, max_batch=4, name="test", launch_ahead=True)
    h.needed["A"] = 40
    h.loop.add(FakeSeq("A", steps_needed=40))
    try:
        h.loop.start()
        h.wait(lambda: len(h.loop._recent) >= 39)
    finally:
        h.loop.stop()
    stats = h.loop.stats()
    # one collect in five waits 30 ms, the rest 4: the median step is a short one, the mean and p90 carry the tail,
    # and the tail is in the collect (the wait for the device), not in the host's launch or hand-on
    assert 4 <= stats["collect_ms_p50"] < 15 and 4 <= stats["step_ms_p50"] < 15
    assert stats["collect_ms_mean"] >= stats["collect_ms_p50"] + 3 and stats["step_ms_p90"] >= 30
    assert stats["step_ms_mean"] >= stats["collect_ms_mean"] + stats["launch_ms_mean"] - 0.5
    assert stats["launch_ms_mean"] < 3 and stats["outputs_ms_mean"] < 3


def test_launch_ahead_off_runs_each_step_to_the_end() -> None:
    runner = FakePipelinedRunner()
    h = Harness(runner, max_batch=4)  # launch_ahead is off by default
    h.needed["A"] = 2
    h.loop.add(FakeSeq("A", steps_needed=2))
    try:
        h.loop.start()
        h.wait_finished("A")
    finally:
        h.loop.stop()
    # each step is read back before the next is queued (as the runners' `step` does, with the launch timed apart)
    assert runner.calls == ["launch A", "collect A", "launch A", "collect A"] and runner.batches == [["A"], ["A"]]
    stats = h.loop.stats()
    assert stats["steps_launched_ahead"] == 0
    assert 0 < stats["launch_ms_p50"] <= stats["step_ms_p50"] and 0 < stats["outputs_ms_p50"] <= stats["step_ms_p50"]
    assert 0 < stats["launch_cpu_ms_p50"] <= stats["launch_ms_p50"] + 0.05  # thread and wall clocks tick apart
    assert 0 < stats["outputs_cpu_ms_p50"] <= stats["outputs_ms_p50"] + 0.05
    assert 0 < stats["collect_ms_p50"] <= stats["launch_ms_p50"]  # read back inside the launch
    assert h.outputs == [[("A", 1)], [("A", 2)]]


