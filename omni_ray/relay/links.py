"""Who relays a request's items where: the caller names each producer's consumer once both stage streams are open."""

from __future__ import annotations

from omni_ray.relay.channel import RelayMessage, RelayPeer
from omni_ray.relay.tcp import TcpTransport


class RelayLinks:
    """The caller's side of the relay's control plane: a host-path connection per stage replica it wires up."""

    def __init__(self) -> None:
        self.transport = TcpTransport()

    async def connect(self, producer: RelayPeer, consumer: RelayPeer, request_id: str) -> None:
        """Tell the `producer` replica to send the request's relay items to the `consumer` replica. The producer
        holds what it makes for the request until this arrives, so the two streams can open in any order."""
        control = {"op": "consumer", "request": request_id, "peer": consumer}
        await self.transport.send(producer, RelayMessage("caller", [], control=control))
