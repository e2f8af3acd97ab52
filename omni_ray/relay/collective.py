"""Tensor relay over pairwise torch.distributed groups (NCCL between GPUs, gloo on CPU), made on demand per pair.

A producer replica and a consumer replica share a two-rank process group of their own, rendezvoused through a
TCPStore the producer hosts; there is no global group, so replicas join and leave freely. Per step message, a small
control header (request ids, tensor shapes, dtypes, byte offsets) travels on the host path, and the step's tensors
travel as one flat byte buffer over the pair's group, sent on a side stream. The receiver rebuilds the tensors on
its own device and delivers the message in order. A dead or silent peer fails only the requests in flight to it:
control sends fail at once, and a payload that does not complete within the timeout fails its message and tears the
pair down (NCCL does not notice a dead peer by itself).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
import uuid
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from omni_ray.relay.channel import RelayEndpoint, RelayMessage, RelayPeer
from omni_ray.relay.tcp import TcpTransport, node_ip

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorRef:
    """Where one relayed tensor sits in a step's flat byte buffer."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


ALIGN = 16  # every tensor starts at a multiple of this many bytes, so any dtype can view its slice


def pack(message: RelayMessage) -> tuple[RelayMessage, list[tuple[int, torch.Tensor]], int]:
    """Split a message into a tensor-free header (TensorRefs in place of tensors), the tensors with their byte
    offsets, and the buffer's total bytes."""
    tensors: list[tuple[int, torch.Tensor]] = []
    offset = 0
    items = []
    for item in message.items:
        refs: dict[str, Any] = {}
        for name, tensor in item.tensors.items():
            offset = -(-offset // ALIGN) * ALIGN
            refs[name] = TensorRef(offset, tuple(tensor.shape), tensor.dtype)
            tensors.append((offset, tensor))
            offset += tensor.numel() * tensor.element_size()
        items.append(replace(item, tensors={}, meta={**item.meta, "_tensor_refs": refs}))
    return replace(message, items=items), tensors, offset


def unpack(header: RelayMessage, buffer: torch.Tensor) -> RelayMessage:
    """Rebuild a message from its header and the received flat uint8 buffer (views, on the buffer's device)."""
    items = []
    for item in header.items:
        meta = dict(item.meta)
        refs: dict[str, TensorRef] = meta.pop("_tensor_refs", {})
        tensors = {}
        for name, ref in refs.items():
            nbytes = torch.Size(ref.shape).numel() * torch.empty(0, dtype=ref.dtype).element_size()
            tensors[name] = buffer[ref.offset : ref.offset + nbytes].view(ref.dtype).view(ref.shape)
        items.append(replace(item, tensors=tensors, meta=meta))
    return replace(header, items=items)


def flatten(
    tensors: list[tuple[int, torch.Tensor]], nbytes: int, device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every tensor's bytes at its offset in one contiguous uint8 buffer on `device` (or in `out`, nbytes long), zero
    padding between them, in one copy per run of consecutive tensors that sit on one device whatever their count: a
    run on `device` is joined straight into its place, a run elsewhere joined where it lives and crosses in one copy.
    The alignment padding is a view of a cached zero block, so it costs neither an allocation nor a kernel (a copy
    per tensor, or a join per padded one, meant kernel launches per request and step on the relay's thread)."""
    out = torch.empty(nbytes, dtype=torch.uint8, device=device) if out is None else out
    runs: list[tuple[int, list[torch.Tensor]]] = []  # (first byte, consecutive pieces on one device)
    end = 0
    for offset, tensor in tensors:
        piece = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if not runs or runs[-1][1][0].device != piece.device:
            runs.append((end, []))
        if offset > end:
            runs[-1][1].append(_padding(offset - end, piece.device))
        runs[-1][1].append(piece)
        end = offset + piece.numel()
    for start, pieces in runs:
        place = out[start : start + sum(piece.numel() for piece in pieces)]
        if len(pieces) > 1 and pieces[0].device == place.device:
            torch.cat(pieces, out=place)
        else:
            place.copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    if end < nbytes:
        out[end:nbytes].zero_()
    return out


_ZERO_BLOCKS: dict[torch.device, torch.Tensor] = {}


def _padding(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` zero bytes on `device`: a view of one cached block for alignment gaps (made and synchronized once, so
    any stream may read it), a new tensor for anything longer."""
    if nbytes > ALIGN:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    block = _ZERO_BLOCKS.get(device)
    if block is None:
        block = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _ZERO_BLOCKS[device] = block
    return block[:nbytes]


class _Pair:
    """One side of a two-rank group, with a single worker thread so that its sends (or receives) stay in order."""

    def __init__(self, pair_id: str, rank: int, backend: str, device: torch.device, timeout_s: float) -> None:
        self.pair_id = pair_id
        self.rank = rank
        self.backend = backend
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"relay-{pair_id[:8]}")
        self.group: Any = None
        self.store: Any = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.broken: Exception | None = None
        self.lost: Future[None] = Future()  # set when the pair is torn down: waiting sends give up

    def host_store(self, host: str) -> int:
        """Rank 0: start the pair's TCPStore on a free port (returns at once) and say which port."""
        self.store = dist.TCPStore(host, 0, 2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        return int(self.store.port)

    def connect(self, host: str, port: int) -> None:
        """Blocking rendezvous (in the worker): both ranks construct the group over the producer's store."""
        if self.store is None:
            self.store = dist.TCPStore(host, port, 2, is_master=False, timeout=self.timeout)
        prefixed = dist.PrefixStore(self.pair_id, self.store)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(prefixed, self.rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, self.rank, 2, self.timeout)

    def send(self, tensors: list[tuple[int, torch.Tensor]], nbytes: int) -> None:
        """The tensors as one flat buffer, gathered and sent on the pair's stream. They are complete (see RelayItem),
        so nothing here waits for the work the producer has queued since."""
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            buffer = flatten(tensors, nbytes, self.device)
            work = self.group.send([buffer], 1 - self.rank, 0)
            if not work.wait(self.timeout):
                raise TimeoutError(f"relay payload to the peer did not complete within {self.timeout}")
            if self.stream is not None:
                self.stream.synchronize()

    def recv(self, nbytes: int) -> torch.Tensor:
        """The next payload, in a buffer allocated on the pair's stream (the receiver hands it over to the
        consumer's streams: `RelayEndpoint.hand_over`)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            work = self.group.recv([buffer], 1 - self.rank, 0)
            if not work.wait(self.timeout):
                raise TimeoutError(f"relay payload from the peer did not arrive within {self.timeout}")
            if self.stream is not None:
                self.stream.synchronize()
        return buffer

    def close(self) -> None:
        """Tear the group down without waiting on the peer (it may be gone)."""
        if not self.lost.done():
            self.lost.set_result(None)
        group, self.group = self.group, None
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except Exception:  # already broken: nothing left to release
                log.debug("abort of relay pair %s failed", self.pair_id, exc_info=True)
        self.worker.shutdown(wait=False, cancel_futures=True)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class CollectiveTransport:
    """Producer side: `send(peer, message)` ships the header on the host path and the tensors over the pair group."""

    def __init__(self, device: torch.device | str, control: TcpTransport | None = None, timeout_s: float = 10.0) -> None:
        self.device = torch.device(device)
        self.control = control or TcpTransport()
        self.timeout_s = timeout_s
        self.pairs: dict[str, _Pair] = {}
        self.host = node_ip()

    async def send(self, peer: RelayPeer, message: RelayMessage) -> None:
        pair = self.pairs.get(peer.replica_id)
        try:
            if pair is None:
                pair = await self._open(peer)
            header, tensors, nbytes = pack(message)
            header.sent_at = time.time()
            await self.control.send(peer, _control(message.sender, "payload", pair.pair_id, header=header, nbytes=nbytes))
            if nbytes == 0:  # e.g. only end markers: the header is the whole message
                return
            payload = asyncio.wrap_future(pair.worker.submit(pair.send, tensors, nbytes))
            lost = asyncio.wrap_future(pair.lost)
            await asyncio.wait({payload, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not payload.done():  # NCCL would not notice: the host path saw the peer go
                payload.cancel()
                raise ConnectionError(f"relay peer {peer.replica_id} went away during a transfer")
            payload.result()
        except Exception:
            self.drop(peer.replica_id)
            raise

    async def _open(self, peer: RelayPeer) -> _Pair:
        pair = _Pair(uuid.uuid4().hex, 0, backend_for(self.device), self.device, self.timeout_s)
        store_port = pair.host_store(self.host)
        connected: Future[None] = pair.worker.submit(pair.connect, self.host, store_port)
        self.pairs[peer.replica_id] = pair
        await self.control.send(peer, _control("", "join", pair.pair_id, store=(self.host, store_port),
                                               backend=pair.backend))
        await asyncio.wait({asyncio.wrap_future(connected), asyncio.wrap_future(pair.lost)},
                           return_when=asyncio.FIRST_COMPLETED)
        if not connected.done():
            raise ConnectionError(f"relay peer {peer.replica_id} went away during the rendezvous")
        connected.result()
        return pair

    def drop(self, replica_id: str) -> None:
        """Forget (and abort) the pair with a peer: the next send rendezvouses again."""
        pair = self.pairs.pop(replica_id, None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        for replica_id in list(self.pairs):
            self.drop(replica_id)


class CollectiveReceiver:
    """Consumer side: handles the control messages that the host path delivers to a replica's endpoint."""

    def __init__(self, endpoint: RelayEndpoint, device: torch.device | str, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        endpoint.on_control(("join", "payload"), self.handle)

    def handle(self, message: RelayMessage) -> None:
        """Called on the event loop for each control message, in arrival order."""
        self._loop = asyncio.get_running_loop()
        control = message.control or {}
        op, pair_id = control.get("op"), control.get("pair", "")
        if op == "join":
            pair = _Pair(pair_id, 1, control["backend"], self.device, self.timeout_s)
            with self._lock:
                self.pairs[pair_id] = pair
            host, port = control["store"]
            pair.worker.submit(pair.connect, host, port)
        elif op == "payload":
            pair = self.pairs.get(pair_id)
            header: RelayMessage = control["header"]
            header.arrived_at = message.arrived_at
            if pair is None:
                self._deliver(_failed(header, "relay payload for an unknown pair"))
                return
            pair.worker.submit(self._receive, pair, header, int(control["nbytes"]))

    def _receive(self, pair: _Pair, header: RelayMessage, nbytes: int) -> None:
        try:
            if pair.broken is not None:
                raise pair.broken
            buffer = pair.recv(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8, device=self.device)
            self.endpoint.hand_over(buffer)
            message = unpack(header, buffer)  # in the pair's order, even when it carries no tensors
        except Exception as exc:  # the producer died or stalled: fail these requests, drop the pair
            log.warning("relay receive on pair %s failed: %s", pair.pair_id, exc)
            pair.broken = exc
            message = _failed(header, f"relay from {header.sender} failed: {exc}")
        self._deliver(message)

    def _deliver(self, message: RelayMessage) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.endpoint.deliver, message)

    def close(self) -> None:
        with self._lock:
            pairs, self.pairs = list(self.pairs.values()), {}
        for pair in pairs:
            pair.close()


def _control(sender: str, op: str, pair_id: str, **fields: Any) -> RelayMessage:
    return RelayMessage(sender, [], control={"op": op, "pair": pair_id, **fields})


def _failed(header: RelayMessage, reason: str) -> RelayMessage:
    """The header's requests as error items (same sequence numbers, so the endpoint's order check holds)."""
    return RelayMessage(header.sender, [replace(item, kind="error", tensors={}, meta={"message": reason})
                                        for item in header.items])
