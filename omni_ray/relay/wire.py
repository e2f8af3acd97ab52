"""The host path's frame format: a msgpack body with a fixed registry of extension types, tensors as raw out-of-band
buffers. Decoding a frame builds only the registered types (data, never code); anything else is a `RelayWireError`.

A frame: (body length, buffer count), each buffer's length (big-endian u64s), the msgpack body, then each buffer from
an offset of the frame aligned to BUFFER_ALIGN bytes (so a tensor read in place is aligned for its dtype). A CPU
tensor in the body is (buffer index, dtype name, shape); the frame carries the tensor's own bytes (no copy on the
sending side) and the receiver's tensor is a view of its frame."""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, Union

import msgpack
import numpy as np
import torch

from omni_ray.relay.channel import RelayItem, RelayMessage, RelayPeer

FIXED = struct.Struct("!QI")
BUFFER_ALIGN = 64
# Caps on what a frame's header may announce, checked before anything is allocated for it.
MAX_BUFFERS = 1 << 16
MAX_BODY_BYTES = 64 << 20
MAX_FRAME_BYTES = 1 << 30
MAX_NESTING = 32  # extension types inside extension types (a control message's header holds items, and so on)
Part = Union[bytes, bytearray, memoryview]


class RelayWireError(ValueError):
    """A frame that is not a well-formed relay message: truncated, oversized, or naming what the format lacks."""


# The body is a message's fields: [sender, items, control, queued_at, sent_at, arrived_at], each item as
# [request_id, kind, {name: tensor}, meta, seq], each of an item's tensors as [buffer index, dtype name, shape].
# Values elsewhere (control fields, meta) are msgpack's own types or these extension types, by code, whose payloads
# are msgpack arrays of the fields named.
EXT_MESSAGE = 1  # a RelayMessage inside a control message (a transport's header): the body's fields
EXT_PEER = 3  # RelayPeer: replica_id, address, device, gpu_uuid
EXT_TENSOR_REF = 4  # collective.TensorRef: offset, shape, dtype name
EXT_TUPLE = 5  # a tuple (or torch.Size): its elements
EXT_DTYPE = 6  # torch.dtype: its name
EXT_DEVICE = 7  # torch.device: its str
EXT_TENSOR = 8  # a CPU tensor outside an item's tensors: buffer index, dtype name, shape
EXT_CLASS = 9  # one of the classes in a CUDA IPC handle: its name

DTYPES: dict[str, torch.dtype] = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
)}
ITEMSIZES = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in DTYPES.items()}
# How a received buffer becomes a tensor without torch's slower frombuffer: numpy's view of it, then a torch view
# (bfloat16 has no numpy dtype: its bytes are read as int16 and viewed as bfloat16).
NUMPY_DTYPES = {"bfloat16": np.dtype(np.int16), **{name: np.dtype(str(dtype).removeprefix("torch."))
                for name, dtype in DTYPES.items() if name != "bfloat16"}}
DEVICE_TYPES = ("cpu", "cuda")
# The classes a CUDA IPC handle names (`torch.multiprocessing.reductions.reduce_tensor`): the tensor's and storage's.
CLASSES: dict[str, type] = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in (
    torch.Tensor, torch.UntypedStorage, torch.storage.TypedStorage,
)}


def _tensor_ref_type() -> type:
    from omni_ray.relay.collective import TensorRef  # collective imports the transports that import this module

    return TensorRef


def _packb(value: Any, default: Callable[[Any], Any]) -> bytes:
    return msgpack.packb(value, default=default, use_bin_type=True, strict_types=True)


def _tensor_fields(tensor: torch.Tensor, buffers: list[memoryview]) -> list[Any]:
    """[buffer index, dtype name, shape], the tensor's bytes (a view, not a copy, of a contiguous CPU tensor) appended
    to `buffers`."""
    name = _dtype_name(tensor.dtype)
    if tensor.requires_grad or tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.detach().cpu().contiguous()
    if tensor.numel() == 0:
        buffers.append(memoryview(b""))
    else:  # numpy's view of the bytes (bfloat16, which numpy lacks, as int16): fewer torch calls than a uint8 view
        buffers.append(memoryview((tensor.view(torch.int16) if name == "bfloat16" else tensor).numpy()).cast("B"))
    return [len(buffers) - 1, name, list(tensor.shape)]


def _message_fields(message: RelayMessage, buffers: list[memoryview]) -> list[Any]:
    items = [[item.request_id, item.kind, {name: _tensor_fields(t, buffers) for name, t in item.tensors.items()},
              item.meta, item.seq] for item in message.items]
    return [message.sender, items, message.control, message.queued_at, message.sent_at, message.arrived_at]


def _encoder(buffers: list[memoryview]) -> Callable[[Any], Any]:
    """msgpack's `default` hook for one frame: the registered types as extension types (CPU tensors' bytes appended
    to `buffers`); anything else is a TypeError."""
    tensor_ref = _tensor_ref_type()

    def default(value: Any) -> Any:
        kind = type(value)
        if kind is tuple or kind is torch.Size:
            return msgpack.ExtType(EXT_TUPLE, _packb(list(value), default))
        if kind is RelayMessage:
            return msgpack.ExtType(EXT_MESSAGE, _packb(_message_fields(value, buffers), default))
        if kind is RelayPeer:
            return msgpack.ExtType(EXT_PEER, _packb([value.replica_id, value.address, value.device, value.gpu_uuid],
                                                   default))
        if kind is tensor_ref:
            return msgpack.ExtType(EXT_TENSOR_REF, _packb([value.offset, list(value.shape), _dtype_name(value.dtype)],
                                                          default))
        if kind is torch.dtype:
            return msgpack.ExtType(EXT_DTYPE, _dtype_name(value).encode())
        if kind is torch.device:
            return msgpack.ExtType(EXT_DEVICE, str(value).encode())
        if isinstance(value, torch.Tensor):
            return msgpack.ExtType(EXT_TENSOR, _packb(_tensor_fields(value, buffers), default))
        if isinstance(value, type) and value in CLASSES.values():
            return msgpack.ExtType(EXT_CLASS, f"{value.__module__}.{value.__qualname__}".encode())
        raise TypeError(f"the relay's wire format has no place for a {kind.__module__}.{kind.__qualname__}")

    return default


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"the relay does not carry {dtype} tensors")
    return name


def _aligned(offset: int) -> int:
    return -(-offset // BUFFER_ALIGN) * BUFFER_ALIGN


def header_size(count: int) -> int:
    return FIXED.size + 8 * count


def frame_layout(body_length: int, sizes: tuple[int, ...]) -> tuple[list[int], int]:
    """Each buffer's offset in the frame, and the frame's length."""
    offsets, end = [], header_size(len(sizes)) + body_length
    for size in sizes:
        start = _aligned(end)
        offsets.append(start)
        end = start + size
    return offsets, end


def check_announced(body_length: int, count: int, sizes: tuple[int, ...] = ()) -> int:
    """The frame length a header announces, or RelayWireError when it is over the caps (checked before reading or
    allocating the rest)."""
    if count > MAX_BUFFERS or body_length > MAX_BODY_BYTES:
        raise RelayWireError(f"relay frame header out of bounds ({count} buffers, a {body_length}-byte body)")
    length = frame_layout(body_length, sizes)[1] if sizes else header_size(count) + body_length
    if length > MAX_FRAME_BYTES:
        raise RelayWireError(f"relay frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte cap")
    return length


def encode_message(message: RelayMessage) -> list[Part]:
    """A message as the parts of one frame, in order: its header and msgpack body, then each tensor's bytes (views of
    the tensors, not copies) after the padding that aligns them. TypeError for a value the format has no place for."""
    buffers: list[memoryview] = []
    body = _packb(_message_fields(message, buffers), _encoder(buffers))
    sizes = tuple(buffer.nbytes for buffer in buffers)
    offsets, _ = frame_layout(len(body), sizes)
    parts: list[Part] = [FIXED.pack(len(body), len(buffers)) + struct.pack(f"!{len(sizes)}Q", *sizes), body]
    end = header_size(len(sizes)) + len(body)
    for buffer, offset in zip(buffers, offsets):
        if offset > end:
            parts.append(bytes(offset - end))
        parts.append(buffer)
        end = offset + buffer.nbytes
    return parts


class _Decoder:
    """msgpack's `ext_hook` for one frame: builds the registered types, checking every field."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.depth = 0
        self.tensor_ref = _tensor_ref_type()

    def unpack(self, data: bytes) -> Any:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise RelayWireError("relay frame nests too deep")
        try:
            return msgpack.unpackb(data, ext_hook=self.ext, raw=False, strict_map_key=False)  # keys as encoded
        finally:
            self.depth -= 1

    def fields(self, data: bytes, count: int) -> list[Any]:
        value = self.unpack(data)
        if type(value) is not list or len(value) != count:
            raise RelayWireError(f"relay frame: expected {count} fields")
        return value

    def message(self, fields: Any) -> RelayMessage:
        if type(fields) is not list or len(fields) != 6:
            raise RelayWireError("relay frame: a message has 6 fields")
        sender, items, control, queued_at, sent_at, arrived_at = fields
        _expect(sender, str), _expect(items, list), _expect(control, (dict, type(None)))
        return RelayMessage(sender, [self.item(item) for item in items], control, _number(queued_at),
                            _number(sent_at), _number(arrived_at))

    def item(self, fields: Any) -> RelayItem:
        if type(fields) is not list or len(fields) != 5:
            raise RelayWireError("relay frame: an item has 5 fields")
        request_id, kind, tensors, meta, seq = fields
        _expect(request_id, str), _expect(kind, str), _expect(tensors, dict), _expect(meta, dict), _expect(seq, int)
        return RelayItem(request_id, kind, {name: self.tensor_from(t) for name, t in tensors.items()}, meta, seq)

    def tensor_from(self, fields: Any) -> torch.Tensor:
        if type(fields) is not list or len(fields) != 3:
            raise RelayWireError("relay frame: a tensor has 3 fields")
        index, dtype, shape = fields
        return self.tensor(index, dtype, _shape(shape))

    def ext(self, code: int, data: bytes) -> Any:
        if code == EXT_MESSAGE:
            return self.message(self.unpack(data))
        if code == EXT_TUPLE:
            value = self.unpack(data)
            _expect(value, list)
            return tuple(value)
        if code == EXT_PEER:
            fields = self.fields(data, 4)
            for field in fields:
                _expect(field, str)
            return RelayPeer(*fields)
        if code == EXT_TENSOR_REF:
            offset, shape, dtype = self.fields(data, 3)
            return self.tensor_ref(_non_negative(offset), _shape(shape), _dtype(dtype))
        if code == EXT_DTYPE:
            return _dtype(_text(data))
        if code == EXT_DEVICE:
            return _device(_text(data))
        if code == EXT_TENSOR:
            return self.tensor_from(self.unpack(data))
        if code == EXT_CLASS:
            name = _text(data)
            if name not in CLASSES:
                raise RelayWireError(f"relay frame names a class it may not carry: {name[:80]!r}")
            return CLASSES[name]
        raise RelayWireError(f"relay frame has an unknown extension type {code}")

    def tensor(self, index: Any, dtype: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor over its buffer's bytes (a view of the frame)."""
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise RelayWireError(f"relay frame: tensor buffer {index!r} does not exist")
        data, torch_dtype = self.buffers[index], _dtype(dtype)
        if math.prod(shape) * ITEMSIZES[dtype] != data.nbytes:
            raise RelayWireError(f"relay frame: a {dtype} tensor of shape {shape} does not fit its {data.nbytes} bytes")
        if data.nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        if data.readonly:  # torch wants a writable buffer
            data = memoryview(bytearray(data))
        tensor = torch.from_numpy(np.frombuffer(data, dtype=NUMPY_DTYPES[dtype]).reshape(shape))
        return tensor.view(torch_dtype) if tensor.dtype != torch_dtype else tensor


def _expect(value: Any, kind: type | tuple[type, ...]) -> None:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise RelayWireError(f"relay frame: unexpected {type(value).__name__}")


def _number(value: Any) -> float:
    if type(value) not in (int, float):
        raise RelayWireError(f"relay frame: expected a number, got {type(value).__name__}")
    return float(value)


def _non_negative(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise RelayWireError("relay frame: expected a non-negative integer")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    if type(value) is not list or len(value) > 16:
        raise RelayWireError("relay frame: a tensor's shape must be a list of at most 16 sizes")
    return tuple(_non_negative(size) for size in value)


def _text(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise RelayWireError("relay frame: a name is not UTF-8") from exc


def _dtype(name: Any) -> torch.dtype:
    if type(name) is not str or name not in DTYPES:
        raise RelayWireError(f"relay frame names a dtype it may not carry: {str(name)[:40]!r}")
    return DTYPES[name]


def _device(name: str) -> torch.device:
    kind, _, index = name.partition(":")
    if kind not in DEVICE_TYPES or index and not (index.isdigit() and len(index) <= 4):
        raise RelayWireError(f"relay frame names a device it may not carry: {name[:40]!r}")
    return torch.device(name)


def decode_message(frame: Union[bytes, bytearray, memoryview]) -> RelayMessage:
    """One whole frame (`encode_message`'s parts joined) back into a message, or RelayWireError. Its tensors view
    the frame's bytes (pass a bytearray to keep them writable without a copy)."""
    try:
        view = memoryview(frame).cast("B")
        if view.nbytes < FIXED.size:
            raise RelayWireError("relay frame shorter than its header")
        body_length, count = FIXED.unpack_from(view)
        check_announced(body_length, count)
        if view.nbytes < header_size(count):
            raise RelayWireError("relay frame shorter than its header")
        sizes = struct.unpack_from(f"!{count}Q", view, FIXED.size)
        length = check_announced(body_length, count, sizes)
        if length != view.nbytes:
            raise RelayWireError(f"relay frame of {view.nbytes} bytes announces {length}")
        start = header_size(count)
        offsets, _ = frame_layout(body_length, sizes)
        buffers = [view[offset : offset + size] for offset, size in zip(offsets, sizes)]
        decoder = _Decoder(buffers)
        return decoder.message(decoder.unpack(view[start : start + body_length]))
    except RelayWireError:
        raise
    except Exception as exc:  # msgpack's own errors, a hook's check, a field's type: one error class for all
        raise RelayWireError(f"relay frame does not decode: {type(exc).__name__}: {exc}") from exc
