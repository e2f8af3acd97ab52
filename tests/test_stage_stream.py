"""A stage's event stream: events queued while the consumer is away travel as one batch, in order, and the stream
ends at its final or error event (StageBase alone, no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

from omni_ray.stages.base import StageBase


async def _drain(stage: StageBase, rid: str) -> list[list[dict[str, Any]]]:
    return [batch async for batch in stage.stream(rid)]


def test_a_lagging_consumer_gets_queued_events_in_one_batch_in_order() -> None:
    async def scenario() -> tuple[list[list[dict[str, Any]]], StageBase]:
        stage = StageBase("test-stage")
        stage.open_stream("r1")
        stream = stage.stream("r1")
        stage.emit("r1", {"type": "token", "token": 0})
        first = await anext(stream)  # the consumer keeps up: one event per item
        for token in range(1, 6):  # then it lags while five events arrive
            stage.emit("r1", {"type": "token", "token": token})
        stage.emit("r1", {"type": "final", "finish_reason": "length"})
        stage.emit("r1", {"type": "token", "token": 99})  # after the final: never delivered
        await asyncio.sleep(0)
        rest = [batch async for batch in stream]
        return [first, *rest], stage

    batches, stage = asyncio.run(scenario())
    assert [len(b) for b in batches] == [1, 6]
    assert [e.get("token") for b in batches for e in b] == [0, 1, 2, 3, 4, 5, None]
    assert batches[-1][-1]["type"] == "final"
    assert stage.completed == 1 and stage.failed == 0 and stage.active_requests() == 0


def test_an_error_ends_the_stream_and_counts_as_failed() -> None:
    async def scenario() -> tuple[list[list[dict[str, Any]]], StageBase]:
        stage = StageBase("test-stage")
        stage.open_stream("r2")
        stage.emit("r2", {"type": "token", "token": 1})
        stage.fail("r2", "boom")
        await asyncio.sleep(0)
        return await _drain(stage, "r2"), stage

    batches, stage = asyncio.run(scenario())
    assert [[e["type"] for e in b] for b in batches] == [["token", "error"]]
    assert stage.failed == 1 and stage.completed == 0
