"""CUDA IPC relay between processes on one GPU: a step's tensors go into device memory the consumer has opened once,
their place travels on the host path, and the consumer copies them out on the device, with no host round trip.

Framing is the collective relay's (`pack`/`unpack`: one flat buffer, a tensor-free header). Each producer keeps one
`SharedRing` per consumer: a device buffer whose IPC handle the consumer opens once and caches (opening a handle
costs about a millisecond, more than the host path's whole message). Messages are written at the ring's head on a
side stream, synchronized before their place leaves, and the consumer writes the sequence number of the last message
it copied out into the ring's first 8 bytes, on the device, so the producer reuses space only after the copy. A
message that does not fit (larger than half the ring, or a consumer that lags) goes in a buffer of its own, shared
once: torch keeps an IPC-shared block alive (its "limbo") until every consumer has released it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.collective import _control, _failed, flatten, pack, unpack
from omni_ray.relay.tcp import TcpTransport

log = logging.getLogger(__name__)

RING_BYTES = 64 << 20  # one ring per consumer; a message over half of it goes in a buffer of its own
ACK_BYTES = 256  # the ring's head: the consumer's last copied sequence number (int64), padded to the ring's alignment
COLLECT_EVERY = 256  # one-off buffers between `torch.cuda.ipc_collect()` calls (frees blocks consumers released)
OPEN_RINGS = 16  # rings a consumer keeps open (one per producer replica that sends to it)
_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument


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
    """Producer side of one consumer's ring: a device buffer, its IPC handle (made once), its space, and the stream
    that writes its messages."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream, capacity: int = RING_BYTES) -> None:
        self.ring_id = uuid.uuid4().hex
        self.stream = stream
        # Zeroed on the stream that writes the messages, so the first message lands after the zeros: on the thread's
        # default stream the fill is unordered with that stream's copies and can wipe a first message (on an H200 a
        # one-GPU pipeline's first frame of codes reached the vocoder as zeros, as a wiped first message gives).
        with torch.cuda.stream(stream):
            self.buffer = torch.zeros(ACK_BYTES + capacity, dtype=torch.uint8, device=device)
        self.space = RingSpace(capacity)
        self._ack_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        rebuild, args = reduce_tensor(self.buffer)
        assert rebuild is rebuild_cuda_tensor, "CUDA IPC needs a CUDA buffer"
        self.handle = tuple(args)

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
    """Producer side: `send(peer, message)` writes the step's tensors into the peer's ring (or one buffer of their
    own), place on the host path. Only for a peer on this process's GPU (same-process peers get the local hand-off).
    A message for a ring that exists goes in on the event loop's thread; making a ring, a buffer of its own, and
    any message behind one of those go through a worker thread (in order: one worker, and no message placed on the
    loop while it has work)."""

    def __init__(self, device: torch.device | str, control: TcpTransport, ring_bytes: int = RING_BYTES) -> None:
        self.device = torch.device(device)
        self.control = control
        self.ring_bytes = ring_bytes
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ipc")  # buffers in send order
        self._rings: dict[str, SharedRing] = {}  # consumer replica id -> its ring
        self._in_worker = 0  # shares handed to the worker and not back yet (event loop thread only)
        self.shared = 0  # messages sent
        self.unringed = 0  # of which in a buffer of their own
        self.inline = 0  # of which placed on the event loop's thread

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        header, tensors, nbytes = pack(message)
        place: dict[str, Any] = {}
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
        header.sent_at = time.time()
        await self.control.send(peer, _control(message.sender, "ipc", "", header=header, **place))

    def _share(self, replica_id: str, tensors: list[tuple[int, torch.Tensor]], nbytes: int) -> dict[str, Any]:
        assert self.stream is not None, "CUDA IPC needs a CUDA device"
        ring = self._rings.get(replica_id)
        if ring is None:
            ring = self._rings[replica_id] = SharedRing(self.device, self.stream, self.ring_bytes)
        placed = ring.reserve(nbytes)
        with torch.cuda.stream(self.stream):  # the tensors are complete (see RelayItem): no wait on other streams
            if placed is not None:
                flatten(tensors, nbytes, self.device, out=placed[1])
            else:
                buffer = flatten(tensors, nbytes, self.device)
            self.stream.synchronize()
        self.shared += 1
        if placed is not None:
            seq, view = placed
            return {"ring": (ring.ring_id, ring.handle, seq, view.storage_offset(), nbytes)}
        self.unringed += 1
        if self.unringed % COLLECT_EVERY == 0:
            torch.cuda.ipc_collect()
        rebuild, args = reduce_tensor(buffer)
        assert rebuild is rebuild_cuda_tensor, "CUDA IPC needs a CUDA buffer"
        return {"handle": tuple(args)}

    def drop(self, replica_id: str) -> None:
        """The consumer went away: free its ring (after the sends already queued)."""
        self._worker.submit(self._rings.pop, replica_id, None)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


class IpcReceiver:
    """Consumer side: copies each message out of the producer's memory (on a side stream) and delivers it, in
    arrival order: ring messages at once, one-off buffers (and whatever arrives behind them) in a worker thread.
    Messages that arrive on the host path meanwhile (a producer on this GPU sends its small messages that way) wait
    behind them too. Rings stay open between messages."""

    def __init__(self, endpoint: RelayEndpoint, device: torch.device | str) -> None:
        self.endpoint = endpoint
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ipc-in")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rings: OrderedDict[str, torch.Tensor] = OrderedDict()  # ring id -> the opened buffer, newest last
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
        header, ring, handle = control["header"], control.get("ring"), control.get("handle")
        header.arrived_at = message.arrived_at
        slot: list[RelayMessage | None] = [None]
        self._slots.append(slot)
        if handle is None and len(self._slots) == 1:  # a ring copy is µs on an idle stream: no thread hop
            slot[0] = self._receive(header, ring, None)
            self._deliver_ready()
            return
        self._worker.submit(self._receive_into, slot, header, ring, handle)

    def _behind(self, message: RelayMessage) -> bool:
        """An item message that came another way waits behind the IPC messages that arrived before it."""
        if not self._slots:
            return False
        self._slots.append([message])
        return True

    def _receive_into(
        self, slot: list[RelayMessage | None], header: RelayMessage, ring: tuple[Any, ...] | None,
        handle: tuple[Any, ...] | None,
    ) -> None:
        slot[0] = self._receive(header, ring, handle)
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

    def _receive(
        self, header: RelayMessage, ring: tuple[Any, ...] | None, handle: tuple[Any, ...] | None
    ) -> RelayMessage:
        try:
            if ring is not None:
                buffer = self._copy_from_ring(*ring)
            elif handle is not None:
                buffer = self._copy_out(handle)
            else:
                buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            self.endpoint.hand_over(buffer)  # copied out on this receiver's stream, read on the consumer's
            message = unpack(header, buffer)
            self.received += 1
        except Exception as exc:  # the producer's memory could not be opened: fail these requests, keep serving
            log.warning("CUDA IPC relay from %s failed: %s", header.sender, exc)
            message = _failed(header, f"relay from {header.sender} failed: {exc}")
        return message

    def _open(self, handle: tuple[Any, ...]) -> torch.Tensor:
        args = list(handle)
        args[_DEVICE_ARG] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return rebuild_cuda_tensor(*args)  # a view of the producer's buffer (same physical GPU)

    def _copy_from_ring(
        self, ring_id: str, handle: tuple[Any, ...], seq: int, offset: int, nbytes: int
    ) -> torch.Tensor:
        shared = self._rings.get(ring_id)
        if shared is None:
            shared = self._rings[ring_id] = self._open(handle)
            while len(self._rings) > OPEN_RINGS:
                self._rings.popitem(last=False)  # closes the least recently used producer's ring
        self._rings.move_to_end(ring_id)
        with torch.cuda.stream(self.stream):
            buffer = shared[offset : offset + nbytes].clone()
            shared[:8].view(torch.int64).fill_(seq)  # after the copy, on the same stream: the space is free again
            self.stream.synchronize()  # type: ignore[union-attr]
        return buffer

    def _copy_out(self, handle: tuple[Any, ...]) -> torch.Tensor:
        shared = self._open(handle)
        with torch.cuda.stream(self.stream):
            buffer = shared.clone()
            self.stream.synchronize()  # type: ignore[union-attr]
        del shared  # releases the producer's block
        return buffer

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._rings.clear()
