"""Transport selection by placement: in-process hand-off, CUDA IPC on one GPU, pairwise collectives between GPUs,
else the host path."""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from omni_ray.config import RelayMode
from omni_ray.relay.channel import RelayEndpoint, RelayItem, RelayMessage, RelayPeer
from omni_ray.relay.collective import CollectiveTransport
from omni_ray.relay.ipc import IpcTransport
from omni_ray.relay.tcp import TcpTransport

# Endpoints of replicas living in this process, by replica id: peers found here get a direct hand-off.
LOCAL_ENDPOINTS: dict[str, RelayEndpoint] = {}
# In `auto` mode, between processes on one GPU: a step's message to a peer with this many bytes of device tensors or
# more goes through CUDA IPC, a smaller one on the host path. On an H200 the host path took 0.94 ms for
# 1 MB and 2.4 ms for 4 MB, CUDA IPC 1.0-1.2 ms at every size.
IPC_FROM_BYTES = 2 << 20


def device_bytes(items: list[RelayItem]) -> int:
    """Bytes of the items' tensors that are not on the CPU."""
    return sum(tensor.numel() * tensor.element_size() for item in items
               for tensor in item.tensors.values() if tensor.device.type != "cpu")


class Transport(Protocol):
    async def send(self, peer: RelayPeer, message: RelayMessage) -> None: ...


class LocalTransport:
    """Same process: the message object itself is delivered to the peer's endpoint (no copy)."""

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        message.sent_at = message.arrived_at = time.time()
        LOCAL_ENDPOINTS[peer.replica_id].deliver(message)


def gpu_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (CUDA_VISIBLE_DEVICES renumbers devices); '' off CUDA."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


class PlacementTransport:
    """Picks the transport per peer. Same process → direct hand-off. Otherwise by `mode`: `host` → the TCP host
    path; `collective` → a pairwise group (NCCL on GPUs, gloo on CPUs); `auto` → collective when both replicas are
    on different GPUs, the host path on CPUs, and between two processes sharing one GPU the host path for a step's
    message under `ipc_from_bytes` of device tensors, CUDA IPC from there up (the host path is faster for small
    messages, IPC for large ones; the consumer keeps them in order); `ipc` → as `auto`, with every message between
    processes on one GPU through CUDA IPC."""

    def __init__(self, device: torch.device | str = "cpu", mode: RelayMode = "auto",
                 ipc_from_bytes: int = IPC_FROM_BYTES) -> None:
        self.device = torch.device(device)
        self.mode = mode
        self.gpu_uuid = gpu_uuid(self.device)
        self.local = LocalTransport()
        self.tcp = TcpTransport(on_lost=self._lost)
        self.collective = CollectiveTransport(self.device, control=self.tcp)
        on_one_gpu = self.device.type == "cuda" and mode in ("auto", "ipc")
        self.ipc = IpcTransport(self.device, control=self.tcp) if on_one_gpu else None
        self.ipc_from_bytes = 0 if mode == "ipc" else ipc_from_bytes
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

    def needs_host_tensors(self, peer: RelayPeer, device_bytes: int) -> bool:
        """Must a message to this peer with `device_bytes` of device tensors have them on the CPU first (its
        transport serializes them)?"""
        transport = self.select(peer)
        return transport is self.tcp or (transport is self.ipc and device_bytes < self.ipc_from_bytes)

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        transport = self.select(peer)
        on_device = any(t.device.type != "cpu" for item in message.items for t in item.tensors.values())
        if transport is self.ipc and self.mode == "auto" and not on_device:
            transport = self.tcp  # its tensors were copied to the CPU (a small message), or it has none
        await transport.send(peer, message)

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
