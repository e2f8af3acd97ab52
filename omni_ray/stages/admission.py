"""Admission by expected work: a stage refuses a request at once when its engine's queue would hold it too long."""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from omni_ray.errors import CapacityError


class QueuedEngine(Protocol):
    def expected_wait_s(self) -> float: ...


class AdmittingStage(Protocol):
    stage_name: str
    refused: int  # requests refused so far (its load stats report it)


def refuse_if_queue_too_long(stage: AdmittingStage, engine: QueuedEngine, max_queue_wait_s: float) -> None:
    """Raise CapacityError (a 503 with Retry-After at the ingress) when a request added now would wait longer than
    `max_queue_wait_s` (0: no bound) for admission; its `retry_after_s` is when the queue should be short enough
    again, at the engine's measured rate. Call before the stream's first event, so the caller learns it at once."""
    if max_queue_wait_s <= 0:
        return
    wait = engine.expected_wait_s()
    if wait > max_queue_wait_s:
        stage.refused += 1
        raise CapacityError(
            f"{stage.stage_name} is at capacity: a new request would wait about {wait:.1f} s for admission "
            f"(max_queue_wait_s {max_queue_wait_s:g})",
            retry_after_s=float(max(1, math.ceil(wait - max_queue_wait_s))),
        )


def refusal_event(error: CapacityError) -> dict[str, Any]:
    """A stream's first event when its stage refuses the request: the caller raises a CapacityError for it
    (`refusal_error`). An event rather than an exception out of the stream, so that a burst's refusals cost no
    traceback and no error log in the replica each, and the caller tells a refusal from a failure."""
    return {"type": "refused", "message": str(error), "retry_after_s": error.retry_after_s, "t": time.time()}


def refusal_error(event: dict[str, Any]) -> CapacityError:
    """The CapacityError a `refusal_event` stands for."""
    return CapacityError(event.get("message", "at capacity"), retry_after_s=event.get("retry_after_s"))
