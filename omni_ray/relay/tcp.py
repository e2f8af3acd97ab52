"""Host-path relay between replicas on any nodes: authenticated TCP streams carrying msgpack frames whose tensors
travel as raw out-of-band buffers, with no copy of a tensor's bytes between the sender's host tensor and the socket.
Each connection first passes the application-secret handshake (`auth.py`); frames are `wire.py`'s."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from typing import Callable

from omni_ray.relay.auth import (
    HANDSHAKE_TIMEOUT_S, LISTEN_HOST_ENV, RelayAuthError, accept_handshake, connect_handshake, relay_secret,
)
from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.wire import (
    BUFFER_ALIGN, FIXED, Part, RelayWireError, check_announced, decode_message, encode_message, header_size,
)

__all__ = ["BUFFER_ALIGN", "LISTEN_HOST_ENV", "RelayServer", "RelayWireError", "TcpTransport", "decode_message",
           "encode_message", "node_ip"]
log = logging.getLogger(__name__)
SEPARATE_SEND_BYTES = 64 << 10  # parts this large go to the socket as they are; smaller ones are joined first


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
    """One frame into one buffer of its own size, read straight from the socket (no intermediate copies). What its
    header announces is checked against the caps before anything is allocated (RelayWireError)."""
    fixed = bytearray(FIXED.size)
    await _recv_into(loop, sock, memoryview(fixed))
    body_length, count = FIXED.unpack(fixed)
    check_announced(body_length, count)
    sizes = bytearray(8 * count)
    await _recv_into(loop, sock, memoryview(sizes))
    size = header_size(count)
    frame = bytearray(check_announced(body_length, count, struct.unpack(f"!{count}Q", sizes)))
    frame[: FIXED.size], frame[FIXED.size : size] = fixed, sizes
    await _recv_into(loop, sock, memoryview(frame)[size:])
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
    """Accepts relay connections for one replica and hands each message to its endpoint, in arrival order. A
    connection whose peer fails the handshake, or sends a frame that does not decode, is closed and counted in
    `rejected`; the others go on."""

    def __init__(self, endpoint: RelayEndpoint, secret: bytes | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.secret = secret if secret is not None else relay_secret()
        self.handshake_timeout_s = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.address = ""
        self.rejected = 0  # connections dropped: failed handshakes and undecodable frames

    async def start(self, host: str, advertised_host: str | None = None) -> str:
        """Listen on `host`, on a free port; returns the address peers reach it at (`advertised_host`, default
        `host`: a wildcard listen address such as 0.0.0.0 needs the node's own address here)."""
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        port = self._listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept(self._listener))
        self.address = f"tcp://{advertised_host or host}:{port}"
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
        peer = _peer_name(sock)
        try:
            await accept_handshake(sock, self.secret, self.handshake_timeout_s)
        except (RelayAuthError, asyncio.TimeoutError, OSError) as exc:
            self.rejected += 1
            log.warning("relay connection from %s refused: %s", peer, exc if str(exc) else "handshake timed out")
            sock.close()
            return
        try:
            while True:
                message = decode_message(await _read_frame(loop, sock))
                message.arrived_at = time.time()
                try:
                    self.endpoint.deliver(message)
                except Exception:  # a bad message must not kill the connection for other requests
                    log.exception("relay delivery failed")
        except RelayWireError as exc:
            self.rejected += 1
            log.warning("relay connection from %s closed: %s", peer, exc)
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "an unknown peer"


async def _connect(address: str, secret: bytes) -> socket.socket:
    """A connection to a relay server that has passed the handshake (RelayAuthError if it fails)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    loop = asyncio.get_running_loop()
    family, kind, proto, _, target = (await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, target), timeout=10)
        await connect_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return sock


class TcpTransport:
    """One persistent connection per peer address; sends on a connection are serialised, so order is kept.

    The receiving side writes back only during the handshake, so afterwards end-of-stream on a connection means
    the peer process is gone: the connection is dropped at once (the next send then fails fast) and `on_lost(peer)`
    is called."""

    def __init__(self, on_lost: Callable[[RelayPeer], None] | None = None, secret: bytes | None = None) -> None:
        self.secret = secret if secret is not None else relay_secret()
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
                sock = await _connect(peer.address, self.secret)
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
