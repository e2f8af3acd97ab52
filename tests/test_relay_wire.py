"""The host path's msgpack frames: every message shape the relay sends round-trips, anything else fails to encode, and
random, truncated or bit-flipped frames each give a clean RelayWireError (or a valid message), over a socket too."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import time

import pytest
import torch

from omni_ray.relay import RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelayServer, TcpTransport
from omni_ray.relay.collective import TensorRef, _control, pack
from omni_ray.relay.wire import MAX_FRAME_BYTES, RelayWireError, decode_message, encode_message

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]


def _frame(message: RelayMessage) -> bytearray:
    return bytearray(b"".join(bytes(part) for part in encode_message(message)))


def _step_message() -> RelayMessage:
    g = torch.Generator().manual_seed(1)
    items = []
    for i, dtype in enumerate(DTYPES):
        values = torch.randn(3, 5, generator=g) * 100
        tensor = values > 0 if dtype is torch.bool else values.to(dtype)
        items.append(RelayItem(f"r{i}", tensors={"x": tensor, "empty": torch.zeros(0, 3, dtype=dtype)},
                               meta={"clock": i, "ratio": 0.5, "tags": ["a", None, True], "nested": {"k": [1, 2]}},
                               seq=i))
    items.append(RelayItem("r0", kind="end", meta={"finish_reason": "stop"}, seq=1))
    items.append(RelayItem("r1", kind="error", meta={"message": "boom"}, seq=1))
    return RelayMessage("talker-1", items, queued_at=1.5, sent_at=2.5, arrived_at=0.0)


def _same(a: RelayMessage, b: RelayMessage) -> None:
    assert (a.sender, a.control, a.queued_at, a.sent_at, a.arrived_at) == (b.sender, b.control, b.queued_at,
                                                                          b.sent_at, b.arrived_at)
    assert len(a.items) == len(b.items)
    for x, y in zip(a.items, b.items):
        assert (x.request_id, x.kind, x.meta, x.seq) == (y.request_id, y.kind, y.meta, y.seq)
        assert x.tensors.keys() == y.tensors.keys()
        for name, tensor in x.tensors.items():
            got = y.tensors[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name


def test_step_messages_round_trip_bitwise_in_every_dtype() -> None:
    message = _step_message()
    _same(message, decode_message(_frame(message)))


def test_control_messages_round_trip_with_tuples_peers_and_nested_headers() -> None:
    consumer = RelayPeer("talker-0", "tcp://10.0.0.3:41234", "cuda:0", "GPU-1234")
    link = RelayMessage("caller", [], control={"op": "consumer", "request": "r", "peer": consumer})
    assert decode_message(_frame(link)) == link
    join = _control("", "join", "pair-1", store=("10.0.0.2", 29500), backend="nccl")
    assert decode_message(_frame(join)).control["store"] == ("10.0.0.2", 29500)  # a tuple stays a tuple
    header, _, nbytes = pack(_step_message())
    payload = _control("thinker-0", "payload", "pair-1", header=header, nbytes=nbytes)
    got = decode_message(_frame(payload))
    refs = got.control["header"].items[0].meta["_tensor_refs"]
    assert refs == header.items[0].meta["_tensor_refs"] and isinstance(refs["x"], TensorRef)
    assert refs["x"].dtype is torch.float32 and refs["x"].shape == (3, 5)
    keyed = RelayMessage("p", [], control={"op": "x", "by": {1: "a", "b": 2}})
    assert decode_message(_frame(keyed)).control["by"] == {1: "a", "b": 2}  # what encodes decodes
    times = RelayMessage("p", [RelayItem("r", meta={"relay_times": (1.0, 2.0, 3.0)})])
    assert decode_message(_frame(times)).items[0].meta["relay_times"] == (1.0, 2.0, 3.0)


def test_a_cuda_ipc_handles_types_round_trip_by_name() -> None:
    """What `reduce_tensor` puts in a CUDA IPC handle (classes, torch.Size, dtype, bytes, ints, bools) travels; the
    classes by name from an allow-list."""
    handle = (torch.Tensor, torch.Size([4, 2]), (2, 1), 0, torch.storage.TypedStorage, torch.bfloat16, 0,
              b"\x00\x01handle", 1024, 512, False, b"ref", 0, b"event", True)
    ipc = RelayMessage("p", [], control={"op": "ipc", "header": RelayMessage("p", []), "handle": handle,
                                         "ring": ("ring-1", handle, 3, 256, 64)})
    got = decode_message(_frame(ipc))
    assert got.control["handle"] == tuple(handle) and got.control["ring"][1][4] is torch.storage.TypedStorage
    assert decode_message(_frame(RelayMessage("p", [], control={"d": torch.device("cuda", 1)}))).control["d"] == \
        torch.device("cuda:1")


@pytest.mark.parametrize("value", [object(), {1, 2}, torch.nn.Linear, pytest, complex(1, 2), torch.zeros(2).numpy(),
                                   RelayItem("nested-item-outside-a-message")])
def test_anything_else_fails_to_encode(value: object) -> None:
    with pytest.raises(TypeError):
        encode_message(RelayMessage("p", [], control={"op": "x", "value": value}))


def _ext(code: int, payload: object) -> bytes:
    import msgpack

    return msgpack.ExtType(code, msgpack.packb(payload))


def _raw_frame(body: object, buffers: list[bytes] = ()) -> bytes:
    """A frame around any msgpack body (the decoder's input, built without the encoder's checks)."""
    import msgpack

    from omni_ray.relay.wire import frame_layout

    data = msgpack.packb(body, use_bin_type=True)
    sizes = tuple(len(b) for b in buffers)
    offsets, length = frame_layout(len(data), sizes)
    frame = bytearray(length)
    struct.pack_into(f"!QI{len(sizes)}Q", frame, 0, len(data), len(sizes), *sizes)
    frame[12 + 8 * len(sizes): 12 + 8 * len(sizes) + len(data)] = data
    for offset, b in zip(offsets, buffers):
        frame[offset : offset + len(b)] = b
    return bytes(frame)


@pytest.mark.parametrize("body, buffers", [
    (["p", [], {"v": _ext(99, [])}, 0, 0, 0], []),  # unknown extension type
    (["p", [], {"v": _ext(9, None)}, 0, 0, 0], []),  # a class name that is not a string
    (["p", [], {"v": __import__("msgpack").ExtType(9, b"os.system")}, 0, 0, 0], []),  # a class off the allow-list
    (["p", [], {"v": __import__("msgpack").ExtType(6, b"float8_e4m3fn")}, 0, 0, 0], []),  # a dtype off the list
    (["p", [], {"v": __import__("msgpack").ExtType(7, b"mps:0")}, 0, 0, 0], []),  # a device off the list
    (["p", [["r", "data", {"x": [0, "float32", [4]]}, {}, 0]], None, 0, 0, 0], [b"\x00" * 12]),  # size mismatch
    (["p", [["r", "data", {"x": [3, "float32", [1]]}, {}, 0]], None, 0, 0, 0], [b"\x00" * 4]),  # no such buffer
    (["p", [["r", "data", {"x": [0, "float32", [-1]]}, {}, 0]], None, 0, 0, 0], [b"\x00" * 4]),  # negative size
    (["p", [["r", "data", {}, {}, "0"]], None, 0, 0, 0], []),  # a field of the wrong type
    (["p", [["r", "data", {}, {}]], None, 0, 0, 0], []),  # a field missing
    ([1, [], None, 0, 0, 0], []),  # a sender that is not a string
    ({"not": "a message"}, []),
    (["p", [], {"deep": _ext(5, [_ext(5, [_ext(5, [])])])}, 0, 0, 0], []),  # fine: nested tuples
])
def test_frames_naming_what_the_format_lacks_are_refused(body: object, buffers: list[bytes]) -> None:
    frame = _raw_frame(body, buffers)
    if "deep" in str(body):
        assert decode_message(frame).control["deep"] == (((),),)
        return
    with pytest.raises(RelayWireError):
        decode_message(frame)


def test_deep_nesting_and_oversized_headers_are_refused_before_allocating() -> None:
    nested: object = []
    for _ in range(200):
        nested = _ext(5, [nested])
    with pytest.raises(RelayWireError):
        decode_message(_raw_frame(["p", [], {"v": nested}, 0, 0, 0]))
    for header in (struct.pack("!QI", 2**63, 0), struct.pack("!QI", 10, 2**31), struct.pack("!QIQ", 10, 1, 2**62)):
        with pytest.raises(RelayWireError):
            decode_message(header + b"\x00" * 64)
    with pytest.raises(RelayWireError):  # a frame whose buffers add up past the cap
        decode_message(struct.pack("!QIQ", 1, 1, MAX_FRAME_BYTES) + b"\x90")


def test_fuzzed_frames_give_a_clean_error_or_a_valid_message() -> None:
    """Random bytes, every truncation of valid frames, and random bit flips: each decode returns a message or raises
    RelayWireError, never another exception, and each takes well under a second."""
    rng = random.Random(0)
    valid = [bytes(_frame(_step_message())), bytes(_frame(RelayMessage("caller", [], control={
        "op": "consumer", "request": "r", "peer": RelayPeer("x", "tcp://h:1")}))),
        bytes(_frame(_control("t", "join", "pair", store=("h", 1), backend="gloo")))]
    cases: list[bytes] = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300))) for _ in range(500)]
    for frame in valid:
        cases += [frame[:cut] for cut in range(0, len(frame), max(1, len(frame) // 300))]
        for _ in range(400):
            flipped = bytearray(frame)
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            cases.append(bytes(flipped))
    decoded = 0
    for case in cases:
        start = time.perf_counter()
        try:
            assert isinstance(decode_message(bytearray(case)), RelayMessage)
            decoded += 1
        except RelayWireError:
            pass
        assert time.perf_counter() - start < 1.0
    assert 0 < decoded < len(cases)  # some flips land in tensor bytes or timestamps and still decode


def test_a_bad_frame_closes_only_its_connection_and_the_replica_keeps_serving() -> None:
    """Over a real socket: an authenticated peer that sends a random or a truncated-then-closed frame loses its
    connection (counted); a good client's messages still arrive."""

    async def main() -> None:
        endpoint = RelayEndpoint()
        got: list[RelayItem] = []
        endpoint.claim("good", got.append)
        server = RelayServer(endpoint)
        peer = RelayPeer("consumer", await server.start("127.0.0.1"))
        rng = random.Random(1)
        for attempt in range(6):
            bad = TcpTransport()
            frame = bytes(_frame(_step_message()))
            junk = (bytes(rng.getrandbits(8) for _ in range(200)) if attempt % 2 else
                    struct.pack("!QI", 40, 0) + b"\xc1" * 40)  # 0xc1: a byte msgpack never uses
            await bad.send(peer, RelayMessage("warm", []))  # opens and authenticates its connection
            sock = bad.connections[peer.address]
            await asyncio.get_running_loop().sock_sendall(sock, junk if attempt < 4 else frame[: len(frame) // 2])
            if attempt >= 4:
                sock.shutdown(socket.SHUT_WR)  # a truncated frame, then the end of the stream
            deadline = time.monotonic() + 10
            while peer.address in bad.connections and attempt < 4:
                assert time.monotonic() < deadline, "the server kept a connection that sent a bad frame"
                await asyncio.sleep(0.01)
        await _until(lambda: server.rejected >= 4)
        good = TcpTransport()
        await good.send(peer, RelayMessage("producer", [RelayItem("good", tensors={"x": torch.arange(3)}, seq=0)]))
        await _until(lambda: len(got) == 1)
        assert torch.equal(got[0].tensors["x"], torch.arange(3))
        await server.close()

    asyncio.run(main())


async def _until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)
