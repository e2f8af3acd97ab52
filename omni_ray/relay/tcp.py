"""Host-path relay between replicas on any nodes: length-prefixed pickled messages over persistent TCP streams."""

from __future__ import annotations

import asyncio
import logging
import pickle
import struct

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer

log = logging.getLogger(__name__)
_HEADER = struct.Struct("!Q")


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
    """One persistent connection per peer address; sends on a connection are serialised, so order is kept."""

    def __init__(self) -> None:
        self._connections: dict[str, asyncio.StreamWriter] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        lock = self._locks.setdefault(peer.address, asyncio.Lock())
        async with lock:
            writer = self._connections.get(peer.address)
            if writer is None or writer.is_closing():
                host, port = peer.address.removeprefix("tcp://").rsplit(":", 1)
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout=10)
                self._connections[peer.address] = writer
            try:
                writer.write(_HEADER.pack(len(payload)) + payload)
                await writer.drain()
            except Exception:
                self._connections.pop(peer.address, None)
                writer.close()
                raise
