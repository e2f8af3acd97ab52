"""A step's small host-built inputs moved to the device without waiting for it: one non-blocking copy per step,
through pinned memory. A plain copy from pageable host memory first waits for everything queued on the stream, so
building a step's inputs after launching its first graph would stall the host until that graph finished."""

from __future__ import annotations

from typing import Callable

import torch

from omni_ray.engine.profiling import host_range

UPLOAD_ALIGNMENT = 16  # bytes: every dtype's element size divides it


def upload(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The same tensors on `device`: views of one byte buffer, whatever their dtypes. Each tensor is written straight
    into one staging buffer (pinned for a GPU: no pageable copy in between, which past 128 KB costs fresh pages on
    every step), then one host-to-device copy; on a CPU device the staging buffer is the result, so the packing is the
    same everywhere. Each tensor starts at a multiple of `UPLOAD_ALIGNMENT` bytes."""
    offsets: dict[str, int] = {}
    size = 0
    for name, tensor in tensors.items():
        offsets[name] = size
        size += tensor.numel() * tensor.element_size()
        size += -size % UPLOAD_ALIGNMENT
    staged = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for name, tensor in tensors.items():
        if tensor.numel():
            _packed_view(staged, offsets[name], tensor).copy_(tensor)
    flat = staged.to(device, non_blocking=True)  # the host allocator keeps `staged` until the copy is done
    return {name: _packed_view(flat, offsets[name], tensor) for name, tensor in tensors.items()}


def _packed_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of `buffer` from `offset` as a tensor of `like`'s dtype and shape."""
    return buffer[offset : offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One tensor on `device` without waiting for the work queued there (as `upload`); a device tensor stays as it
    is (a copy between GPUs is queued behind this stream's work, not the host's)."""
    if tensor.device == device or tensor.device.type != "cpu":
        return tensor.to(device)
    return upload({"tensor": tensor}, device)["tensor"]


def stack_on_device(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`torch.stack(tensors)` on `device`, for tensors that may each sit on the host or on a GPU: on one GPU the relay
    hands a step's message over on the host path or through CUDA IPC by its size, so one request's text embeddings
    arrive on either, and one batch mixes them. The host ones go up in one upload, without waiting for the GPU."""
    return _join_on_device(tensors, device, torch.stack)


def cat_on_device(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`torch.cat(tensors)` on `device`, the tensors on the host or on a GPU each (as `stack_on_device`)."""
    return _join_on_device(tensors, device, torch.cat)


def _join_on_device(
    tensors: list[torch.Tensor], device: torch.device, join: Callable[[list[torch.Tensor]], torch.Tensor]
) -> torch.Tensor:
    on_host = [t for t in tensors if t.device.type == "cpu" and device.type != "cpu"]
    if not on_host:
        return join([t.to(device) for t in tensors])
    flat = to_device(torch.cat([t.reshape(-1) for t in on_host]), device)
    uploaded = iter(flat.split([t.numel() for t in on_host]))
    return join([next(uploaded).view(t.shape) if t.device.type == "cpu" else t.to(device) for t in tensors])


class StepDone:
    """An event after everything queued so far on the current stream: `wait()` blocks the host until that work alone
    is done (not what is queued after it)."""

    def __init__(self, device: torch.device) -> None:
        self._event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            with host_range("wait for the device"):
                self._event.synchronize()


class Download:
    """A device tensor's copy on its way to pinned host memory, queued on the current stream behind the work that
    makes it: `result()` waits for that copy alone, so the host can queue the next step before reading this one."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
        else:
            self._host = tensor.clone()
        self._done = StepDone(tensor.device)

    def result(self) -> torch.Tensor:
        self._done.wait()
        return self._host
