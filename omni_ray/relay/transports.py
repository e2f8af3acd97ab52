"""Transport selection by placement: in-process hand-off, CUDA IPC on one GPU, pairwise collectives between GPUs,
else the host path."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from omni_ray.config import RelayMode
from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.collective import CollectiveTransport
from omni_ray.relay.ipc import IpcTransport
from omni_ray.relay.tcp import TcpTransport

# Endpoints of replicas living in this process, by replica id: peers found here get a direct hand-off.
LOCAL_ENDPOINTS: dict[str, RelayEndpoint] = {}


class Transport(Protocol):
    async def send(self, peer: RelayPeer, message: RelayMessage) -> None: ...


class LocalTransport:
    """Same process: the message object itself is delivered to the peer's endpoint (no copy)."""

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        LOCAL_ENDPOINTS[peer.replica_id].deliver(message)


def gpu_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (CUDA_VISIBLE_DEVICES renumbers devices); '' off CUDA."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


class PlacementTransport:
    """Picks the transport per peer. Same process → direct hand-off. Otherwise by `mode`: `host` → the TCP host
    path; `collective` → a pairwise group (NCCL on GPUs, gloo on CPUs); `auto` → collective when both replicas are
    on different GPUs, the host path otherwise (CPU, or two processes sharing one GPU); `ipc` → as `auto`, but two
    processes on one GPU share the step's tensors through CUDA IPC (opt-in: on an H200 it is faster than the host
    path from 4 MB messages up, slower up to 1 MB, where most step messages are)."""

    def __init__(self, device: torch.device | str = "cpu", mode: RelayMode = "auto") -> None:
        self.device = torch.device(device)
        self.mode = mode
        self.gpu_uuid = gpu_uuid(self.device)
        self.local = LocalTransport()
        self.tcp = TcpTransport(on_lost=self._lost)
        self.collective = CollectiveTransport(self.device, control=self.tcp)
        self.ipc = IpcTransport(self.device, control=self.tcp) if self.device.type == "cuda" and mode == "ipc" else None
        self.on_peer_lost: Callable[[RelayPeer, Exception], None] | None = None  # set by the RelaySender

    def select(self, peer: RelayPeer) -> Transport:
        if peer.replica_id in LOCAL_ENDPOINTS:
            return self.local
        if self.mode == "collective":
            return self.collective
        if self.mode in ("auto", "ipc") and self.gpu_uuid and peer.gpu_uuid:
            if peer.gpu_uuid != self.gpu_uuid:
                return self.collective
            if self.ipc is not None:
                return self.ipc
        return self.tcp

    def needs_host_tensors(self, peer: RelayPeer) -> bool:
        """Does this peer's transport pickle tensors (so they must be on the CPU first)?"""
        return self.select(peer) is self.tcp

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        await self.select(peer).send(peer, message)

    def _lost(self, peer: RelayPeer) -> None:
        """The host path saw the peer's process go: tear down its collective pair (NCCL would not notice), and
        fail what was in flight to it."""
        self.collective.drop(peer.replica_id)
        if self.ipc is not None:
            self.ipc.drop(peer.replica_id)
        if self.on_peer_lost is not None:
            self.on_peer_lost(peer, ConnectionError(f"relay peer {peer.replica_id} went away"))

    def close(self) -> None:
        self.collective.close()
        if self.ipc is not None:
            self.ipc.close()
