"""A step's small host-built inputs moved to the device without waiting for it: one non-blocking copy per dtype,
through pinned memory. A plain copy from pageable host memory first waits for everything queued on the stream, so
building a step's inputs after launching its first graph would stall the host until that graph finished."""

from __future__ import annotations

import torch


def upload(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The same tensors on `device`: views of one buffer per dtype (on a CPU device too, where nothing is copied
    further, so the packing is the same everywhere)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in tensors.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    moved: dict[str, torch.Tensor] = {}
    for dtype, names in by_dtype.items():
        staged = torch.cat([tensors[name].reshape(-1).cpu() for name in names])
        if device.type == "cuda":
            staged = staged.pin_memory()
        flat = staged.to(device, non_blocking=True)  # the host allocator keeps `staged` until the copy is done
        offset = 0
        for name in names:
            numel = tensors[name].numel()
            moved[name] = flat[offset : offset + numel].view(tensors[name].shape)
            offset += numel
    return moved
