"""CUDA IPC relay between processes on one GPU: a step's tensors go into one device buffer whose IPC handle travels
on the host path; the consumer copies them out of the producer's memory on the device, with no host round trip.

Framing is the collective relay's (`pack`/`unpack`: one flat buffer, a tensor-free header). The producer fills the
buffer on a side stream and synchronizes it before the handle leaves, so the consumer never reads an unfinished
buffer. Dropping the buffer afterwards is safe: torch keeps an IPC-shared block alive (its "limbo") until every
consumer has released it, and `torch.cuda.ipc_collect` frees what consumers let go.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.collective import _control, _failed, flatten, pack, unpack
from omni_ray.relay.tcp import TcpTransport

log = logging.getLogger(__name__)

COLLECT_EVERY = 256  # sends between `torch.cuda.ipc_collect()` calls (frees blocks consumers have released)
_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument


class IpcTransport:
    """Producer side: `send(peer, message)` shares the step's tensors as one CUDA IPC buffer, header on the host
    path. Only for a peer on this process's GPU (another process: same-process peers get the local hand-off)."""

    def __init__(self, device: torch.device | str, control: TcpTransport) -> None:
        self.device = torch.device(device)
        self.control = control
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ipc")  # buffers in send order
        self.shared = 0

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        header, tensors, nbytes = pack(message)
        handle = await asyncio.wrap_future(self._worker.submit(self._share, tensors, nbytes)) if nbytes else None
        await self.control.send(peer, _control(message.sender, "ipc", "", header=header, handle=handle))

    def _share(self, tensors: list[tuple[int, torch.Tensor]], nbytes: int) -> tuple[Any, ...]:
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.default_stream(self.device))
            buffer = flatten(tensors, nbytes, self.device)
            if self.stream is not None:
                self.stream.synchronize()
        self.shared += 1
        if self.shared % COLLECT_EVERY == 0:
            torch.cuda.ipc_collect()
        rebuild, args = reduce_tensor(buffer)
        assert rebuild is rebuild_cuda_tensor, "CUDA IPC needs a CUDA buffer"
        return tuple(args)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


class IpcReceiver:
    """Consumer side: opens each message's buffer from its IPC handle, copies it into this process's memory (on a
    side stream) and delivers the message, in arrival order. Control ops it does not know go to `fallback`."""

    def __init__(self, endpoint: RelayEndpoint, device: torch.device | str) -> None:
        self.endpoint = endpoint
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ipc-in")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fallback = endpoint.on_control
        self.received = 0
        endpoint.on_control = self.handle

    def handle(self, message: RelayMessage) -> None:
        control = message.control or {}
        if control.get("op") != "ipc":
            if self.fallback is not None:
                self.fallback(message)
            return
        self._loop = asyncio.get_running_loop()
        self._worker.submit(self._receive, control["header"], control.get("handle"))

    def _receive(self, header: RelayMessage, handle: tuple[Any, ...] | None) -> None:
        try:
            buffer = self._copy_out(handle) if handle is not None else torch.empty(0, dtype=torch.uint8, device=self.device)
            message = unpack(header, buffer)
            self.received += 1
        except Exception as exc:  # the producer's memory could not be opened: fail these requests, keep serving
            log.warning("CUDA IPC relay from %s failed: %s", header.sender, exc)
            message = _failed(header, f"relay from {header.sender} failed: {exc}")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.endpoint.deliver, message)

    def _copy_out(self, handle: tuple[Any, ...]) -> torch.Tensor:
        args = list(handle)
        args[_DEVICE_ARG] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        shared = rebuild_cuda_tensor(*args)  # a view of the producer's buffer (same physical GPU)
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            buffer = shared.clone()
            if self.stream is not None:
                self.stream.synchronize()
        del shared  # releases the producer's block
        return buffer

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
