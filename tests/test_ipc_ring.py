"""The CUDA IPC relay's mechanisms that need no GPU: the ring's space bookkeeping (`RingSpace`: live messages never
overlap, space comes back only up to the consumer's acknowledgement, the ring wraps, what does not fit is refused)
and the receiver's ordering (ring copies skip the worker thread, but never overtake a one-off buffer ahead of them).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import torch

from omni_ray.relay import RelayEndpoint, RelayItem, RelayMessage
from omni_ray.relay.collective import _control, flatten, pack
from omni_ray.relay.ipc import IpcReceiver, RingSpace


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


def test_receiver_delivers_in_arrival_order_behind_a_slow_one_off_buffer() -> None:
    """Message 0 comes in a one-off buffer (opening its handle is slow, so a worker thread does it); messages 1-3
    come through the ring, which is copied on the loop thread only while nothing is queued in the worker. The
    device copies are replaced by the flattened bytes (this test is about order, not CUDA)."""

    async def main() -> list[RelayItem]:
        endpoint = RelayEndpoint()
        receiver = IpcReceiver(endpoint, "cpu")
        buffers: dict[int, torch.Tensor] = {}

        def one_off(handle: tuple[Any, ...]) -> torch.Tensor:
            time.sleep(0.3)
            return buffers[handle[0]]

        receiver._copy_out = one_off  # type: ignore[method-assign]
        receiver._copy_from_ring = lambda ring_id, handle, seq, off, size: buffers[seq]  # type: ignore[method-assign]
        got: list[RelayItem] = []
        endpoint.claim("r", got.append)
        for seq in range(4):
            item = RelayItem("r", tensors={"x": torch.full((3,), seq)}, seq=seq)
            header, tensors, nbytes = pack(RelayMessage("p", [item]))
            buffers[seq] = flatten(tensors, nbytes, torch.device("cpu"))
            place = {"handle": (seq,)} if seq == 0 else {"ring": ("ring", (), seq, 0, nbytes)}
            endpoint.deliver(_control("p", "ipc", "", header=header, **place))
            if seq == 2:
                await asyncio.sleep(0.5)  # the worker is done: message 3 is copied inline
        for _ in range(100):
            if len(got) == 4:
                break
            await asyncio.sleep(0.02)
        return got

    got = asyncio.run(main())
    assert [item.seq for item in got] == [0, 1, 2, 3]
    assert [item.tensors["x"].tolist() for item in got] == [[seq] * 3 for seq in range(4)]


def test_host_path_messages_wait_behind_ipc_messages_still_being_copied_out() -> None:
    """One producer on this GPU sends small steps on the host path and large ones through CUDA IPC: a host-path
    message that arrives while an IPC message ahead of it is still being copied out (a one-off buffer, in the
    worker) is delivered after it; with nothing being copied out, at once."""

    async def main() -> tuple[list[int], list[int]]:
        endpoint = RelayEndpoint()
        receiver = IpcReceiver(endpoint, "cpu")
        item = RelayItem("r", tensors={"x": torch.arange(4)}, seq=1)
        header, tensors, nbytes = pack(RelayMessage("p", [item]))
        buffer = flatten(tensors, nbytes, torch.device("cpu"))

        def one_off(handle: tuple[Any, ...]) -> torch.Tensor:
            time.sleep(0.3)
            return buffer

        receiver._copy_out = one_off  # type: ignore[method-assign]
        got: list[RelayItem] = []
        endpoint.claim("r", got.append)
        endpoint.deliver(RelayMessage("p", [RelayItem("r", tensors={"x": torch.zeros(2)}, seq=0)]))
        at_once = [i.seq for i in got]  # nothing was being copied out
        endpoint.deliver(_control("p", "ipc", "", header=header, handle=(1,)))
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
