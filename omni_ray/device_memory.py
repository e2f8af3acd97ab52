"""Device memory of its own from the CUDA driver (`cuMemAlloc`), outside PyTorch's caching allocator.

For state that outlives every CUDA graph that reads it and must never share memory with a tensor: the persistent
code-predictor pass's barrier counters and the split-depth GEMMs' arrival counters. The pass's counters were once a
tensor from PyTorch's allocator, allocated inside a graph capture (a capture stream's first ask), so in the pool the
runner's graphs share, on memory that graphs captured before had used for intermediates. Each replay of those graphs
wrote there: in the 1-GPU service an int64 0x71 landed at the counters' first bytes (likely a Talker prefill's, 113
being about its prompt length), and a grid barrier then waited for good. Tensors view this memory through
`__cuda_array_interface__`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL("libcuda.so.1")
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{what}: CUDA error {result} ({(message.value or b'?').decode()})")


class _Context:
    """The device's primary context (the one PyTorch uses) made current on the calling thread for a driver call."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle, self.context = ctypes.c_int(), ctypes.c_void_p()
        _check(_driver().cuDeviceGet(ctypes.byref(handle), ctypes.c_int(index)), "cuDeviceGet")
        _check(_driver().cuDevicePrimaryCtxRetain(ctypes.byref(self.context), handle), "cuDevicePrimaryCtxRetain")

    def __enter__(self) -> None:
        _check(_driver().cuCtxPushCurrent_v2(self.context), "cuCtxPushCurrent")

    def __exit__(self, *exc: Any) -> None:
        popped = ctypes.c_void_p()
        _driver().cuCtxPopCurrent_v2(ctypes.byref(popped))


class _ArrayInterface:
    """What `torch.as_tensor` reads to view `nbytes` bytes at a device address without copying."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class DeviceBuffer:
    """`nbytes` of device memory of its own, zeroed, as a uint8 tensor (`tensor`). Freed when collected: nothing may
    read it then. Not during a CUDA graph capture (an allocation)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self._context = _Context(device)
        self.address = ctypes.c_uint64()
        with self._context:
            _check(_driver().cuMemAlloc_v2(ctypes.byref(self.address), ctypes.c_size_t(nbytes)), "cuMemAlloc")
            _check(_driver().cuMemsetD8_v2(self.address, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)), "cuMemsetD8")
            _check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")  # zeroed before any stream uses it
        self.tensor = torch.as_tensor(_ArrayInterface(self.address.value, nbytes), device=device)

    def __del__(self) -> None:
        try:
            if self.address.value:
                with self._context:
                    _driver().cuMemFree_v2(self.address)
        except Exception:  # interpreter shutdown: the driver may be gone; the process's memory goes with it
            pass


class StreamCounterSets:
    """Sets of `words` int32 counters in device memory of their own, one set per (device, stream) that asks: state
    that kernels on one stream leave at rest for the next launch and CUDA graphs bake the address of. A device's slab
    of `sets` sets, each starting as `at_rest`, is made on its first ask outside a graph capture (an allocation)."""

    def __init__(self, words: int, sets: int, at_rest: list[int]) -> None:
        assert len(at_rest) == words
        self.words, self.sets, self.at_rest = words, sets, at_rest
        self._slabs: dict[torch.device, DeviceBuffer] = {}
        self._handed: dict[tuple[torch.device, int], torch.Tensor] = {}

    def make_slab(self, device: torch.device) -> None:
        if device not in self._slabs:
            slab = DeviceBuffer(self.sets * self.words * 4, device)
            at_rest = torch.tensor(self.at_rest, dtype=torch.int32).repeat(self.sets)
            slab.tensor.view(torch.int32).copy_(at_rest)
            torch.cuda.synchronize(device)
            self._slabs[device] = slab

    def for_current_stream(self, device: torch.device) -> torch.Tensor | None:
        """The current stream's set (int32 [words]), or None when every set is taken or the slab is not made and
        cannot be now (inside a graph capture)."""
        key = (device, torch.cuda.current_stream(device).stream_id)
        if key not in self._handed:
            if device not in self._slabs and torch.cuda.is_current_stream_capturing():
                return None
            self.make_slab(device)
            taken = sum(1 for other, _ in self._handed if other == device)
            if taken == self.sets:
                return None
            words = self._slabs[device].tensor.view(torch.int32)
            self._handed[key] = words[taken * self.words:(taken + 1) * self.words]
        return self._handed[key]
