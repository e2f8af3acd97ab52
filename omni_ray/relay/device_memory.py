"""Device memory outside PyTorch's caching allocator, shared between processes by legacy CUDA IPC handles.

The CUDA IPC relay's rings live here rather than in tensors from PyTorch's allocator: under
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (which the 1-GPU layout needs to fit an 80 GB GPU), PyTorch shares
a tensor as its whole expandable segment, and on an H100 the consumer's 8-byte acknowledgement landed in other
memory of the producer's process: the persistent code-predictor pass's barrier counters (session 52, the guard words
before them read 0x71, 0x0). Memory from `cuMemAlloc` with a `cuIpcGetMemHandle` handle is one allocation per
handle, whatever the allocator's settings. Tensors view it through `__cuda_array_interface__`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

IPC_HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        _lib = lib
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        raise RuntimeError(f"{what}: CUDA error {result} ({(message.value or b'?').decode()})")


class _Context:
    """The device's primary context (the one PyTorch uses) made current on the calling thread for a driver call:
    a relay worker thread may not have made a runtime call yet."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        device_handle, self.context = ctypes.c_int(), ctypes.c_void_p()
        _check(_driver().cuDeviceGet(ctypes.byref(device_handle), ctypes.c_int(self.index)), "cuDeviceGet")
        _check(_driver().cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device_handle),
               "cuDevicePrimaryCtxRetain")

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


def _view(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_ArrayInterface(address, nbytes), device=device)


class SharedDeviceBuffer:
    """`nbytes` of device memory of its own (`cuMemAlloc`), zeroed, as a uint8 tensor (`tensor`), with the IPC
    handle (`handle`, 64 bytes) another process on this GPU opens it by (`OpenedDeviceBuffer`). Freed by `close`
    (or when collected): no process may still read it then."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.nbytes = nbytes
        self._context = _Context(device)
        self.address = ctypes.c_uint64()
        handle = _IpcHandle()
        with self._context:
            _check(_driver().cuMemAlloc_v2(ctypes.byref(self.address), ctypes.c_size_t(nbytes)), "cuMemAlloc")
            _check(_driver().cuIpcGetMemHandle(ctypes.byref(handle), self.address), "cuIpcGetMemHandle")
            _check(_driver().cuMemsetD8_v2(self.address, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes)), "cuMemsetD8")
            _check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")  # zero before any stream writes a message
        self.handle = bytes(handle.reserved)
        self.tensor = _view(self.address.value, nbytes, device)

    def close(self) -> None:
        if self.address.value:
            with self._context:
                _driver().cuMemFree_v2(self.address)
            self.address = ctypes.c_uint64()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone; the process's memory goes with it
            pass


class OpenedDeviceBuffer:
    """Another process's `SharedDeviceBuffer` opened in this one by its `handle`: `tensor` views its `nbytes` bytes.
    `close` unmaps it (after this process's last read or write of it has finished)."""

    def __init__(self, handle: bytes, nbytes: int, device: torch.device) -> None:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        self._context = _Context(device)
        self.address = ctypes.c_uint64()
        with self._context:
            _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(self.address), _IpcHandle(handle),
                                                   LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        self.tensor = _view(self.address.value, nbytes, device)

    def close(self) -> None:
        if self.address.value:
            with self._context:
                _driver().cuIpcCloseMemHandle(self.address)
            self.address = ctypes.c_uint64()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
