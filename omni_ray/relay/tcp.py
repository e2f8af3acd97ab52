"""Host-path relay between replicas on any nodes: length-prefixed pickled messages over persistent TCP streams."""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct
from typing import Callable

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer

log = logging.getLogger(__name__)
_HEADER = struct.Struct("!Q")


def node_ip() -> str:
    """This node's address as Ray sees it (127.0.0.1 without Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # no Ray here: a local test
        pass
    return "127.0.0.1"


class RelayServer:
    """Accepts relay connections for one replica and hands each message to its endpoint, in arrival order."""

    def __init__(self, endpoint: RelayEndpoint) -> None:
        self.endpoint = endpoint
        self._server: asyncio.AbstractServer | None = None
        self.address = ""

    async def start(self, host: str) -> str:
        self._server = await asyncio.start_server(self._serve, host=host, port=0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"tcp://{host}:{port}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                message: RelayMessage = pickle.loads(await reader.readexactly(size))
                try:
                    self.endpoint.deliver(message)
                except Exception:  # a bad message must not kill the connection for other requests
                    log.exception("relay delivery failed")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class TcpTransport:
    """One persistent connection per peer address; sends on a connection are serialised, so order is kept.

    The receiving side never writes back, so end-of-stream on a connection means the peer process is gone: the
    connection is dropped at once (the next send then fails fast) and `on_lost(peer)` is called."""

    def __init__(self, on_lost: Callable[[RelayPeer], None] | None = None) -> None:
        self.connections: dict[str, asyncio.StreamWriter] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self.on_lost = on_lost

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        lock = self._locks.setdefault(peer.address, asyncio.Lock())
        async with lock:
            writer = self.connections.get(peer.address)
            if writer is None or writer.is_closing():
                host, port = peer.address.removeprefix("tcp://").rsplit(":", 1)
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout=10)
                self.connections[peer.address] = writer
                watcher = asyncio.get_running_loop().create_task(self._watch(peer, reader, writer))
                self._watchers.add(watcher)
                watcher.add_done_callback(self._watchers.discard)
            try:
                writer.write(_HEADER.pack(len(payload)) + payload)
                await writer.drain()
            except Exception:
                self.connections.pop(peer.address, None)
                writer.close()
                raise

    async def _watch(self, peer: RelayPeer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # returns at end of stream: the peer closed or died
        except Exception:  # a reset is the same news
            pass
        if self.connections.get(peer.address) is writer:
            del self.connections[peer.address]
        writer.close()
        log.info("relay peer %s closed its connection", peer.replica_id)
        if self.on_lost is not None:
            self.on_lost(peer)
