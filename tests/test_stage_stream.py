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


def test_one_steps_events_for_many_streams_arrive_in_one_hand_over() -> None:
    """`emit_all` (an engine step's events for every request) from another thread: one wake-up of the event loop, and
    each stream gets its own events in order, with the step's time."""
    import threading

    async def scenario() -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]], int]:
        stage = StageBase("test-stage")
        for rid in ("a", "b"):
            stage.open_stream(rid)
        loop = asyncio.get_running_loop()
        handed_over = 0
        original = loop.call_soon_threadsafe

        def counting(*args: Any) -> Any:
            nonlocal handed_over
            handed_over += 1
            return original(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        step = [("a", {"type": "token", "token": 1}), ("b", {"type": "token", "token": 2}),
                ("a", {"type": "final", "finish_reason": "stop"}), ("b", {"type": "final", "finish_reason": "length"})]
        worker = threading.Thread(target=stage.emit_all, args=(step,))
        worker.start()
        worker.join()
        return await _drain(stage, "a"), await _drain(stage, "b"), handed_over

    a, b, handed_over = asyncio.run(scenario())
    assert handed_over == 1
    assert [[e.get("token") for e in batch] for batch in a] == [[1, None]]
    assert [[e.get("token") for e in batch] for batch in b] == [[2, None]]
    assert a[0][0]["t"] == a[0][1]["t"] == b[0][0]["t"]


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


def test_items_wait_until_their_consumer_is_named_and_only_it_gets_them() -> None:
    """A producer holds the request's relay items until the caller names its consumer (`RelayLinks.connect`), then
    sends them in order and the later ones straight away. A request that ends first keeps its items for a late
    consumer; an aborted one drops them; a request with no consumer relays nothing."""
    import torch

    from omni_ray.relay import RelayItem, RelayMessage, RelayPeer

    stage = StageBase("producer")
    sent: list[tuple[str, str, int]] = []
    stage.relay_step = lambda items: sent.extend((p.replica_id, i.request_id, i.meta["n"]) for p, i in items)  # type: ignore[method-assign]
    stage.endpoint.on_control(("consumer",), stage._on_consumer)  # as relay_peer() registers it
    stage.endpoint.on_control(("join",), lambda message: sent.append(("transport", message.control["op"], 0)))  # type: ignore[index]
    consumer = RelayPeer("talker-1", "tcp://127.0.0.1:1")

    def name_consumer(rid: str) -> None:  # what RelayLinks.connect delivers
        stage.endpoint.deliver(RelayMessage("caller", [], control={"op": "consumer", "request": rid, "peer": consumer}))

    def step(rid: str, n: int) -> None:
        stage._route([(None, RelayItem(rid, tensors={"x": torch.zeros(1)}, meta={"n": n}))])

    stage.expect_consumer("a")
    step("a", 0)
    step("a", 1)
    assert sent == []  # held
    name_consumer("a")
    step("a", 2)
    assert sent == [("talker-1", "a", 0), ("talker-1", "a", 1), ("talker-1", "a", 2)]

    sent.clear()
    stage.expect_consumer("short")
    step("short", 0)
    stage.forget_consumer("short", finished=True)  # its reply ended before the consumer opened
    name_consumer("short")
    stage.expect_consumer("aborted")
    step("aborted", 0)
    stage.forget_consumer("aborted")
    name_consumer("aborted")
    # "text-only" expects no consumer
    step("text-only", 0)
    stage.endpoint.deliver(RelayMessage("x", [], control={"op": "join"}))  # transport signalling still reaches transports
    assert sent == [("talker-1", "short", 0), ("transport", "join", 0)]
    assert not stage.has_consumer("short") and not stage.has_consumer("aborted") and not stage.has_consumer("text-only")
