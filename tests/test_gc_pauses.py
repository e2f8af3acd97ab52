"""The garbage collector's pauses each stage replica reports, and freezing what its startup left."""

from __future__ import annotations

import gc
from typing import Iterator

import pytest

from omni_ray.config import StageResources
from omni_ray.gc_pauses import process_gc_pauses
from omni_ray.stages.base import StageBase


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def make_cycles(count: int) -> None:
    for _ in range(count):
        a: dict[str, object] = {}
        b = {"a": a}
        a["b"] = b


def test_every_collection_is_timed_by_generation() -> None:
    pauses = process_gc_pauses()
    assert process_gc_pauses() is pauses and gc.callbacks.count(pauses._on_collection) == 1  # installed once
    before = pauses.stats()
    make_cycles(1000)
    gc.collect(0)
    gc.collect(2)
    after = pauses.stats()
    assert after["gc_collections"] >= before["gc_collections"] + 2
    assert after["gc_full_collections"] >= before["gc_full_collections"] + 1
    assert after["gc_full_pause_s"] > before["gc_full_pause_s"] and after["gc_pause_s"] > before["gc_pause_s"]
    assert after["gc_pause_max_ms"] > 0


def test_a_stage_reports_its_pauses_and_freezes_its_startup_objects_when_asked(unfrozen: None) -> None:
    stage = StageBase(device="cpu")
    stage.startup_done(StageResources())  # not asked: nothing frozen
    stats = stage.load_stats()
    assert {"gc_pause_s", "gc_collections", "gc_full_collections", "gc_pause_max_ms"} <= set(stats)
    assert gc.get_freeze_count() == 0 and stats["gc_frozen_objects"] == 0
    stage.startup_done(StageResources(gc_freeze_after_startup=True))
    frozen = stage.load_stats()["gc_frozen_objects"]
    # everything the process keeps (torch, pydantic, this test session) is out of the collector's way
    assert frozen > 10_000 and gc.get_freeze_count() > 10_000  # (less once some of them are freed)
    assert len(gc.get_objects(2)) < frozen / 10  # a full collection now walks a small part of them
