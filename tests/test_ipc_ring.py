"""The CUDA IPC relay's mechanisms that need no GPU: the ring's space bookkeeping (`RingSpace`: live messages never
overlap, space comes back only up to the consumer's acknowledgement, the ring wraps, what does not fit is refused)
and the receiver's ordering (ring copies skip the worker thread, but never overtake a message queued there behind a
ring being opened) and acknowledgement (the last copied message's number in the ring's first 8 bytes).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import torch

from omni_ray.relay import RelayEndpoint, RelayItem, RelayMessage
from omni_ray.relay.collective import _control, flatten, pack
from omni_ray.relay.ipc import ACK_BYTES, IpcReceiver, RingSpace


def _overlaps(records: list[tuple[int, int, int]]) -> bool:
    spans = sorted((start, end) for _, start, end in records)
    return any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_messages_fill_the_ring_then_wait_for_the_consumer() -> None:
    space = RingSpace(capacity=1024, align=64)
    assert space.reserve(100) == (1, 0)  # rounded up to 128
    assert space.reserve(64) == (2, 128)
    assert space.reserve(513) is None  # over half the ring: a buffer of its own
    assert space.reserve(384) == (3, 192)
    assert space.reserve(384) == (4, 576)
    assert space.reserve(128) is None  # 960..1024 is too small and 0..128 is still unread
    space.release(1)  # the consumer copied message 1 out: 0..128 is free again
    assert space.reserve(128) == (5, 0)  # wrapped
    assert space.reserve(64) is None  # wrapped: free is only [head, oldest) = [128, 128)
    space.release(5)
    assert not space.records and space.reserve(512) == (6, 0)  # empty: back to the start


def test_random_traffic_never_overlaps_live_messages_and_keeps_order() -> None:
    rng = random.Random(0)
    space = RingSpace(capacity=1 << 16, align=256)
    acked, refused = 0, 0
    for _ in range(5000):
        placed = space.reserve(rng.randint(1, 20000))
        if placed is None:
            refused += 1
        else:
            assert placed[0] == space.records[-1][0]
            assert 0 <= placed[1] and space.records[-1][2] <= space.capacity
        assert not _overlaps(list(space.records))
        assert [seq for seq, _, _ in space.records] == sorted(seq for seq, _, _ in space.records)
        if rng.random() < 0.4 and space.records:  # the consumer catches up to some message
            acked = rng.choice(list(space.records))[0]
            space.release(acked)
            assert all(seq > acked for seq, _, _ in space.records)
    assert 0 < refused < 5000 and space.seq > 2000


class _FakeRing:
    """A producer's ring as the receiver sees it once opened, in host memory: messages at their offsets."""

    def __init__(self, messages: list[torch.Tensor]) -> None:
        self.offsets = [ACK_BYTES + sum(m.numel() for m in messages[:i]) for i in range(len(messages))]
        self.tensor = torch.zeros(ACK_BYTES + sum(m.numel() for m in messages), dtype=torch.uint8)
        for offset, message in zip(self.offsets, messages):
            self.tensor[offset : offset + message.numel()] = message
        self.closed = False

    def acknowledged(self) -> int:
        return int(self.tensor[:8].view(torch.int64).item())

    def close(self) -> None:
        self.closed = True


def _ring_messages(count: int) -> tuple[list[tuple[RelayMessage, int]], _FakeRing]:
    """`count` one-item messages (item i holds [i, i, i]) packed as a ring holds them: (header, bytes) each."""
    packed = []
    for seq in range(count):
        item = RelayItem("r", tensors={"x": torch.full((3,), seq)}, seq=seq)
        header, tensors, nbytes = pack(RelayMessage("p", [item]))
        packed.append((header, flatten(tensors, nbytes, torch.device("cpu"))))
    ring = _FakeRing([buffer for _, buffer in packed])
    return [(header, buffer.numel()) for header, buffer in packed], ring


def _slow_open(ring: _FakeRing, opened: list[float]) -> Any:
    def open_ring(handle: bytes, nbytes: int) -> _FakeRing:
        assert handle == b"h" * 64 and nbytes == ring.tensor.numel()
        time.sleep(0.3)  # opening a handle is slow: a worker thread does it
        opened.append(time.monotonic())
        return ring
    return open_ring


def test_receiver_delivers_in_arrival_order_behind_a_ring_being_opened() -> None:
    """Message 0 is the ring's first: the worker thread opens it (slow) and copies it out; messages 1-2 arrive
    meanwhile and queue behind it in the worker; message 3 comes once all is done and is copied on the loop's thread.
    Each copy acknowledges its message's number in the ring's first 8 bytes; the ring is opened once."""

    async def main() -> tuple[list[RelayItem], _FakeRing, list[float]]:
        endpoint = RelayEndpoint()
        receiver = IpcReceiver(endpoint, "cpu")
        messages, ring = _ring_messages(4)
        opened: list[float] = []
        receiver._open = _slow_open(ring, opened)  # type: ignore[method-assign]
        got: list[RelayItem] = []
        endpoint.claim("r", got.append)
        for seq, (header, nbytes) in enumerate(messages):
            place = {"ring": ("ring", b"h" * 64, ring.tensor.numel(), seq, ring.offsets[seq], nbytes)}
            endpoint.deliver(_control("p", "ipc", "", header=header, **place))
            if seq == 2:
                await asyncio.sleep(0.5)  # the worker is done: message 3 is copied inline
                assert ring.acknowledged() == 2
        assert len(got) == 4  # the last was copied and delivered at once
        return got, ring, opened

    got, ring, opened = asyncio.run(main())
    assert [item.seq for item in got] == [0, 1, 2, 3]
    assert [item.tensors["x"].tolist() for item in got] == [[seq] * 3 for seq in range(4)]
    assert ring.acknowledged() == 3 and len(opened) == 1


def test_host_path_messages_wait_behind_ipc_messages_still_being_copied_out() -> None:
    """One producer on this GPU sends small steps on the host path and large ones through CUDA IPC: a host-path
    message that arrives while an IPC message ahead of it is still being copied out (its ring being opened, in the
    worker) is delivered after it; with nothing being copied out, at once."""

    async def main() -> tuple[list[int], list[int]]:
        endpoint = RelayEndpoint()
        receiver = IpcReceiver(endpoint, "cpu")
        messages, ring = _ring_messages(2)
        receiver._open = _slow_open(ring, [])  # type: ignore[method-assign]
        got: list[RelayItem] = []
        endpoint.claim("r", got.append)
        endpoint.deliver(RelayMessage("p", [RelayItem("r", tensors={"x": torch.zeros(2)}, seq=0)]))
        at_once = [i.seq for i in got]  # nothing was being copied out
        header, nbytes = messages[1]  # item seq 1
        endpoint.deliver(_control("p", "ipc", "", header=header, ring=("ring", b"h" * 64, ring.tensor.numel(), 1,
                                                                        ring.offsets[1], nbytes)))
        endpoint.deliver(RelayMessage("p", [RelayItem("r", seq=2), RelayItem("r", kind="end", seq=3)]))
        assert [i.seq for i in got] == [0]  # held behind message 1
        for _ in range(100):
            if len(got) == 4:
                break
            await asyncio.sleep(0.02)
        return at_once, [i.seq for i in got]

    at_once, order = asyncio.run(main())
    assert at_once == [0]
    assert order == [0, 1, 2, 3]


def test_a_receiver_keeps_a_bounded_number_of_rings_open() -> None:
    """Past OPEN_RINGS producers' rings, the least recently used one is closed (its copies are done)."""
    from omni_ray.relay import ipc

    async def main() -> list[_FakeRing]:
        endpoint = RelayEndpoint()
        receiver = IpcReceiver(endpoint, "cpu")
        endpoint.claim("r", lambda item: None)
        rings = []
        for producer in range(ipc.OPEN_RINGS + 2):
            messages, ring = _ring_messages(1)
            rings.append(ring)
            receiver._open = lambda handle, nbytes, ring=ring: ring  # type: ignore[method-assign]
            header, nbytes = messages[0]
            receiver._copy_from_ring(f"ring{producer}", b"h" * 64, ring.tensor.numel(), 0, ring.offsets[0], nbytes)
        return rings

    rings = asyncio.run(main())
    assert [ring.closed for ring in rings] == [True, True] + [False] * ipc.OPEN_RINGS
