"""The step trace: inert by default; with a directory every engine round and vocoder decode call is a JSON line on
the wall clock, and `benchmarks/step_timeline.py` lines the stages' rounds up per burst of requests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.step_timeline import burst_starts, load_rounds, timeline
from omni_ray.engine.fixed_shape import PrefillTally
from omni_ray.engine.loop import EngineLoop
from omni_ray.engine.profiling import STEP_TRACE_DIR_ENV, StepTrace
from omni_ray.vocoder.batching import BatchWorker
from tests._engine_fakes import FakeRunner, FakeSeq, Harness


class PrefillingRunner(FakeRunner):
    """The fake runner, counting a sequence's first step as its prefill (as the real runners' `prefills` do)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.prefills = PrefillTally()

    def step(self, seqs: list[FakeSeq]) -> list[tuple[str, int]]:
        new = [s for s in seqs if s.done == 0]
        if new:
            self.prefills.add(len(new))
        return super().step(seqs)


def _lines(directory: Path) -> dict[str, list[dict[str, float]]]:
    return {path.stem.rsplit("-", 1)[0]: [json.loads(line) for line in path.read_text().splitlines()]
            for path in directory.glob("*.jsonl")}


def test_inert_without_a_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(STEP_TRACE_DIR_ENV, raising=False)
    trace = StepTrace("thinker")
    trace.record(time.time(), batch=1)
    assert not trace.active and trace.path is None
    monkeypatch.setenv(STEP_TRACE_DIR_ENV, "")  # set but empty (gpu_suite.sh without STEP_TRACE): inert too
    assert not StepTrace("thinker").active


def test_each_engine_round_is_traced_with_its_batch_and_prefills(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    monkeypatch.setenv(STEP_TRACE_DIR_ENV, str(tmp_path))
    runner = PrefillingRunner()
    harness = Harness(runner, max_batch=4)
    assert isinstance(harness.loop, EngineLoop) and harness.loop.trace.active
    before = time.time()
    harness.loop.start()
    try:
        harness.add(FakeSeq("a", 3))
        harness.wait_finished("a")
        harness.add(FakeSeq("b", 2))
        harness.add(FakeSeq("c", 2))
        harness.wait_finished("b", "c")
    finally:
        harness.loop.stop()
    rounds = _lines(tmp_path)["test"]
    stepped = [r for r in rounds if r["batch"] > 0]
    assert len(stepped) == len(runner.batches)  # one line a step (this runner does not launch ahead)
    assert [r["batch"] for r in stepped] == [len(b) for b in runner.batches]
    assert sum(r["prefilled"] for r in rounds) == 3  # each sequence's first step, in the round that ran it
    assert stepped[0]["prefilled"] == 1 and stepped[1]["prefilled"] == 0
    assert all(before <= r["t"] <= time.time() for r in rounds)
    assert all(r["round_ms"] >= r["launch_ms"] >= 0 and r["launch_cpu_ms"] >= 0 for r in rounds)
    assert all(r["alloc_retries"] == 0 for r in rounds)  # no CUDA here: nothing to count


def test_each_vocoder_decode_call_is_traced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(STEP_TRACE_DIR_ENV, str(tmp_path))
    worker: BatchWorker[int, int] = BatchWorker(lambda items: [i * 2 for i in items], key=lambda i: 0,
                                                frames=lambda i: i, max_batch=8)
    assert [worker.submit(i) for i in (3, 5)] == [6, 10]
    calls = _lines(tmp_path)["vocoder"]
    assert [(c["calls"], c["frames"]) for c in calls] == [(1, 3), (1, 5)]


def _write(directory: Path, stage: str, rounds: list[tuple[float, dict[str, float]]]) -> None:
    trace = StepTrace(stage, str(directory))
    for t, fields in rounds:
        trace.record(t, **fields)


def test_the_timeline_finds_each_burst_and_lines_the_stages_up(tmp_path: Path) -> None:
    """Two bursts a second apart: the Thinker prefills 5 then 3 requests, the Talker 5 then 3 a little later, and a
    vocoder call; each burst's table starts at its first Thinker prefill, with the stages' rounds in time order."""
    def thinker(t: float, batch: int, prefilled: int) -> tuple[float, dict[str, float]]:
        return t, {"batch": batch, "prefilled": prefilled, "launch_ms": 1.0, "collect_ms": 8.0, "outputs_ms": 0.5,
                   "round_ms": 10.0}

    t0 = 1_700_000_000.0
    _write(tmp_path, "thinker", [thinker(t0, 5, 5), thinker(t0 + 0.010, 8, 3), thinker(t0 + 0.020, 8, 0),
                                 thinker(t0 + 1.0, 2, 2), thinker(t0 + 1.010, 2, 0)])
    _write(tmp_path, "talker", [(t0 + 0.015, {"batch": 5, "prefilled": 5, "launch_ms": 4.0, "launch_cpu_ms": 3.0,
                                              "collect_ms": 0.0, "outputs_ms": 0.0, "round_ms": 4.0}),
                                (t0 + 0.025, {"batch": 8, "prefilled": 3, "launch_ms": 4.0, "launch_cpu_ms": 2.5,
                                              "collect_ms": 30.0, "outputs_ms": 1.0, "round_ms": 35.0,
                                              "alloc_retries": 1})])
    _write(tmp_path, "vocoder", [(t0 + 0.065, {"calls": 8, "frames": 8, "round_ms": 3.0})])
    rounds = load_rounds(tmp_path)
    assert [r.stage for r in rounds[:4]] == ["thinker", "thinker", "talker", "thinker"]
    assert burst_starts(rounds, idle_s=0.3) == [t0, t0 + 1.0]
    text = timeline(tmp_path, window_s=0.4, idle_s=0.3, bursts=None)
    first, second = text.split("## Burst 1 of 2")[1].split("## Burst 2 of 2")
    assert "- Thinker prefill waves (requests at ms): 5 at 0, 3 at 10" in first
    assert "- Talker prefill waves (requests at ms): talker: 5 at 15, 3 at 25" in first
    assert "Talker: 2 rounds, p50 19.5, max 35.0 ms" in first
    assert "| 25.0 | talker | 8 | 3 | 4.0 (2.5) | 30.0 | 1.0 | 35.0 | 1 |" in first  # one allocator retry
    assert "| 15.0 | talker | 5 | 5 | 4.0 (3.0) | 0.0 | 0.0 | 4.0 |  |" in first  # none (an older trace: no field)
    assert "| 65.0 | vocoder | 8 calls, 8 frames | | | | | 3.0 |  |" in first
    assert "- Thinker prefill waves (requests at ms): 2 at 0" in second and "talker: none" in second
