"""Host-path relay between replicas on any nodes: pickled messages whose tensors travel as raw out-of-band buffers,
over persistent TCP streams, with no copy of a tensor's bytes between the sender's host tensor and the socket."""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
import time
from dataclasses import dataclass, replace
from typing import Callable, Union

import torch

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer

log = logging.getLogger(__name__)
# A frame: (pickled body length, buffer count), each buffer's length, the body, then each buffer from an offset of
# the frame aligned to BUFFER_ALIGN bytes (so a tensor read in place, in a frame-sized buffer, is aligned for its dtype).
_FIXED = struct.Struct("!QI")
BUFFER_ALIGN = 64
SEPARATE_SEND_BYTES = 64 << 10  # parts this large go to the socket as they are; smaller ones are joined first
Part = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class WireTensor:
    """A CPU tensor as its dtype, shape and raw bytes. Torch's own pickling of a tensor serialises its storage as an
    archive: about 46 us per small tensor here, which for a Talker step's 32 frames of codes came to 1.5 ms of the
    event loop's time, and as much again to unpickle. Pickled with `encode_message`, the bytes travel out of band
    (pickle protocol 5): the frame's bytes are the tensor's own, and the receiver's tensor is a view of its frame."""

    dtype: str
    shape: tuple[int, ...]
    data: object  # pickle.PickleBuffer when sent; a memoryview (or bytes) of the received frame

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "WireTensor":
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        return cls(str(flat.dtype).removeprefix("torch."), tuple(tensor.shape),
                   pickle.PickleBuffer(flat.view(torch.uint8).numpy()))

    def tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        data = memoryview(self.data)  # type: ignore[arg-type]
        if data.nbytes == 0:
            return torch.empty(self.shape, dtype=dtype)
        if data.readonly:  # torch.frombuffer wants a writable buffer
            data = memoryview(bytearray(data))
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(self.shape)


def _aligned(offset: int) -> int:
    return -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN


def _header_size(count: int) -> int:
    return _FIXED.size + 8 * count


def _layout(body_length: int, sizes: tuple[int, ...]) -> tuple[list[int], int]:
    """Each buffer's offset in the frame, and the frame's length."""
    offsets, end = [], _header_size(len(sizes)) + body_length
    for size in sizes:
        start = _aligned(end)
        offsets.append(start)
        end = start + size
    return offsets, end


def encode_message(message: RelayMessage) -> list[Part]:
    """A message as the parts of one frame for the host path, in order: its header and pickled body, then each
    tensor's bytes (views of the tensors, not copies) after the padding that aligns them."""
    items = [replace(item, tensors={k: WireTensor.of(v) for k, v in item.tensors.items()}) if item.tensors else item
             for item in message.items]
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(replace(message, items=items), protocol=5, buffer_callback=buffers.append)
    raws = [buffer.raw() for buffer in buffers]
    sizes = tuple(raw.nbytes for raw in raws)
    offsets, _ = _layout(len(body), sizes)
    parts: list[Part] = [_FIXED.pack(len(body), len(raws)) + struct.pack(f"!{len(sizes)}Q", *sizes), body]
    end = _header_size(len(sizes)) + len(body)
    for raw, offset in zip(raws, offsets):
        if offset > end:
            parts.append(bytes(offset - end))
        parts.append(raw)
        end = offset + raw.nbytes
    return parts


def decode_message(frame: Union[bytes, bytearray, memoryview]) -> RelayMessage:
    """One whole frame (`encode_message`'s parts joined) back into a message. Its tensors view the frame's bytes
    (pass a bytearray to keep them writable without a copy)."""
    view = memoryview(frame)
    body_length, count = _FIXED.unpack_from(view)
    sizes = struct.unpack_from(f"!{count}Q", view, _FIXED.size)
    start = _header_size(count)
    offsets, _ = _layout(body_length, sizes)
    buffers = [view[offset : offset + size] for offset, size in zip(offsets, sizes)]
    message: RelayMessage = pickle.loads(view[start : start + body_length], buffers=buffers)
    for i, item in enumerate(message.items):
        if item.tensors:
            message.items[i] = replace(item, tensors={k: v.tensor() for k, v in item.tensors.items()})
    return message


def node_ip() -> str:
    """This node's address as Ray sees it (127.0.0.1 without Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # no Ray here: a local test
        pass
    return "127.0.0.1"


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket; ConnectionError at end of stream."""
    got = 0
    while got < len(view):
        count = await loop.sock_recv_into(sock, view[got:])
        if count == 0:
            raise ConnectionError("relay connection closed")
        got += count


async def _read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytearray:
    """One frame into one buffer of its own size, read straight from the socket (no intermediate copies)."""
    fixed = bytearray(_FIXED.size)
    await _recv_into(loop, sock, memoryview(fixed))
    body_length, count = _FIXED.unpack(fixed)
    sizes = bytearray(8 * count)
    await _recv_into(loop, sock, memoryview(sizes))
    header_size = _header_size(count)
    frame = bytearray(_layout(body_length, struct.unpack(f"!{count}Q", sizes))[1])
    frame[: _FIXED.size], frame[_FIXED.size : header_size] = fixed, sizes
    await _recv_into(loop, sock, memoryview(frame)[header_size:])
    return frame


async def _send_parts(loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: list[Part]) -> None:
    """Small parts joined into one send, large ones sent as they are (no copy of a large tensor's bytes)."""
    pending = bytearray()
    for part in parts:
        if memoryview(part).nbytes < SEPARATE_SEND_BYTES:
            pending += part
            continue
        if pending:
            await loop.sock_sendall(sock, pending)
            pending = bytearray()
        await loop.sock_sendall(sock, part)
    if pending:
        await loop.sock_sendall(sock, pending)


class RelayServer:
    """Accepts relay connections for one replica and hands each message to its endpoint, in arrival order."""

    def __init__(self, endpoint: RelayEndpoint) -> None:
        self.endpoint = endpoint
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self, host: str) -> str:
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept(self._listener))
        self.address = f"tcp://{host}:{port}"
        return self.address

    async def close(self) -> None:
        """Stop accepting connections (those open stay until their peer closes them)."""
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            task = loop.create_task(self._serve(sock))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = decode_message(await _read_frame(loop, sock))
                message.arrived_at = time.time()
                try:
                    self.endpoint.deliver(message)
                except Exception:  # a bad message must not kill the connection for other requests
                    log.exception("relay delivery failed")
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()


async def _connect(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    loop = asyncio.get_running_loop()
    family, kind, proto, _, target = (await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, target), timeout=10)
    except BaseException:
        sock.close()
        raise
    return sock


class TcpTransport:
    """One persistent connection per peer address; sends on a connection are serialised, so order is kept.

    The receiving side never writes back, so end-of-stream on a connection means the peer process is gone: the
    connection is dropped at once (the next send then fails fast) and `on_lost(peer)` is called."""

    def __init__(self, on_lost: Callable[[RelayPeer], None] | None = None) -> None:
        self.connections: dict[str, socket.socket] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self.on_lost = on_lost

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        if not message.control:  # an item message leaves now (a transport's control message stamps its header)
            message.sent_at = time.time()
        parts = encode_message(message)
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault(peer.address, asyncio.Lock())
        async with lock:
            sock = self.connections.get(peer.address)
            if sock is None:
                sock = await _connect(peer.address)
                self.connections[peer.address] = sock
                watcher = loop.create_task(self._watch(peer, sock))
                self._watchers.add(watcher)
                watcher.add_done_callback(self._watchers.discard)
            try:
                await _send_parts(loop, sock, parts)
            except Exception:
                if self.connections.get(peer.address) is sock:
                    del self.connections[peer.address]
                try:  # wakes the connection's watcher, which closes it and reports the peer lost
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                raise

    async def _watch(self, peer: RelayPeer, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().sock_recv(sock, 1)  # returns at end of stream: the peer closed or died
        except Exception:  # a reset is the same news
            pass
        if self.connections.get(peer.address) is sock:
            del self.connections[peer.address]
        sock.close()
        log.info("relay peer %s closed its connection", peer.replica_id)
        if self.on_lost is not None:
            self.on_lost(peer)
