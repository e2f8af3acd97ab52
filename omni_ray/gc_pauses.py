"""Python's garbage-collector pauses in this process: how often and how long the cyclic collector held its threads."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

GENERATIONS = 3


class GcPauses:
    """Times every collection of this process's cyclic garbage collector through `gc.callbacks`. A collection holds the
    GIL throughout, so an engine thread waits it out before its next launch; the full (generation 2) ones walk every
    tracked object of the process: after a stage's startup, hundreds of thousands (modules, compiled graphs).
    `freeze_startup_objects` moves those out of the collector's way (`gc.freeze`)."""

    def __init__(self) -> None:
        self.pause_s = [0.0] * GENERATIONS  # cumulative, per generation
        self.collections = [0] * GENERATIONS
        self.longest_s = 0.0
        self.frozen_objects = 0  # moved to the permanent generation by `freeze_startup_objects`
        self._started: float | None = None
        self._generation = 0

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started, self._generation = time.perf_counter(), min(int(info["generation"]), GENERATIONS - 1)
        elif self._started is not None:
            paused = time.perf_counter() - self._started
            self._started = None
            self.pause_s[self._generation] += paused
            self.collections[self._generation] += 1
            self.longest_s = max(self.longest_s, paused)

    def freeze_startup_objects(self) -> int:
        """Collect once, then move every object still tracked (what startup made and keeps) to the permanent
        generation, which later collections skip; returns how many were moved."""
        gc.collect()
        gc.freeze()
        self.frozen_objects = gc.get_freeze_count()
        return self.frozen_objects

    def stats(self) -> dict[str, float]:
        return {"gc_pause_s": sum(self.pause_s), "gc_collections": float(sum(self.collections)),
                "gc_full_collections": float(self.collections[-1]), "gc_full_pause_s": self.pause_s[-1],
                "gc_pause_max_ms": self.longest_s * 1000, "gc_frozen_objects": float(self.frozen_objects)}


_process_pauses: GcPauses | None = None
_install_lock = threading.Lock()


def process_gc_pauses() -> GcPauses:
    """This process's `GcPauses`, installed into `gc.callbacks` on first use."""
    global _process_pauses
    with _install_lock:
        if _process_pauses is None:
            _process_pauses = GcPauses()
            gc.callbacks.append(_process_pauses._on_collection)
        return _process_pauses
