"""Transport selection by placement: direct hand-off inside one process, otherwise the TCP host path."""

from __future__ import annotations

from typing import Protocol

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.tcp import TcpTransport

# Endpoints of replicas living in this process, by replica id: peers found here get a direct hand-off.
LOCAL_ENDPOINTS: dict[str, RelayEndpoint] = {}


class Transport(Protocol):
    async def send(self, peer: RelayPeer, message: RelayMessage) -> None: ...


class LocalTransport:
    """Same process: the message object itself is delivered to the peer's endpoint (no copy)."""

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        LOCAL_ENDPOINTS[peer.replica_id].deliver(message)


class PlacementTransport:
    """Picks the transport per peer: in-process endpoint → LocalTransport, anything else → TCP."""

    def __init__(self) -> None:
        self.local = LocalTransport()
        self.tcp = TcpTransport()

    def select(self, peer: RelayPeer) -> Transport:
        return self.local if peer.replica_id in LOCAL_ENDPOINTS else self.tcp

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        await self.select(peer).send(peer, message)
