"""Point-to-point tensor relay between stage replicas: batched per-step messages, pluggable transports."""

from omni_ray.relay.channel import RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelaySender
from omni_ray.relay.links import RelayLinks
from omni_ray.relay.tcp import RelayServer, TcpTransport
from omni_ray.relay.transports import LOCAL_ENDPOINTS, LocalTransport, PlacementTransport, Transport

__all__ = [
    "LOCAL_ENDPOINTS",
    "LocalTransport",
    "PlacementTransport",
    "RelayEndpoint",
    "RelayItem",
    "RelayLinks",
    "RelayMessage",
    "RelayPeer",
    "RelayServer",
    "RelaySender",
    "TcpTransport",
    "Transport",
]
