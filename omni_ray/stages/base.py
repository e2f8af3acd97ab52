"""StageBase: what every stage replica has: an id, a relay endpoint/sender and per-request event streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from omni_ray.relay import LOCAL_ENDPOINTS, PlacementTransport, RelayEndpoint, RelayItem, RelayPeer, RelaySender, RelayServer

FINAL_TYPES = frozenset({"final", "error"})


class StageBase:
    """Event streams are asyncio queues filled from engine threads via `emit` and drained by `stream`."""

    stage_name = "stage"

    def __init__(self, replica_id: str | None = None) -> None:
        self.replica_id = replica_id or _serve_replica_id() or f"{self.stage_name}-{uuid.uuid4().hex[:8]}"
        self.endpoint = RelayEndpoint()
        self._server: RelayServer | None = None
        self._peer_lock = asyncio.Lock()
        self._streams: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._sender: RelaySender | None = None
        self._self_peer: RelayPeer | None = None
        self.completed = 0
        self.failed = 0
        self._reporter: Any = None

    def start_reporting(self) -> None:
        """Under Serve: post this replica's load to the stats board (for /metrics and /ready)."""
        if _serve_replica_id() is not None and self._reporter is None:
            from omni_ray.serve.stats import StatsReporter

            self._reporter = StatsReporter(self.replica_id, self.load_stats)

    def load_stats(self) -> dict[str, Any]:
        """What this replica is doing now. Stages with an engine add running/waiting/KV numbers."""
        return {"stage": self.stage_name, "streams": self.active_requests(), "completed": self.completed,
                "failed": self.failed, "load": self.active_requests()}

    async def stats(self) -> dict[str, Any]:
        return self.load_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: the stage's own load signal."""
        stats = self.load_stats()
        metrics = {"load": float(stats["load"])}
        if stats.get("kv_total"):
            metrics["kv_occupancy"] = stats["kv_used"] / stats["kv_total"]
        return metrics

    # ---- relay -------------------------------------------------------------------------------------------
    async def relay_peer(self) -> RelayPeer:
        """This replica's relay address; the listener starts on first use (on the replica's event loop)."""
        self._bind_loop()
        async with self._peer_lock:
            if self._self_peer is None:
                self._server = RelayServer(self.endpoint)
                address = await self._server.start(_node_ip())
                LOCAL_ENDPOINTS[self.replica_id] = self.endpoint
                self._self_peer = RelayPeer(self.replica_id, address)
        return self._self_peer

    async def ready_event(self) -> dict[str, Any]:
        """First event of every stage stream: where this replica receives relay messages."""
        return {"type": "ready", "peer": await self.relay_peer(), "t": time.time()}

    @property
    def sender(self) -> RelaySender:
        if self._sender is None:
            self._sender = RelaySender(self.replica_id, PlacementTransport(), self._relay_failed)
        return self._sender

    def _relay_failed(self, request_ids: list[str], error: Exception) -> None:
        for rid in request_ids:
            self.fail(rid, f"relay to the next stage failed: {error}")

    # ---- streams -----------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        if self._event_loop is None:
            self._event_loop = asyncio.get_running_loop()

    def open_stream(self, request_id: str) -> None:
        self._bind_loop()
        if request_id in self._streams:
            raise ValueError(f"request {request_id} is already running on {self.replica_id}")
        self._streams[request_id] = asyncio.Queue()

    def emit(self, request_id: str, event: dict[str, Any]) -> None:
        """Thread-safe: queue an event for the request's stream (dropped if the stream is gone)."""
        event.setdefault("t", time.time())
        loop = self._event_loop
        if loop is None:
            return
        loop.call_soon_threadsafe(self._put, request_id, event)

    def _put(self, request_id: str, event: dict[str, Any]) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(event)

    def fail(self, request_id: str, message: str) -> None:
        self.emit(request_id, {"type": "error", "message": message})

    async def stream(self, request_id: str) -> AsyncIterator[dict[str, Any]]:
        """Yield the request's events until its final (or error) event; always closes the stream."""
        queue = self._streams[request_id]
        try:
            while True:
                event = await queue.get()
                yield event
                if event["type"] in FINAL_TYPES:
                    if event["type"] == "final":
                        self.completed += 1
                    else:
                        self.failed += 1
                    return
        finally:
            self._streams.pop(request_id, None)

    def active_requests(self) -> int:
        return len(self._streams)

    # ---- identity ----------------------------------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "stage": self.stage_name, "peer": await self.relay_peer()}

    def relay_step(self, items: list[tuple[RelayPeer, RelayItem]]) -> None:
        """Ship one engine step's relay items: one message per consumer replica, with every request bound there.
        Call on the event loop thread."""
        batches: dict[str, tuple[RelayPeer, list[RelayItem]]] = {}
        for peer, item in items:
            batches.setdefault(peer.replica_id, (peer, []))[1].append(item)
        for peer, group in batches.values():
            self.sender.send(peer, group)

    def relay_step_threadsafe(self, items: list[tuple[RelayPeer, RelayItem]]) -> None:
        """relay_step from an engine thread."""
        if self._event_loop is not None and items:
            self._event_loop.call_soon_threadsafe(self.relay_step, items)

    def send_end(self, peer: RelayPeer | None, request_id: str, kind: str = "end", **meta: Any) -> None:
        if peer is not None:
            self.sender.send(peer, [RelayItem(request_id, kind=kind, meta=meta)])


def _serve_replica_id() -> str | None:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not a Serve replica
        return None


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:
        pass
    return "127.0.0.1"
