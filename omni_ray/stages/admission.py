"""Admission by expected work: a stage refuses a request at once when its engine's queue would hold it too long."""

from __future__ import annotations

import math
from typing import Protocol

from omni_ray.errors import CapacityError


class QueuedEngine(Protocol):
    def expected_wait_s(self) -> float: ...


def refuse_if_queue_too_long(stage: str, engine: QueuedEngine, max_queue_wait_s: float) -> None:
    """Raise CapacityError (a 503 with Retry-After at the ingress) when a request added now would wait longer than
    `max_queue_wait_s` (0: no bound) for admission; its `retry_after_s` is when the queue should be short enough
    again, at the engine's measured rate. Call before the stream's first event, so the caller learns it at once."""
    if max_queue_wait_s <= 0:
        return
    wait = engine.expected_wait_s()
    if wait > max_queue_wait_s:
        raise CapacityError(
            f"{stage} is at capacity: a new request would wait about {wait:.1f} s for admission "
            f"(max_queue_wait_s {max_queue_wait_s:g})",
            retry_after_s=float(max(1, math.ceil(wait - max_queue_wait_s))),
        )
