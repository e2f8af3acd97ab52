"""Unit tests of the relay: receiving endpoint (buffer, claim, order, release), sender queues, transports."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import numpy as np
import pytest
import torch

from omni_ray.relay import (
    LOCAL_ENDPOINTS,
    LocalTransport,
    PlacementTransport,
    RelayEndpoint,
    RelayItem,
    RelayMessage,
    RelayPeer,
    RelaySender,
    RelayServer,
    TcpTransport,
)


def _item(rid: str, seq: int, value: float = 0.0, kind: str = "data") -> RelayItem:
    return RelayItem(rid, kind=kind, tensors={"x": torch.tensor([value])}, meta={"v": value}, seq=seq)


async def _until(cond: Callable[[], bool], timeout: float = 1.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


# ---- RelayEndpoint --------------------------------------------------------------------------------------------
def test_endpoint_buffers_until_claim_then_delivers_in_order() -> None:
    ep = RelayEndpoint()
    ep.deliver(RelayMessage("p", [_item("a", 0, 1.0), _item("b", 0, 10.0)]))
    ep.deliver(RelayMessage("p", [_item("a", 1, 2.0)]))
    assert ep.stats() == {"claimed": 0, "buffered": 2}

    got_a: list[RelayItem] = []
    ep.claim("a", got_a.append)
    assert [i.meta["v"] for i in got_a] == [1.0, 2.0]
    assert [i.seq for i in got_a] == [0, 1]
    assert ep.stats() == {"claimed": 1, "buffered": 1}

    ep.deliver(RelayMessage("p", [_item("a", 2, 3.0), _item("b", 1, 11.0)]))
    assert [i.meta["v"] for i in got_a] == [1.0, 2.0, 3.0]  # claimed: handed over at once

    got_b: list[RelayItem] = []
    ep.claim("b", got_b.append)
    assert [i.meta["v"] for i in got_b] == [10.0, 11.0]
    assert torch.equal(got_b[1].tensors["x"], torch.tensor([11.0]))
    assert ep.stats() == {"claimed": 2, "buffered": 0}


def test_endpoint_claim_before_any_item() -> None:
    ep = RelayEndpoint()
    got: list[RelayItem] = []
    ep.claim("a", got.append)
    assert got == []
    ep.deliver(RelayMessage("p", [_item("a", 0, 1.0)]))
    ep.deliver(RelayMessage("p", [_item("a", 1, 2.0, kind="end")]))
    assert [(i.meta["v"], i.kind) for i in got] == [(1.0, "data"), (2.0, "end")]


def test_endpoint_drops_items_of_released_requests() -> None:
    ep = RelayEndpoint()
    got: list[RelayItem] = []
    ep.claim("a", got.append)
    ep.deliver(RelayMessage("p", [_item("a", 0)]))
    ep.release("a")
    # late items (any seq, even one that would be out of order) are dropped silently; other requests unaffected
    ep.deliver(RelayMessage("p", [_item("a", 1), _item("a", 7), _item("b", 0, 5.0)]))
    assert len(got) == 1
    assert ep.stats() == {"claimed": 0, "buffered": 1}

    # released before anything arrived (e.g. aborted early): nothing is buffered for it
    ep.release("c")
    ep.deliver(RelayMessage("p", [_item("c", 0), _item("c", 1)]))
    assert ep.stats() == {"claimed": 0, "buffered": 1}

    # released while items were still buffered: they are discarded
    ep.release("b")
    assert ep.stats() == {"claimed": 0, "buffered": 0}
    late: list[RelayItem] = []
    ep.claim("b", late.append)
    assert late == []


def test_endpoint_forgets_old_closed_requests() -> None:
    ep = RelayEndpoint(remember_closed=2)
    for rid in ("a", "b", "c"):
        ep.release(rid)
    ep.deliver(RelayMessage("p", [_item("c", 0), _item("b", 0)]))
    assert ep.stats()["buffered"] == 0
    ep.deliver(RelayMessage("p", [_item("a", 0)]))  # "a" fell out of the closed set
    assert ep.stats()["buffered"] == 1


@pytest.mark.parametrize("seqs", [[1], [0, 2], [0, 1, 1], [0, 0]])
def test_endpoint_out_of_order_seq_raises(seqs: list[int]) -> None:
    ep = RelayEndpoint()
    with pytest.raises(RuntimeError, match="order"):
        for s in seqs:
            ep.deliver(RelayMessage("p", [_item("a", s)]))


def test_endpoint_sequences_are_per_request() -> None:
    ep = RelayEndpoint()
    ep.deliver(RelayMessage("p", [_item("a", 0), _item("b", 0), _item("a", 1), _item("c", 0), _item("b", 1)]))
    assert ep.stats()["buffered"] == 3


# ---- RelaySender ------------------------------------------------------------------------------------------------
class RecordingTransport:
    """Records every message per peer; optionally slow, blocked or failing for some peers."""

    def __init__(self) -> None:
        self.sent: dict[str, list[RelayMessage]] = {}
        self.fail: set[str] = set()
        self.block: dict[str, asyncio.Event] = {}
        self.delays: dict[str, list[float]] = {}

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        if peer.replica_id in self.block:
            await self.block[peer.replica_id].wait()
        delays = self.delays.get(peer.replica_id)
        if delays:
            await asyncio.sleep(delays.pop(0))
        if peer.replica_id in self.fail:
            raise ConnectionError(f"{peer.replica_id} is gone")
        # snapshot: the sender must not mutate a message after handing it over
        items = [RelayItem(i.request_id, i.kind, dict(i.tensors), dict(i.meta), i.seq) for i in message.items]
        self.sent.setdefault(peer.replica_id, []).append(RelayMessage(message.sender, items))


def _failures() -> tuple[list[tuple[list[str], Exception]], Callable[[list[str], Exception], None]]:
    calls: list[tuple[list[str], Exception]] = []
    return calls, lambda ids, exc: calls.append((list(ids), exc))


def test_sender_batches_one_send_into_one_message_with_per_request_seqs() -> None:
    async def main() -> None:
        transport = RecordingTransport()
        failures, on_failure = _failures()
        sender = RelaySender("producer-1", transport, on_failure)
        peer = RelayPeer("c1", "fake://c1")
        sender.send(peer, [RelayItem("a"), RelayItem("b")])
        sender.send(peer, [RelayItem("a"), RelayItem("a"), RelayItem("c")])
        sender.send(peer, [RelayItem("b", kind="end"), RelayItem("a")])
        await _until(lambda: len(transport.sent.get("c1", [])) == 3)
        messages = transport.sent["c1"]
        assert all(m.sender == "producer-1" for m in messages)
        assert [[(i.request_id, i.seq) for i in m.items] for m in messages] == [
            [("a", 0), ("b", 0)],
            [("a", 1), ("a", 2), ("c", 0)],
            [("b", 1), ("a", 3)],
        ]
        assert messages[2].items[0].kind == "end"
        assert failures == []

    asyncio.run(main())


def test_sender_restarts_numbering_after_end_or_forget() -> None:
    async def main() -> None:
        transport = RecordingTransport()
        sender = RelaySender("p", transport, _failures()[1])
        peer = RelayPeer("c1", "fake://c1")
        sender.send(peer, [RelayItem("a"), RelayItem("a", kind="end")])
        sender.send(peer, [RelayItem("a")])  # a reused id starts over
        sender.send(peer, [RelayItem("b"), RelayItem("b")])
        sender.forget("b")
        sender.send(peer, [RelayItem("b")])
        await _until(lambda: len(transport.sent.get("c1", [])) == 4)
        seqs = [[(i.request_id, i.seq) for i in m.items] for m in transport.sent["c1"]]
        assert seqs == [[("a", 0), ("a", 1)], [("a", 0)], [("b", 0), ("b", 1)], [("b", 0)]]

    asyncio.run(main())


def test_sender_keeps_order_per_peer_and_peers_are_independent() -> None:
    async def main() -> None:
        transport = RecordingTransport()
        # first messages to c1 are slow: later ones must still arrive after them
        transport.delays["c1"] = [0.02, 0.01, 0.0]
        transport.block["c2"] = asyncio.Event()  # c2 is stuck
        sender = RelaySender("p", transport, _failures()[1])
        c1, c2 = RelayPeer("c1", "fake://c1"), RelayPeer("c2", "fake://c2")
        for n in range(5):
            sender.send(c2, [RelayItem("y", meta={"n": n})])
            sender.send(c1, [RelayItem("x", meta={"n": n})])
        await _until(lambda: len(transport.sent.get("c1", [])) == 5)
        assert [m.items[0].meta["n"] for m in transport.sent["c1"]] == [0, 1, 2, 3, 4]
        assert [m.items[0].seq for m in transport.sent["c1"]] == [0, 1, 2, 3, 4]
        assert "c2" not in transport.sent  # stuck peer did not hold c1 up
        transport.block["c2"].set()
        await _until(lambda: len(transport.sent.get("c2", [])) == 5)
        assert [m.items[0].meta["n"] for m in transport.sent["c2"]] == [0, 1, 2, 3, 4]

    asyncio.run(main())


def test_sender_reports_failed_message_ids_and_other_peers_keep_working() -> None:
    async def main() -> None:
        transport = RecordingTransport()
        transport.fail.add("bad")
        failures, on_failure = _failures()
        sender = RelaySender("p", transport, on_failure)
        bad, good = RelayPeer("bad", "fake://bad"), RelayPeer("good", "fake://good")
        sender.send(bad, [RelayItem("r1"), RelayItem("r2")])
        sender.send(good, [RelayItem("r3")])
        await _until(lambda: len(failures) == 1 and len(transport.sent.get("good", [])) == 1)
        assert failures[0][0] == ["r1", "r2"]
        assert isinstance(failures[0][1], ConnectionError)
        # the pump of the failed peer survives: a later message is tried (and reported) on its own
        sender.send(bad, [RelayItem("r4")])
        sender.send(good, [RelayItem("r3"), RelayItem("r5")])
        await _until(lambda: len(failures) == 2 and len(transport.sent.get("good", [])) == 2)
        assert failures[1][0] == ["r4"]
        assert [(i.request_id, i.seq) for i in transport.sent["good"][1].items] == [("r3", 1), ("r5", 0)]
        # once the peer is back, it is used again
        transport.fail.discard("bad")
        sender.send(bad, [RelayItem("r6")])
        await _until(lambda: len(transport.sent.get("bad", [])) == 1)
        assert len(failures) == 2

    asyncio.run(main())


def test_sender_to_endpoints_over_local_transport() -> None:
    async def main() -> None:
        ep1, ep2 = RelayEndpoint(), RelayEndpoint()
        LOCAL_ENDPOINTS.update({"c1": ep1, "c2": ep2})
        sender = RelaySender("p", LocalTransport(), _failures()[1])
        p1, p2 = RelayPeer("c1", "local"), RelayPeer("c2", "local")
        for n in range(3):
            sender.send(p1, [RelayItem("a", tensors={"t": torch.tensor([n])}), RelayItem("b", meta={"n": n})])
            sender.send(p2, [RelayItem("c", meta={"n": n})])
        sender.send(p1, [RelayItem("a", kind="end")])
        got: dict[str, list[RelayItem]] = {"a": [], "b": [], "c": []}
        ep1.claim("a", got["a"].append)
        await _until(lambda: len(got["a"]) == 4)
        ep1.claim("b", got["b"].append)
        ep2.claim("c", got["c"].append)
        await _until(lambda: len(got["c"]) == 3)
        assert [int(i.tensors["t"]) for i in got["a"][:3]] == [0, 1, 2]
        assert got["a"][3].kind == "end"
        assert [i.meta["n"] for i in got["b"]] == [0, 1, 2]
        assert [i.meta["n"] for i in got["c"]] == [0, 1, 2]
        assert ep1.stats() == {"claimed": 2, "buffered": 0}

    try:
        asyncio.run(main())
    finally:
        LOCAL_ENDPOINTS.pop("c1", None)
        LOCAL_ENDPOINTS.pop("c2", None)


# ---- transports ------------------------------------------------------------------------------------------------
def test_placement_transport_picks_local_for_an_in_process_peer_and_tcp_otherwise() -> None:
    transport = PlacementTransport()
    LOCAL_ENDPOINTS["here"] = RelayEndpoint()
    try:
        assert transport.select(RelayPeer("here", "tcp://127.0.0.1:1")) is transport.local
        assert transport.select(RelayPeer("elsewhere", "tcp://127.0.0.1:1")) is transport.tcp
    finally:
        LOCAL_ENDPOINTS.pop("here")


class _Recording:
    def __init__(self) -> None:
        self.sent: list[RelayMessage] = []

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        self.sent.append(message)


@pytest.mark.parametrize("mode", ["auto", "ipc"])
def test_between_processes_on_one_gpu_small_messages_take_the_host_path_and_large_ones_cuda_ipc(mode: str) -> None:
    """`auto`: a step's message under `ipc_from_bytes` of device tensors is copied to the CPU and sent on the host
    path, a larger one goes through CUDA IPC, as does nothing else; `ipc`: every message to a peer on this GPU goes
    through CUDA IPC. (The GPU and the two transports are stand-ins: this is the choice alone.)"""
    transport = PlacementTransport("cpu", mode, ipc_from_bytes=1024)  # type: ignore[arg-type]
    transport.gpu_uuid = "GPU-same"
    transport.ipc, transport.tcp = _Recording(), _Recording()  # type: ignore[assignment]
    same_gpu, other_gpu = RelayPeer("p", "tcp://127.0.0.1:1", "cuda:0", "GPU-same"), RelayPeer("q", "", "cuda:0", "GPU-2")
    assert transport.select(same_gpu) is transport.ipc and transport.select(other_gpu) is transport.collective
    assert transport.needs_host_tensors(same_gpu, 1023) == (mode == "auto")
    assert not transport.needs_host_tensors(same_gpu, 1024) and not transport.needs_host_tensors(other_gpu, 0)
    on_device = torch.zeros(300, device="meta")  # 1,200 bytes off the CPU
    small = RelayMessage("s", [RelayItem("r", tensors={"x": torch.zeros(3)}), RelayItem("r", kind="end")])
    large = RelayMessage("s", [RelayItem("r", tensors={"x": on_device, "ids": torch.arange(2)})])
    for message in (small, large):
        asyncio.run(transport.send(same_gpu, message))
    assert transport.ipc.sent == ([large] if mode == "auto" else [small, large])  # type: ignore[attr-defined]
    assert transport.tcp.sent == ([small] if mode == "auto" else [])  # type: ignore[attr-defined]


async def _tcp_link(*requests: str) -> tuple[RelayServer, RelayPeer, RelaySender, list[RelayItem]]:
    """A host-path link on this machine: the consumer's server and address, a producer's sender, and the list the
    consumer's items for `requests` go to."""
    endpoint = RelayEndpoint()
    server = RelayServer(endpoint)
    peer = RelayPeer("consumer", await server.start("127.0.0.1"))
    got: list[RelayItem] = []
    for request in requests:
        endpoint.claim(request, got.append)
    return server, peer, RelaySender("producer", TcpTransport(), _failures()[1]), got


def test_tcp_relay_is_ordered_and_bitwise_exact() -> None:
    async def main() -> None:
        server, peer, sender, got = await _tcp_link("a")
        sent = [torch.randn(3, 5, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
        for tensor in sent:
            sender.send(peer, [RelayItem("a", tensors={"x": tensor, "ids": torch.arange(7)})])
        sender.send(peer, [RelayItem("a", kind="end", meta={"finish_reason": "stop"})])
        await _until(lambda: len(got) == 4, timeout=5)
        for item, tensor in zip(got, sent):
            assert item.tensors["x"].dtype == tensor.dtype and torch.equal(item.tensors["x"], tensor)
        assert got[-1].kind == "end" and got[-1].meta == {"finish_reason": "stop"}
        await server.close()

    asyncio.run(main())


def test_a_requests_first_item_says_when_its_message_was_queued_sent_and_read() -> None:
    """Over the host path the first item of each request carries its message's way (queued by the producer's sender,
    sent, read by the consumer's transport), in order and within the test's span; later items carry nothing."""
    async def main() -> None:
        server, peer, sender, got = await _tcp_link("a", "b")
        before = time.time()
        sender.send(peer, [RelayItem("a", tensors={"x": torch.ones(4)}), RelayItem("a")])
        await _until(lambda: len(got) == 2, timeout=5)
        sender.send(peer, [RelayItem("a"), RelayItem("b")])
        await _until(lambda: len(got) == 4, timeout=5)
        after = time.time()
        first_a, second_a, third_a, first_b = got
        for first in (first_a, first_b):
            queued, sent, arrived = first.meta["relay_times"]
            assert before <= queued <= sent <= arrived <= after
        assert first_a.meta["relay_times"][0] < first_b.meta["relay_times"][0]  # each its own message's
        assert "relay_times" not in second_a.meta and "relay_times" not in third_a.meta
        await server.close()

    asyncio.run(main())


def test_tcp_relay_carries_large_and_small_tensors_of_one_message_bitwise() -> None:
    """A message mixing tensors of megabytes (sent from their own memory) with small ones (joined into one send)."""
    async def main() -> None:
        server, peer, sender, got = await _tcp_link("a")
        g = torch.Generator().manual_seed(1)
        tensors = {"big": torch.randn(1_300_000, generator=g).to(torch.bfloat16), "ids": torch.arange(7),
                   "states": torch.randn(100, 2048, generator=g), "mask": torch.rand(33, generator=g) > 0.5}
        for _ in range(3):
            sender.send(peer, [RelayItem("a", tensors=tensors)])
        await _until(lambda: len(got) == 3, timeout=10)
        for item in got:
            assert all(torch.equal(item.tensors[k], v) and item.tensors[k].dtype == v.dtype for k, v in tensors.items())
        await server.close()

    asyncio.run(main())


def test_host_path_encoding_keeps_every_tensor_bitwise_and_pickles_none() -> None:
    """Tensors cross the host path as dtype, shape and raw bytes in a msgpack frame (no pickle at all): every dtype a
    stage relays, empty, zero-dimensional and strided tensors come back equal, and control messages pass unchanged."""
    import msgpack

    from omni_ray.relay.tcp import decode_message, encode_message

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    tensors = {
        "f32": base, "bf16": base.to(torch.bfloat16), "f16": base.to(torch.float16), "ids": torch.arange(7),
        "mask": base > 0, "empty": torch.zeros(0, 4), "scalar": base[1, 2], "strided": base.t()[::2],
    }
    message = RelayMessage("p", [RelayItem("a", tensors=tensors, meta={"n": 1}, seq=4), RelayItem("a", kind="end")])
    parts = encode_message(message)
    payload = b"".join(bytes(part) for part in parts)
    assert b"torch._utils" not in payload and b"_rebuild_tensor" not in payload  # no tensor went through torch's pickling
    sent_from = {np.frombuffer(part, dtype=np.uint8).ctypes.data for part in parts[2:] if memoryview(part).nbytes}
    assert base.data_ptr() in sent_from  # a contiguous tensor's bytes go to the socket as a view of it, not a copy
    frame = bytearray(payload)
    got = decode_message(frame)
    start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    for tensor in got.items[0].tensors.values():  # views of the frame, each aligned for its dtype
        if tensor.numel():
            assert start <= tensor.data_ptr() < start + len(frame) and (tensor.data_ptr() - start) % 64 == 0
    assert [(i.request_id, i.kind, i.seq, i.meta) for i in got.items] == [("a", "data", 4, {"n": 1}), ("a", "end", -1, {})]
    for name, tensor in tensors.items():
        back = got.items[0].tensors[name]
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor), name
    control = RelayMessage("c", [], control={"op": "consumer", "request": "a", "peer": RelayPeer("x", "tcp://h:1")})
    assert decode_message(b"".join(bytes(part) for part in encode_message(control))) == control
    body = msgpack.unpackb(parts[1], strict_map_key=False)  # plain msgpack: fields, names and buffer references
    assert body[0] == "p" and body[1][0][2]["f32"] == [0, "float32", [4, 6]]


def test_links_name_a_producers_consumer_over_the_host_path() -> None:
    """What the caller sends once both streams are open reaches the producer replica's control handler, naming the
    request and its consumer; a producer that is gone fails the call instead of leaving the request waiting."""
    from omni_ray.relay import RelayLinks

    async def main() -> None:
        endpoint = RelayEndpoint()
        named: list[dict[str, object]] = []
        endpoint.on_control(("consumer",), lambda message: named.append(dict(message.control or {})))
        server = RelayServer(endpoint)
        producer = RelayPeer("thinker-1", await server.start("127.0.0.1"))
        consumer = RelayPeer("talker-1", "tcp://127.0.0.1:9")
        links = RelayLinks()
        await links.connect(producer, consumer, "req")
        await _until(lambda: bool(named), timeout=5)
        assert named == [{"op": "consumer", "request": "req", "peer": consumer}]
        await server.close()
        gone = RelayServer(RelayEndpoint())
        gone_peer = RelayPeer("gone", await gone.start("127.0.0.1"))
        await gone.close()
        with pytest.raises(OSError):
            await links.connect(gone_peer, consumer, "req2")

    asyncio.run(main())


def test_tcp_send_to_a_dead_peer_fails_only_its_requests() -> None:
    async def main() -> None:
        alive_endpoint, dead_endpoint = RelayEndpoint(), RelayEndpoint()
        alive, dead = RelayServer(alive_endpoint), RelayServer(dead_endpoint)
        alive_peer = RelayPeer("alive", await alive.start("127.0.0.1"))
        dead_peer = RelayPeer("dead", await dead.start("127.0.0.1"))
        await dead.close()  # the replica went away
        failed, on_failure = _failures()
        sender = RelaySender("producer", TcpTransport(), on_failure)
        sender.send(dead_peer, [RelayItem("r1"), RelayItem("r2")])
        sender.send(alive_peer, [RelayItem("r3")])
        got: list[RelayItem] = []
        alive_endpoint.claim("r3", got.append)
        await _until(lambda: bool(failed) and bool(got), timeout=5)
        assert sorted(rid for ids, _ in failed for rid in ids) == ["r1", "r2"]
        assert all(str(exc).startswith("relay peer dead could not be reached (") for _, exc in failed), failed
        await alive.close()

    asyncio.run(main())


def test_endpoint_drops_items_nobody_claims_after_the_ttl() -> None:
    endpoint = RelayEndpoint(unclaimed_ttl_s=0.05)
    endpoint.deliver(RelayMessage("p", [_item("orphan", 0)]))
    assert endpoint.stats()["buffered"] == 1
    import time

    time.sleep(0.08)
    endpoint.deliver(RelayMessage("p", [_item("fresh", 0)]))  # any later delivery sweeps expired buffers
    assert endpoint.stats()["buffered"] == 1
    got: list[RelayItem] = []
    endpoint.claim("orphan", got.append)
    assert got == []


def test_a_lost_peer_fails_exactly_its_open_requests() -> None:
    class StuckTransport:
        """Never completes a send: what happens on loss must not depend on sends finishing."""

        on_peer_lost: Any = None

        async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
            await asyncio.Event().wait()

    async def main() -> None:
        failed, on_failure = _failures()
        transport = StuckTransport()
        sender = RelaySender("producer", transport, on_failure)
        gone, other = RelayPeer("gone", "tcp://127.0.0.1:1"), RelayPeer("other", "tcp://127.0.0.1:1")
        sender.send(gone, [RelayItem("r1"), RelayItem("r2")])
        sender.send(gone, [RelayItem("r2", kind="end")])  # r2 is complete there
        sender.send(other, [RelayItem("r3")])
        transport.on_peer_lost(gone, ConnectionError("went away"))
        assert [(sorted(ids), str(exc)) for ids, exc in failed] == [(["r1"], "went away")]
        transport.on_peer_lost(gone, ConnectionError("went away"))  # nothing is open there any more
        assert len(failed) == 1

    asyncio.run(main())


def test_a_steps_host_copy_takes_one_copy_per_storage_and_cuts_each_view_out_whole() -> None:
    """`copy_by_storage` (the relay's device-to-host copy; here on CPU tensors): rows, a column and a transposed block
    of one batch tensor, byte sizes that leave the next span unaligned, an empty view, and two far-apart slices of a
    large storage. Every copy equals its view, with its strides, and outlives the staging buffer's reuse; one wait;
    the batch's views share one span, the far-apart slices get one each rather than the 4 MiB between them."""
    from omni_ray.stages.base import copy_by_storage

    batch = torch.randn(8, 6)
    odd = torch.arange(7, dtype=torch.uint8)
    large = torch.randn(1 << 20)
    found = [batch[1], batch[3], batch[:, 2], batch.T[1:3], odd[2:5], batch[2:2], large[:3], large[-5:],
             torch.ones(3, dtype=torch.bfloat16), batch[5:7] > 0]
    buffers: list[torch.Tensor] = []
    waits: list[int] = []

    def host_bytes(count: int) -> torch.Tensor:
        buffers.append(torch.full((count,), 255, dtype=torch.uint8))
        return buffers[-1]

    copies = copy_by_storage(found, host_bytes, lambda: waits.append(1))
    for view, copy in zip(found, copies):
        assert copy.dtype == view.dtype and copy.shape == view.shape and torch.equal(copy, view)
        assert copy.stride() == view.stride()
        assert copy.untyped_storage().data_ptr() != buffers[0].untyped_storage().data_ptr()
    buffers[0].fill_(0)  # the staging buffer, reused by the next step: the copies are their own
    assert all(torch.equal(copy, view) for view, copy in zip(found, copies))
    assert waits == [1] and len(buffers) == 1
    # batch: 192 bytes; odd: 3 of 7 bytes → 16; large: 12 → 16 and 20 → 32; bf16: 6 → 16; the comparison: 12 → 16
    assert buffers[0].numel() == 192 + 16 + 16 + 32 + 16 + 16
