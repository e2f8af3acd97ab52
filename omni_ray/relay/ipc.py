"""CUDA IPC relay between processes on one GPU: a step's tensors go into device memory the consumer has opened once,
their place travels on the host path, and the consumer copies them out on the device, with no host round trip.

Framing is the collective relay's (`pack`/`unpack`: one flat buffer, a tensor-free header). Each producer keeps one
`SharedRing` per consumer: device memory of its own outside PyTorch's allocator (`device_memory`), whose IPC handle
the consumer opens once and caches (opening a handle costs about a millisecond, more than the host path's whole
message). Messages are written at the ring's head on a side stream, synchronized before their place leaves, and the
consumer writes the sequence number of the last message it copied out into the ring's first 8 bytes, on the device,
so the producer reuses space only after the copy. A message that does not fit (larger than half the ring, or a
consumer that lags) goes on the host path instead, behind the ones before it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from contextlib import nullcontext
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.collective import _control, _failed, flatten, pack, unpack
from omni_ray.relay.device_memory import OpenedDeviceBuffer, SharedDeviceBuffer
from omni_ray.relay.tcp import TcpTransport

log = logging.getLogger(__name__)

RING_BYTES = 64 << 20  # one ring per consumer; a message over half of it goes on the host path
ACK_BYTES = 256  # the ring's head: the consumer's last copied sequence number (int64), padded to the ring's alignment
OPEN_RINGS = 16  # rings a consumer keeps open (one per producer replica that sends to it)


class RingSpace:
    """Where the next message goes in a ring of `capacity` bytes: records are placed in order at a moving head and
    freed oldest first, up to the sequence number the consumer acknowledged. Pure bookkeeping."""

    def __init__(self, capacity: int, align: int = ACK_BYTES) -> None:
        self.capacity = capacity
        self.align = align
        self.head = 0
        self.seq = 0
        self.records: deque[tuple[int, int, int]] = deque()  # (seq, start, end), oldest first

    def release(self, acked: int) -> None:
        while self.records and self.records[0][0] <= acked:
            self.records.popleft()
        if not self.records:
            self.head = 0

    def _size(self, nbytes: int) -> int:
        return -(-max(nbytes, 1) // self.align) * self.align

    def too_big(self, nbytes: int) -> bool:
        """Over half the ring: such a message always goes in a buffer of its own."""
        return self._size(nbytes) > self.capacity // 2

    def reserve(self, nbytes: int) -> tuple[int, int] | None:
        """(seq, offset) for a message of nbytes, or None when it does not fit now."""
        if self.too_big(nbytes):
            return None
        size = self._size(nbytes)
        offset = self._fit(size)
        if offset is None:
            return None
        self.seq += 1
        self.records.append((self.seq, offset, offset + size))
        self.head = offset + size
        return self.seq, offset

    def _fit(self, size: int) -> int | None:
        if not self.records:
            return 0
        oldest, newest = self.records[0][1], self.records[-1][1]
        if newest >= oldest:  # live data is one run [oldest, head): free after it, then before it
            if self.head + size <= self.capacity:
                return self.head
            return 0 if size <= oldest else None
        return self.head if self.head + size <= oldest else None  # wrapped: free is [head, oldest)


class SharedRing:
    """Producer side of one consumer's ring: device memory of its own (zeroed), its IPC handle, its space, and the
    stream that writes its messages."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, capacity: int = RING_BYTES) -> None:
        self.ring_id = uuid.uuid4().hex
        self.stream = stream
        self.memory = SharedDeviceBuffer(ACK_BYTES + capacity, device)
        self.buffer = self.memory.tensor
        self.space = RingSpace(capacity)
        self._ack_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.handle = self.memory.handle

    def reserve(self, nbytes: int) -> tuple[int, torch.Tensor] | None:
        """(seq, the message's bytes in the ring) or None. Reads the consumer's acknowledgement (on the ring's stream,
        not waiting for compute) only when the message does not fit in what is known to be free."""
        if self.space.too_big(nbytes):
            return None  # no acknowledgement can make room for it
        placed = self.space.reserve(nbytes)
        if placed is None and self.space.records:
            with torch.cuda.stream(self.stream):
                self._ack_host.copy_(self.buffer[:8].view(torch.int64), non_blocking=True)
            self.stream.synchronize()
            self.space.release(int(self._ack_host.item()))
            placed = self.space.reserve(nbytes)
        if placed is None:
            return None
        seq, offset = placed
        return seq, self.buffer[ACK_BYTES + offset : ACK_BYTES + offset + nbytes]


class IpcTransport:
    """Producer side: `send(peer, message)` writes the step's tensors into the peer's ring, place on the host path,
    or the whole message on the host path when the ring cannot take it. Only for a peer on this process's GPU
    (same-process peers get the local hand-off). A message for a ring that exists goes in on the event loop's
    thread; making a ring, and any message behind that, go through a worker thread (in order: one worker, and no
    message placed on the loop while it has work)."""

    def __init__(self, device: torch.device | str, control: TcpTransport, ring_bytes: int = RING_BYTES) -> None:
        self.device = torch.device(device)
        self.control = control
        self.ring_bytes = ring_bytes
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ipc")  # rings in send order
        self._rings: dict[str, SharedRing] = {}  # consumer replica id -> its ring
        self._in_worker = 0  # shares handed to the worker and not back yet (event loop thread only)
        self.shared = 0  # messages placed in a ring
        self.by_host = 0  # messages the ring could not take, sent whole on the host path
        self.inline = 0  # ring messages placed on the event loop's thread

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        header, tensors, nbytes = pack(message)
        place: dict[str, Any] | None = {}
        ring = self._rings.get(peer.replica_id)
        if nbytes and ring is not None and not ring.space.too_big(nbytes) and not self._in_worker:
            # A ring write is one copy on an idle side stream: placed here, the message leaves before the tasks
            # this step woke (a reply's token events) run, instead of after the hop to the worker and back.
            place = self._share(peer.replica_id, tensors, nbytes)
            self.inline += 1
        elif nbytes:  # the consumer's first message (making its ring) or one too big for it: a worker's time
            self._in_worker += 1
            try:
                place = await asyncio.wrap_future(self._worker.submit(self._share, peer.replica_id, tensors, nbytes))
            finally:
                self._in_worker -= 1
        if place is None:  # the ring cannot take it: the whole message on the host path, behind the ones before it
            self.by_host += 1
            await self.control.send(peer, message)
            return
        header.sent_at = time.time()
        await self.control.send(peer, _control(message.sender, "ipc", "", header=header, **place))

    def _share(self, replica_id: str, tensors: list[tuple[int, torch.Tensor]], nbytes: int) -> dict[str, Any] | None:
        """The message's place in the consumer's ring (made on its first message), written and synchronized; None
        when it does not fit."""
        assert self.stream is not None, "CUDA IPC needs a CUDA device"
        ring = self._rings.get(replica_id)
        if ring is None:
            ring = self._rings[replica_id] = SharedRing(self.device, self.stream, self.ring_bytes)
        placed = ring.reserve(nbytes)
        if placed is None:
            return None
        seq, view = placed
        with torch.cuda.stream(self.stream):  # the tensors are complete (see RelayItem): no wait on other streams
            flatten(tensors, nbytes, self.device, out=view)
            self.stream.synchronize()
        self.shared += 1
        offset = view.data_ptr() - ring.buffer.data_ptr()
        return {"ring": (ring.ring_id, ring.handle, ring.memory.nbytes, seq, offset, nbytes)}

    def drop(self, replica_id: str) -> None:
        """The consumer went away: free its ring (after the sends already queued)."""
        self._worker.submit(self._rings.pop, replica_id, None)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


class IpcReceiver:
    """Consumer side: copies each message out of the producer's ring (on a side stream) and delivers it, in arrival
    order: on the loop's thread while nothing is queued, in a worker thread when a ring must be opened first (and
    whatever arrives behind it). Messages that arrive on the host path meanwhile (a producer on this GPU sends its
    small messages that way) wait behind them too. Rings stay open between messages."""

    def __init__(self, endpoint: RelayEndpoint, device: torch.device | str) -> None:
        self.endpoint = endpoint
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ipc-in")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rings: OrderedDict[str, Any] = OrderedDict()  # ring id -> the opened buffer, newest last
        # messages in arrival order, each a one-element list filled once it can be delivered (a host-path message at
        # once, an IPC one once copied out); delivered from the front while filled. Only the loop thread touches the
        # deque; the worker fills its slots, then asks the loop to deliver.
        self._slots: deque[list[RelayMessage | None]] = deque()
        self.received = 0
        endpoint.on_control(("ipc",), self.handle)
        endpoint.hold_back_with(self._behind)

    def handle(self, message: RelayMessage) -> None:
        control = message.control or {}
        self._loop = asyncio.get_running_loop()
        header, ring = control["header"], control.get("ring")
        header.arrived_at = message.arrived_at
        slot: list[RelayMessage | None] = [None]
        self._slots.append(slot)
        if (ring is None or ring[0] in self._rings) and len(self._slots) == 1:  # µs on an idle stream: no hop
            slot[0] = self._receive(header, ring)
            self._deliver_ready()
            return
        self._worker.submit(self._receive_into, slot, header, ring)

    def _behind(self, message: RelayMessage) -> bool:
        """An item message that came another way waits behind the IPC messages that arrived before it."""
        if not self._slots:
            return False
        self._slots.append([message])
        return True

    def _receive_into(self, slot: list[RelayMessage | None], header: RelayMessage, ring: tuple[Any, ...] | None) -> None:
        slot[0] = self._receive(header, ring)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver_ready)

    def _deliver_ready(self) -> None:
        """On the loop thread: deliver from the front, up to the first message not yet copied out."""
        while self._slots and (message := self._slots[0][0]) is not None:
            self._slots.popleft()
            try:
                self.endpoint.deliver_items(message)
            except Exception:  # a bad message must not hold up the ones behind it
                log.exception("relay delivery failed")

    def _receive(self, header: RelayMessage, ring: tuple[Any, ...] | None) -> RelayMessage:
        try:
            if ring is not None:
                buffer = self._copy_from_ring(*ring)
            else:
                buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            self.endpoint.hand_over(buffer)  # copied out on this receiver's stream, read on the consumer's
            message = unpack(header, buffer)
            self.received += 1
        except Exception as exc:  # the producer's memory could not be opened: fail these requests, keep serving
            log.warning("CUDA IPC relay from %s failed: %s", header.sender, exc)
            message = _failed(header, f"relay from {header.sender} failed: {exc}")
        return message

    def _open(self, handle: bytes, nbytes: int) -> Any:
        """The producer's ring, opened: an object whose `tensor` views it and whose `close` unmaps it."""
        return OpenedDeviceBuffer(handle, nbytes, self.device)

    def _copy_from_ring(
        self, ring_id: str, handle: bytes, ring_bytes: int, seq: int, offset: int, nbytes: int
    ) -> torch.Tensor:
        opened = self._rings.get(ring_id)
        if opened is None:
            opened = self._rings[ring_id] = self._open(handle, ring_bytes)
            while len(self._rings) > OPEN_RINGS:  # the least recently used producer's ring (its copies are done)
                self._rings.popitem(last=False)[1].close()
        self._rings.move_to_end(ring_id)
        shared = opened.tensor
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            buffer = shared[offset : offset + nbytes].clone()
            shared[:8].view(torch.int64).fill_(seq)  # after the copy, on the same stream: the space is free again
            if self.stream is not None:
                self.stream.synchronize()
        return buffer

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        for opened in self._rings.values():
            opened.close()
        self._rings.clear()
