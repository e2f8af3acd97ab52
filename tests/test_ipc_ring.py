"""The CUDA IPC ring's space bookkeeping (`RingSpace`): live messages never overlap, space comes back only up to
the consumer's acknowledgement, the ring wraps, and what does not fit is refused (it then goes in its own buffer)."""

from __future__ import annotations

import random

from omni_ray.relay.ipc import RingSpace


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
