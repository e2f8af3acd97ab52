"""Relay messages, the sending side (one ordered message per peer per step) and the receiving endpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


@dataclass
class RelayItem:
    """One request's share of a step message. `kind`: data | end | error. Its tensors are complete when it is handed
    to the relay (the producer has waited for the work that made them): transports copy them on streams of their own,
    not behind whatever the producer has queued since. The producer does not change them afterwards: the host path
    sends a host tensor's own bytes, later."""

    request_id: str
    kind: str = "data"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    seq: int = -1  # per-request sequence number, set by the sender


@dataclass
class RelayMessage:
    """Everything one producer step sends to one consumer replica. A message with `control` set carries transport
    signalling (e.g. a collective rendezvous or payload header) instead of items.

    Its way, in epoch seconds (0.0: not stamped; compare across processes of one host): queued by the producer's
    sender, sent (its tensors placed and its header or frame on the way) and arrived (read by the consumer's
    transport, before any copy out of the producer's memory). A request's first item carries them on to its consumer
    (`meta["relay_times"]`)."""

    sender: str
    items: list[RelayItem]
    control: dict[str, Any] | None = None
    queued_at: float = 0.0
    sent_at: float = 0.0
    arrived_at: float = 0.0


@dataclass(frozen=True)
class RelayPeer:
    """Address of a consumer replica: its id, where the host path reaches it (e.g. tcp://10.0.0.3:41234), and its
    placement (device, and the GPU's UUID on CUDA), from which the producer picks a transport."""

    replica_id: str
    address: str
    device: str = "cpu"
    gpu_uuid: str = ""


class RelaySender:
    """Per-peer ordered queues: `send` never blocks the caller; one task per peer ships messages in order.

    It also knows which requests are open on each peer (data sent, no end yet): when the transport reports a peer
    gone (`peer_lost`), exactly those requests fail, including any whose last message was sent into the void."""

    def __init__(self, sender_id: str, transport: "Any", on_failure: Callable[[list[str], Exception], None]) -> None:
        self.sender_id = sender_id
        self.transport = transport
        self.on_failure = on_failure
        self._queues: dict[str, asyncio.Queue[RelayMessage]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._next_seq: dict[str, int] = {}
        self._open: dict[str, set[str]] = {}  # peer replica id -> requests with data sent and no end yet
        if hasattr(transport, "on_peer_lost"):
            transport.on_peer_lost = self.peer_lost

    def peer_lost(self, peer: RelayPeer, error: Exception) -> None:
        """The peer's process is gone: fail every request still open on it."""
        open_requests = sorted(self._open.pop(peer.replica_id, set()))
        if open_requests:
            log.warning("relay peer %s lost with %d open requests", peer.replica_id, len(open_requests))
            self.on_failure(open_requests, error)

    def send(self, peer: RelayPeer, items: list[RelayItem]) -> None:
        """Call on the event loop thread. Items of one request keep their order."""
        open_here = self._open.setdefault(peer.replica_id, set())
        for item in items:
            item.seq = self._next_seq.get(item.request_id, 0)
            self._next_seq[item.request_id] = item.seq + 1
            if item.kind != "data":
                self._next_seq.pop(item.request_id, None)
                open_here.discard(item.request_id)
            else:
                open_here.add(item.request_id)
        queue = self._queues.get(peer.replica_id)
        if queue is None:
            queue = self._queues[peer.replica_id] = asyncio.Queue()
            self._tasks[peer.replica_id] = asyncio.get_running_loop().create_task(self._pump(peer, queue))
        queue.put_nowait(RelayMessage(self.sender_id, items, queued_at=time.time()))

    def forget(self, request_id: str) -> None:
        self._next_seq.pop(request_id, None)
        for open_here in self._open.values():
            open_here.discard(request_id)

    async def _pump(self, peer: RelayPeer, queue: asyncio.Queue[RelayMessage]) -> None:
        while True:
            message = await queue.get()
            try:
                await self.transport.send(peer, message)
            except Exception as exc:  # the peer is gone: fail only the requests in this message
                log.warning("relay to %s failed: %s", peer.replica_id, exc)
                # whichever layer noticed (a reset, a refused connect, the collective), the error names the peer
                error = ConnectionError(f"relay peer {peer.replica_id} could not be reached ({type(exc).__name__}: {exc})")
                self.on_failure([i.request_id for i in message.items], error)


class RelayEndpoint:
    """Receiving side. Items are handed to the request's consumer once it claims the request; until then buffered."""

    def __init__(self, remember_closed: int = 4096, unclaimed_ttl_s: float = 60.0) -> None:
        self._handlers: dict[str, Callable[[RelayItem], None]] = {}
        self._pending: dict[str, list[RelayItem]] = {}
        self._pending_since: dict[str, float] = {}
        self._unclaimed_ttl_s = unclaimed_ttl_s
        self._expected_seq: dict[str, int] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()  # released requests: late items are dropped
        self._remember_closed = remember_closed
        self._control_handlers: dict[str, Callable[[RelayMessage], None]] = {}  # by control op
        self._hold_back: Callable[[RelayMessage], bool] | None = None
        # the CUDA streams besides the device's default one that the consumer reads delivered tensors on (a Talker's
        # lanes): see `hand_over`
        self.reader_streams: list[torch.cuda.Stream] = []

    def hand_over(self, buffer: torch.Tensor) -> None:
        """A device buffer that a transport allocated and filled on a stream of its own becomes the consumer's: its
        memory goes back to the transport only after the work that the consumer's streams had queued when it was
        freed. A consumer launches steps ahead, so a delivered tensor it has dropped may not have been read yet;
        without this, the transport's next buffer could take the same memory and be written while that read still
        waits (seen as a device-side assert on a Talker fed over NCCL)."""
        if not buffer.is_cuda or buffer.numel() == 0:
            return
        for stream in [torch.cuda.default_stream(buffer.device), *self.reader_streams]:
            buffer.record_stream(stream)

    def hold_back_with(self, hook: Callable[[RelayMessage], bool]) -> None:
        """`hook(message)` sees each item message as it arrives and returns True when it keeps the message, to hand
        it to `deliver_items` later: a receiver whose own deliveries lag their arrival (CUDA IPC copying a buffer
        out) keeps what arrives another way behind them, so one producer's messages stay in order over two paths."""
        self._hold_back = hook

    def on_control(self, ops: tuple[str, ...], handler: Callable[[RelayMessage], None]) -> None:
        """Control messages whose op is one of `ops` go to `handler` (a transport's receiving side, or the stage)."""
        for op in ops:
            self._control_handlers[op] = handler

    def deliver(self, message: RelayMessage) -> None:
        if message.control is not None:
            handler = self._control_handlers.get(message.control.get("op", ""))
            if handler is None:
                log.warning("dropping a relay control message: nothing handles op %r here", message.control.get("op"))
            else:
                handler(message)
            return
        if self._hold_back is None or not self._hold_back(message):
            self.deliver_items(message)

    def deliver_items(self, message: RelayMessage) -> None:
        """An item message's items to their requests' consumers, in order (`deliver` without the hold-back)."""
        for item in message.items:
            if item.request_id in self._closed:
                continue
            expected = self._expected_seq.get(item.request_id, 0)
            if item.seq != expected:
                raise RuntimeError(f"relay order broken for {item.request_id}: got {item.seq}, expected {expected}")
            self._expected_seq[item.request_id] = expected + 1
            if expected == 0:  # the request's first item: how its message came (`RelayMessage`)
                item.meta["relay_times"] = (message.queued_at, message.sent_at, message.arrived_at)
            handler = self._handlers.get(item.request_id)
            if handler is None:
                self._pending.setdefault(item.request_id, []).append(item)
                self._pending_since.setdefault(item.request_id, time.monotonic())
            else:
                handler(item)
        self._drop_unclaimed()

    def _drop_unclaimed(self) -> None:
        """Items for a request nobody claims (its consumer call never came) are dropped after a TTL."""
        cutoff = time.monotonic() - self._unclaimed_ttl_s
        for rid in [r for r, since in self._pending_since.items() if since < cutoff]:
            log.warning("dropping relay items of unclaimed request %s", rid)
            self.release(rid)

    def claim(self, request_id: str, handler: Callable[[RelayItem], None]) -> None:
        self._handlers[request_id] = handler
        self._pending_since.pop(request_id, None)
        for item in self._pending.pop(request_id, []):
            handler(item)

    def release(self, request_id: str) -> None:
        self._closed[request_id] = None
        while len(self._closed) > self._remember_closed:
            self._closed.popitem(last=False)
        self._handlers.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._pending_since.pop(request_id, None)
        self._expected_seq.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {"claimed": len(self._handlers), "buffered": len(self._pending)}
