"""Relay transports: direct hand-off in one process, and the host path through Ray actor calls."""

from __future__ import annotations

from typing import Protocol

from omni_ray.relay.channel import RelayMessage, RelayPeer


class Transport(Protocol):
    async def send(self, peer: RelayPeer, message: RelayMessage) -> None: ...


class LocalTransport:
    """Same process: the peer handle is the receiving RelayEndpoint itself."""

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        peer.handle.deliver(message)


class HostTransport:
    """CPU path: the message (header + CPU tensors) travels as the argument of the peer actor's `relay_deliver`."""

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        for item in message.items:
            for name, tensor in item.tensors.items():
                if tensor.device.type != "cpu":
                    item.tensors[name] = tensor.cpu()
        await peer.handle.relay_deliver.remote(message)


class PlacementTransport:
    """Picks the transport for each peer from what its handle is (an in-process endpoint or a Ray actor)."""

    def __init__(self) -> None:
        self.local = LocalTransport()
        self.host = HostTransport()

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        if hasattr(peer.handle, "deliver"):
            await self.local.send(peer, message)
        else:
            await self.host.send(peer, message)
