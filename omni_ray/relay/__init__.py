"""Point-to-point tensor relay between stage replicas: batched per-step messages, pluggable transports."""

from omni_ray.relay.channel import RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelaySender
from omni_ray.relay.transports import HostTransport, LocalTransport, PlacementTransport, Transport

__all__ = [
    "HostTransport",
    "LocalTransport",
    "PlacementTransport",
    "RelayEndpoint",
    "RelayItem",
    "RelayMessage",
    "RelayPeer",
    "RelaySender",
    "Transport",
]
