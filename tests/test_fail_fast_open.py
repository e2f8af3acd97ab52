"""A request's stage streams open at once, and the first stage to refuse wins: the caller hears the refusal at once
(with its cause, for the 503) while the other opens are cancelled and their streams closed, instead of waiting for
them (a stream queued at Serve's router may wait for tens of seconds)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import pytest

from omni_ray.errors import CapacityError, StageError
from omni_ray.relay import RelayLinks
from omni_ray.stages.admission import refusal_event
from omni_ray.stages.streams import RequestStreams

REFUSE_AFTER_S = 0.05


class BackPressureError(RuntimeError):
    """Named as Serve's: what its router raises when a deployment's queue is full."""


class FakeStage:
    """A stage client whose stream opens after `ready_after_s` (None: never, as a stream queued behind a full
    replica), or refuses with `refusal` after REFUSE_AFTER_S. Records when its stream was closed."""

    def __init__(self, ready_after_s: float | None = 0.0, refusal: Exception | None = None) -> None:
        self.ready_after_s, self.refusal = ready_after_s, refusal
        self.refused_at: float | None = None
        self.closed_at: float | None = None

    async def stream(self, method: str, *args: Any) -> AsyncIterator[dict[str, Any]]:
        try:
            if self.refusal is not None:
                await asyncio.sleep(REFUSE_AFTER_S)
                self.refused_at = time.perf_counter()
                if isinstance(self.refusal, CapacityError):  # as a stage's own admission refuses: an event
                    yield refusal_event(self.refusal)
                    return
                raise self.refusal  # as Serve's router, or the vocoder's state slots
            if self.ready_after_s is None:
                await asyncio.Event().wait()  # queued for good
            await asyncio.sleep(self.ready_after_s or 0)
            yield {"type": "ready", "peer": f"{method}-peer"}
            await asyncio.Event().wait()
        finally:
            self.closed_at = time.perf_counter()


async def _open(stages: dict[str, FakeStage]) -> None:
    """Open a request's three streams as a caller does, closing whatever opened when that fails."""
    streams = RequestStreams(stages, RelayLinks())  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(streams.open({name: ("stream", ()) for name in stages}), timeout=5)
    finally:
        await streams.close()


@pytest.mark.parametrize("refusal", [BackPressureError("talker's queue is full"),
                                     CapacityError("talker is at capacity", retry_after_s=3.0)])
def test_the_first_refusal_is_raised_at_once_and_every_other_stream_is_closed(refusal: Exception) -> None:
    stages = {"thinker": FakeStage(ready_after_s=None), "talker": FakeStage(refusal=refusal),
              "vocoder": FakeStage(ready_after_s=0.0)}
    started = time.perf_counter()
    with pytest.raises(StageError, match="talker") as raised:
        asyncio.run(_open(stages))
    heard = time.perf_counter()
    cause = raised.value.__cause__  # the ingress finds it in the cause chain: 503 with Retry-After
    assert type(cause) is type(refusal) and str(cause) == str(refusal)
    assert getattr(cause, "retry_after_s", None) == getattr(refusal, "retry_after_s", None)
    refused_at = stages["talker"].refused_at
    assert refused_at is not None and heard - refused_at < 0.1, f"{(heard - refused_at) * 1000:.0f} ms"
    assert heard - started < 1.0
    # the queued open was cancelled and its stream closed; the open one was closed by the caller's cleanup
    for name in ("thinker", "vocoder"):
        closed_at = stages[name].closed_at
        assert closed_at is not None and closed_at - refused_at < 0.1, name


def test_a_stream_that_opens_before_another_refuses_is_closed_too() -> None:
    stages = {"thinker": FakeStage(ready_after_s=0.0), "talker": FakeStage(ready_after_s=0.5),
              "vocoder": FakeStage(refusal=BackPressureError("the vocoder's queue is full"))}
    with pytest.raises(StageError, match="vocoder did not start"):
        asyncio.run(_open(stages))
    assert all(stage.closed_at is not None for stage in stages.values())
    assert stages["talker"].closed_at - stages["vocoder"].refused_at < 0.1  # cancelled, not awaited


def test_the_503_carries_the_stages_retry_after() -> None:
    from omni_ray.serve.ingress import _as_openai_error

    def raised(cause: Exception) -> StageError:
        try:
            raise StageError("talker: at capacity") from cause
        except StageError as exc:
            return exc

    assert _as_openai_error(raised(CapacityError("busy", retry_after_s=4.0))).headers["Retry-After"] == "4"
    assert _as_openai_error(raised(CapacityError("busy"))).headers["Retry-After"] == "1"  # no estimate: 1 s
    assert _as_openai_error(raised(BackPressureError("full"))).headers["Retry-After"] == "1"
