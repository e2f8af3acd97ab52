"""A request's stage streams as its caller holds them: opened together, relay-linked, merged, closed together."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable

from omni_ray.errors import StageError
from omni_ray.relay import RelayLinks, RelayPeer
from omni_ray.stages.admission import refusal_error
from omni_ray.stages.client import StageClient


class RequestStreams:
    """The stage streams of one request. `open` starts several at once; each stream's events then land in one queue
    as (stage name, event), which `merged` reads. `close` cancels every stream still open, and each stage frees the
    request."""

    def __init__(self, stages: dict[str, StageClient], links: RelayLinks) -> None:
        self.stages = stages
        self.links = links
        self.events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.names: list[str] = []  # the streams open, in the order they opened
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self, opening: dict[str, tuple[str, tuple[Any, ...]]]) -> dict[str, RelayPeer]:
        """Open {stage: (method, args)} together; returns each stage's relay peer once all are open. The first stage
        to refuse (CapacityError, Serve's BackPressureError: a 503 at the ingress) or fail raises StageError at
        once: the opens still pending are cancelled (a stream queued at Serve's router leaves the queue), and
        `close` closes those already open."""
        futures = {name: asyncio.ensure_future(self._open_one(name, method, *args))
                   for name, (method, args) in opening.items()}
        return await _all_open(futures)

    async def _open_one(self, name: str, method: str, *args: Any) -> Any:
        """Start a stage stream; its first event names the replica's relay address."""
        iterator = self.stages[name].stream(method, *args).__aiter__()
        try:
            first = await iterator.__anext__()
        except asyncio.CancelledError:  # another stage refused first (or the caller left): close this stream
            await iterator.aclose()  # type: ignore[attr-defined]
            raise
        except Exception as exc:
            raise StageError(f"{name} did not start: {exc}") from exc
        if first["type"] != "ready":
            await iterator.aclose()  # type: ignore[attr-defined]
            refused = refusal_error(first) if first["type"] == "refused" else None
            raise StageError(f"{name}: {first.get('message', 'did not start')}") from refused
        self._tasks.append(asyncio.ensure_future(_pump(name, iterator, self.events)))
        self.names.append(name)
        return first["peer"]

    async def link(self, producer: RelayPeer, consumer: RelayPeer, request_id: str) -> None:
        """Tell a producer replica the consumer of this request's items."""
        try:
            await self.links.connect(producer, consumer, request_id)
        except (OSError, asyncio.TimeoutError) as exc:
            raise StageError(f"could not reach relay peer {producer.replica_id}: {exc}") from exc

    def run_beside(self, name: str, work: Awaitable[Any]) -> None:
        """A call the request needs beside its streams (an encoder's): its failure is that stage's error event."""
        self._tasks.append(asyncio.ensure_future(_report_failure(name, work, self.events)))

    async def merged(self, timing: dict[str, float]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Every open stream's events until each has ended. An error event raises StageError naming its stage; a
        final event is kept in `finals` (its timing points go into `timing`); audio events mark the first and last
        audio in `timing`; every event but finals is yielded, as (stage, event)."""
        self.finals: dict[str, dict[str, Any]] = {}
        while len(self.finals) < len(self.names):
            name, event = await self.events.get()
            kind = event["type"]
            if kind == "error":
                raise StageError(f"{name}: {event['message']}")
            if kind == "final":
                self.finals[name] = event
                timing.update({key: t for key, t in event.get("timing", {}).items() if t is not None})
                continue
            if kind == "audio":
                timing.setdefault("first_audio", event["t"])  # made by the vocoder
                timing.setdefault("first_audio_received", time.time())  # here, on its way to the caller
                timing["last_audio"] = event["t"]
            yield name, event

    async def close(self) -> None:
        for task in self._tasks:  # cancelling a pump closes its stage stream: that stage frees the request
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _all_open(opening: dict[str, asyncio.Future[Any]]) -> dict[str, Any]:
    """Each stage's relay peer once every stream is open; the first failure is raised at once, the opens still
    pending cancelled."""
    pending: set[asyncio.Future[Any]] = set(opening.values())
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            failed = [future for future in done if not future.cancelled() and future.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
    finally:
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return {name: future.result() for name, future in opening.items()}


async def _pump(name: str, iterator: AsyncIterator[dict[str, Any]], events: asyncio.Queue[tuple[str, Any]]) -> None:
    try:
        async for event in iterator:
            events.put_nowait((name, event))
    except asyncio.CancelledError:
        await iterator.aclose()  # type: ignore[attr-defined]
        raise
    except Exception as exc:  # the stage raised: surface it as that stream's error
        events.put_nowait((name, {"type": "error", "message": str(exc)}))


async def _report_failure(name: str, work: Awaitable[Any], events: asyncio.Queue[tuple[str, Any]]) -> None:
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        events.put_nowait((name, {"type": "error", "message": str(exc)}))
