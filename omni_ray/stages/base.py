"""StageBase: what every stage replica has: an id, a relay endpoint/sender and per-request event streams."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from omni_ray.config import StageResources
from omni_ray.engine.profiling import cuda_allocator_stats, host_range
from omni_ray.gc_pauses import process_gc_pauses
from omni_ray.relay import (
    LOCAL_ENDPOINTS, PlacementTransport, RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelaySender, RelayServer,
)
from omni_ray.relay.collective import CollectiveReceiver
from omni_ray.relay.ipc import IpcReceiver
from omni_ray.relay.tcp import LISTEN_HOST_ENV, node_ip
from omni_ray.relay.transports import RelayMode, device_bytes, gpu_uuid
from omni_ray.serve.stats import StatsReporter, serve_replica_id

FINAL_TYPES = frozenset({"final", "error"})
HELD_AFTER_END_S = 60.0  # how long a finished request's relay items wait for a consumer not yet named


def process_age_s() -> float | None:
    """Seconds since this process started, to the clock's tick (Linux's /proc); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start time after boot
        with open("/proc/stat") as stat:
            boot = next(int(line.split()[1]) for line in stat if line.startswith("btime "))
        return time.time() - (boot + started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo and inductor, loads from their caches
    included), from torch's own timing; 0 where this torch keeps none."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(sum(times) for name, times in list(compilation_time_metrics.items())
                     if name.endswith("compile_inner")))


class StageBase:
    """Event streams are asyncio queues filled from engine threads via `emit` and drained by `stream`."""

    stage_name = "stage"

    def __init__(self, replica_id: str | None = None, device: str = "cpu", relay_mode: RelayMode = "auto",
                 relay_listen_host: str | None = None) -> None:
        self.replica_id = replica_id or serve_replica_id() or f"{self.stage_name}-{uuid.uuid4().hex[:8]}"
        self.device = torch.device(device)
        self.relay_mode: RelayMode = relay_mode
        # where the host-path listener binds: the stage's `relay_listen_host`, which the Serve app and the Python API
        # hand each replica in its environment; empty: the node's address
        self.relay_listen_host = relay_listen_host if relay_listen_host is not None else os.environ.get(
            LISTEN_HOST_ENV, "")
        self.endpoint = RelayEndpoint()
        self._receiver: CollectiveReceiver | None = None
        self._ipc_receiver: IpcReceiver | None = None
        self._server: RelayServer | None = None
        self._peer_lock = asyncio.Lock()
        self._streams: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._sender: RelaySender | None = None
        self._self_peer: RelayPeer | None = None
        self._consumers: dict[str, RelayPeer] = {}  # request id -> the replica its relay items go to
        self._held: dict[str, list[RelayItem]] = {}  # items of requests whose consumer is not named yet
        self._held_after_end: dict[str, float] = {}  # finished requests still holding items: until when
        self.completed = 0
        self.failed = 0
        self.off_loop = 0  # requests whose blocking work runs on a worker thread now (`run_off_loop`)
        self._reporter: Any = None
        # seconds per startup phase, for /metrics: "process" (from the process's start to here: imports, the Ray
        # worker), then the stage's own ("load", "warmup")
        age = process_age_s()
        self.startup_s: dict[str, float] = {} if age is None else {"process": age}
        self.gc_pauses = process_gc_pauses()
        if self.device.type == "cuda":
            warm_host_copy(self.device)

    @contextmanager
    def startup_phase(self, name: str) -> Iterator[None]:
        """Time a phase of this replica's startup (its device work included) into `startup_s[name]`, and what of it
        torch.compile took into `startup_s["compile"]`."""
        started, compiled_before = time.perf_counter(), compile_seconds()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_s[name] = self.startup_s.get(name, 0.0) + time.perf_counter() - started
        compiling = compile_seconds() - compiled_before
        if compiling > 0:
            self.startup_s["compile"] = self.startup_s.get("compile", 0.0) + compiling

    def startup_done(self, resources: StageResources) -> None:
        """The end of a stage's constructor: freeze what startup left out of the garbage collector's way if the
        stage's resources ask for it, then, under Serve, post this replica's load to the stats board (for /metrics
        and /ready)."""
        if resources.gc_freeze_after_startup:
            self.gc_pauses.freeze_startup_objects()
        if serve_replica_id() is not None and self._reporter is None:
            self._reporter = StatsReporter(self.replica_id, self.load_stats)

    def load_stats(self) -> dict[str, Any]:
        """What this replica is doing now, its startup by phase, its process's garbage-collector pauses and CUDA
        allocator retries, and the relay connections it refused. Stages with an engine add running/waiting/KV
        numbers."""
        return {"stage": self.stage_name, "streams": self.active_requests(), "completed": self.completed,
                "failed": self.failed, "load": self.active_requests(),
                **{f"startup_{phase}_s": seconds for phase, seconds in self.startup_s.items()},
                **self.gc_pauses.stats(), **cuda_allocator_stats(),
                "relay_rejected": self._server.rejected if self._server is not None else 0}

    async def stats(self) -> dict[str, Any]:
        return self.load_stats()

    async def run_off_loop(self, work: Callable[..., Any], *args: Any) -> Any:
        """One request's blocking work (an encoder's) on a worker thread; counted in `off_loop` while it runs (what
        such a stage reports as its load) and in `completed` / `failed` after."""
        self.off_loop += 1
        try:
            result = await asyncio.to_thread(work, *args)
        except Exception:
            self.failed += 1
            raise
        finally:
            self.off_loop -= 1
        self.completed += 1
        return result

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: the stage's own load signal."""
        stats = self.load_stats()
        metrics = {"load": float(stats["load"])}
        if stats.get("kv_total"):
            metrics["kv_occupancy"] = stats["kv_used"] / stats["kv_total"]
        return metrics

    def check_health(self) -> None:
        """Serve's health check (every `health_check_period_s`): a replica whose engine's device is stuck or lost
        fails it (`EngineLoop.check_health`), and Serve replaces the replica."""
        engine = getattr(self, "engine", None)
        if engine is not None and hasattr(engine, "check_health"):
            engine.check_health()

    # ---- relay -------------------------------------------------------------------------------------------
    async def relay_peer(self) -> RelayPeer:
        """This replica's relay address; the listener starts on first use (on the replica's event loop)."""
        self._bind_loop()
        async with self._peer_lock:
            if self._self_peer is None:
                self._server = RelayServer(self.endpoint)
                listen = self.relay_listen_host or node_ip()
                wildcard = listen in ("0.0.0.0", "::")  # every interface: peers are told the node's address
                address = await self._server.start(listen, node_ip() if wildcard else None)
                self._receiver = CollectiveReceiver(self.endpoint, self.device)
                if self.device.type == "cuda":  # producers on this GPU may share buffers through CUDA IPC
                    self._ipc_receiver = IpcReceiver(self.endpoint, self.device)
                self.endpoint.on_control(("consumer",), self._on_consumer)
                LOCAL_ENDPOINTS[self.replica_id] = self.endpoint
                self._self_peer = RelayPeer(self.replica_id, address, str(self.device), gpu_uuid(self.device))
        return self._self_peer

    async def ready_event(self) -> dict[str, Any]:
        """First event of every stage stream: where this replica receives relay messages."""
        return {"type": "ready", "peer": await self.relay_peer(), "t": time.time()}

    @property
    def sender(self) -> RelaySender:
        if self._sender is None:
            self._sender = RelaySender(self.replica_id, PlacementTransport(self.device, self.relay_mode), self._relay_failed)
        return self._sender

    def _relay_failed(self, request_ids: list[str], error: Exception) -> None:
        for rid in request_ids:
            self.fail(rid, f"relay to the next stage failed: {error}")

    # ---- streams -----------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        if self._event_loop is None:
            self._event_loop = asyncio.get_running_loop()

    def open_stream(self, request_id: str) -> None:
        self._bind_loop()
        if request_id in self._streams:
            raise ValueError(f"request {request_id} is already running on {self.replica_id}")
        self._streams[request_id] = asyncio.Queue()

    def emit(self, request_id: str, event: dict[str, Any]) -> None:
        """Thread-safe: queue an event for the request's stream (dropped if the stream is gone)."""
        self.emit_all([(request_id, event)])

    def emit_all(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Thread-safe: `emit` for a whole engine step's (request id, event) pairs in one hand-over to the event loop
        (one wake-up per step, not one per request)."""
        now = time.time()
        for _, event in events:
            event.setdefault("t", now)
        loop = self._event_loop
        if loop is None or not events:
            return
        loop.call_soon_threadsafe(self._put_all, events)

    def _put_all(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        for request_id, event in events:
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(event)

    def fail(self, request_id: str, message: str) -> None:
        self.emit(request_id, {"type": "error", "message": message})

    async def stream(self, request_id: str) -> AsyncIterator[list[dict[str, Any]]]:
        """Yield the request's events until its final (or error) event, in batches: everything queued when the
        consumer asks goes as one item (one event when it keeps up; a consumer that lags, such as a busy ingress,
        gets fewer, larger items instead of a growing backlog). Always closes the stream."""
        queue = self._streams[request_id]
        try:
            while True:
                batch = [await queue.get()]
                while batch[-1]["type"] not in FINAL_TYPES and not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
                last = batch[-1]["type"]
                if last in FINAL_TYPES:
                    if last == "final":
                        self.completed += 1
                    else:
                        self.failed += 1
                    return
        finally:
            self._streams.pop(request_id, None)

    def active_requests(self) -> int:
        return len(self._streams)

    # ---- identity ----------------------------------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "stage": self.stage_name, "peer": await self.relay_peer()}

    def __del__(self) -> None:
        """Serve calls this when a replica goes (after draining its streams): tear down this replica's relay groups."""
        try:
            if self._sender is not None:
                self._sender.transport.close()
            if self._receiver is not None:
                self._receiver.close()
            if self._ipc_receiver is not None:
                self._ipc_receiver.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass

    async def relay_stats(self) -> dict[str, int]:
        """Open relay channels (pairwise groups out and in, host-path connections) and CUDA IPC messages shared and
        received."""
        transport = self._sender.transport if self._sender is not None else None
        return {
            "collective_pairs": len(transport.collective.pairs) if transport is not None else 0,
            "collective_pairs_in": len(self._receiver.pairs) if self._receiver is not None else 0,
            "host_connections": len(transport.tcp.connections) if transport is not None else 0,
            "ipc_shared": transport.ipc.shared if transport is not None and transport.ipc is not None else 0,
            "ipc_received": self._ipc_receiver.received if self._ipc_receiver is not None else 0,
        }

    # ---- where a request's relay items go ----------------------------------------------------------------
    def expect_consumer(self, request_id: str) -> None:
        """The caller will name the request's consumer (`RelayLinks.connect`) once both streams are open: hold its
        items until then. Call on the event loop."""
        self._held[request_id] = []
        now = time.monotonic()
        for rid in [r for r, until in self._held_after_end.items() if until < now]:  # their consumer never came
            self._held_after_end.pop(rid)
            self._held.pop(rid, None)

    def forget_consumer(self, request_id: str, finished: bool = False) -> None:
        """The request's stream here ended. A `finished` one whose consumer is not named yet keeps its held items a
        while (a short reply can end before its consumer is named); an aborted one drops them."""
        self._consumers.pop(request_id, None)
        if finished and request_id in self._held:
            self._held_after_end[request_id] = time.monotonic() + HELD_AFTER_END_S
        else:
            self._held.pop(request_id, None)

    def _on_consumer(self, message: RelayMessage) -> None:
        control = message.control or {}
        rid, peer = control["request"], control["peer"]
        held = self._held.pop(rid, None)
        if held is None:  # the request is gone already
            return
        self._consumers[rid] = peer
        self._route([(None, item) for item in held])
        if self._held_after_end.pop(rid, None) is not None:  # its stream here has ended: nothing more will come
            self._consumers.pop(rid, None)

    def relay_to_consumers(self, items: list[RelayItem]) -> None:
        """From an engine thread: each item to its request's consumer. Tensors bound for a host-path peer are copied
        to the CPU here, so the event loop never waits on the device; a collective or CUDA IPC peer gets them as they
        are. On one GPU the transport goes by the size of the step's message to each peer (`needs_host_tensors`)."""
        if self._event_loop is None or not items:
            return
        transport = self.sender.transport
        peers = [self._consumers.get(item.request_id) for item in items]
        bound: dict[str, tuple[RelayPeer, list[RelayItem]]] = {}  # each peer's message this step
        for peer, item in zip(peers, items):
            if peer is not None:
                bound.setdefault(peer.replica_id, (peer, []))[1].append(item)
        to_host = {rid for rid, (peer, mine) in bound.items() if transport.needs_host_tensors(peer, device_bytes(mine))}
        on_host = [i for i, peer in enumerate(peers) if peer is not None and peer.replica_id in to_host]
        items = list(items)
        with host_range("relay: host copies"):
            for i, copied in zip(on_host, host_copies([items[i] for i in on_host])):  # one wait for the whole step
                items[i] = copied
        self._event_loop.call_soon_threadsafe(self._route, list(zip(peers, items)))

    def send_to_consumer(self, request_id: str, kind: str = "end", **meta: Any) -> None:
        """An end or error marker for the request's consumer. Call on the event loop."""
        self._route([(None, RelayItem(request_id, kind=kind, meta=meta))])

    def has_consumer(self, request_id: str) -> bool:
        return request_id in self._consumers or request_id in self._held

    def _route(self, routed: list[tuple[RelayPeer | None, RelayItem]]) -> None:
        """On the event loop: ship what has a consumer, hold what waits for one, drop the rest (requests without one)."""
        ready = []
        transport = self.sender.transport
        for peer, item in routed:
            if peer is None and (peer := self._consumers.get(item.request_id)) is not None:
                item = host_copy(item) if transport.needs_host_tensors(peer, device_bytes([item])) else item
            if peer is not None:
                ready.append((peer, item))
            elif item.request_id in self._held:
                self._held[item.request_id].append(item)
        if ready:
            self.relay_step(ready)

    def relay_step(self, items: list[tuple[RelayPeer, RelayItem]]) -> None:
        """Ship one engine step's relay items: one message per consumer replica, with every request bound there.
        Call on the event loop thread."""
        batches: dict[str, tuple[RelayPeer, list[RelayItem]]] = {}
        for peer, item in items:
            batches.setdefault(peer.replica_id, (peer, []))[1].append(item)
        for peer, group in batches.values():
            self.sender.send(peer, group)

    def send_end(self, peer: RelayPeer | None, request_id: str, kind: str = "end", **meta: Any) -> None:
        if peer is not None:
            self.sender.send(peer, [RelayItem(request_id, kind=kind, meta=meta)])


class _HostStaging:
    """Per device: a side stream and a pinned host buffer (grown as needed, reused) that a step's relay tensors are
    copied into together."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pinned = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self.lock = threading.Lock()  # lanes' engine threads may hand on outputs at once

    def host_bytes(self, nbytes: int) -> torch.Tensor:
        if self.pinned.numel() < nbytes:
            self.pinned = torch.empty(max(nbytes, 2 * self.pinned.numel()), dtype=torch.uint8, pin_memory=True)
        return self.pinned[:nbytes]


_STAGING: dict[torch.device, _HostStaging] = {}


def host_copy(item: RelayItem) -> RelayItem:
    """`host_copies` of one item."""
    return host_copies([item])[0]


def host_copies(items: list[RelayItem]) -> list[RelayItem]:
    """The items with their tensors on the CPU. A step's device tensors (complete, see RelayItem) are copied into a
    reused pinned buffer on a side stream (a copy on the producer's stream would wait for everything queued since,
    such as its next step), one copy per storage they view (`copy_by_storage`); the host waits once, copies the
    buffer once, and each tensor is a view of that copy. Per step: a copy per storage, one wait, whatever the item
    count. A gather kernel into one buffer (an earlier design) needed SMs, which under MPS it may wait for behind the
    other processes' kernels. Copied one by one, the 1-GPU service's Thinker made about 30 copies, event records
    and pinned allocations per step at batch 32, each CUDA call 10-30 us under MPS (in a profile inside the
    service). A process's first copy waited for the queued work on an H200, so a stage on a GPU makes one at
    startup (`warm_host_copy`). Used where the next stage is on the host path (TCP): by default, two processes
    sharing one GPU (Thinker → Talker in the 1-GPU layout)."""
    on_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    tensors: list[dict[str, torch.Tensor]] = [dict(item.tensors) for item in items]
    moved: set[int] = set()  # items with a tensor not on the CPU
    for index, item in enumerate(items):
        for name, tensor in item.tensors.items():
            if tensor.device.type == "cpu":
                continue
            moved.add(index)
            if tensor.device.type == "cuda":
                on_device.setdefault(tensor.device, []).append((index, name, tensor))
            else:
                tensors[index][name] = tensor.cpu()
    for device, found in on_device.items():
        for (index, name, _), copied in zip(found, _stage_to_host(device, [t for _, _, t in found])):
            tensors[index][name] = copied
    return [RelayItem(item.request_id, item.kind, tensors[index], item.meta, item.seq) if index in moved else item
            for index, item in enumerate(items)]


def _stage_to_host(device: torch.device, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of complete tensors on one device, through the device's staging buffer on its side stream."""
    staging = _STAGING.get(device)
    if staging is None:
        staging = _STAGING.setdefault(device, _HostStaging(device))
    with staging.lock, torch.cuda.stream(staging.stream):
        return copy_by_storage(found, staging.host_bytes, staging.stream.synchronize)


def copy_by_storage(found: list[torch.Tensor], host_bytes: Callable[[int], torch.Tensor],
                    wait: Callable[[], None]) -> list[torch.Tensor]:
    """Host copies of tensors: one copy per storage they view (the byte span their views cover; on a GPU one DMA,
    queued on the current stream) into the buffer `host_bytes(n)` gives, one `wait()`, one host copy of that buffer
    (it is reused), then a view of that copy each, with its device view's shape and strides: read them, do not
    write them (they share the copy). A batch's rows relayed one per request view one storage: one copy for the step.
    No kernel runs, so under MPS the copy cannot wait for SMs behind other processes' kernels, as a gather kernel
    may. A span that would copy over 4x the bytes its views need (and over 1 MiB) is split into one per view."""
    ranges = [_byte_range(tensor) for tensor in found]
    by_storage: dict[int, list[int]] = {}
    for index, tensor in enumerate(found):
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(index)
    groups: list[list[int]] = []
    for indices in by_storage.values():
        covered = max(ranges[i][1] for i in indices) - min(ranges[i][0] for i in indices)
        wasteful = covered > max(4 * sum(ranges[i][1] - ranges[i][0] for i in indices), 1 << 20)
        groups += [[i] for i in indices] if wasteful else [indices]
    # each span: its storage, first byte (16-aligned: every view's offset from it is a multiple of its element size),
    # end, and where it lands in the host buffer (16-aligned too)
    spans: list[tuple[torch.UntypedStorage, int, int, int]] = []
    span_of = [0] * len(found)
    landed = 0
    for group in groups:
        start = min(ranges[i][0] for i in group)
        start -= start % 16
        end = max(ranges[i][1] for i in group)
        spans.append((found[group[0]].untyped_storage(), start, end, landed))
        landed += -(-(end - start) // 16) * 16
        for i in group:
            span_of[i] = len(spans) - 1
    host = host_bytes(landed)
    for storage, start, end, at in spans:
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        host[at : at + end - start].copy_(whole[start:end], non_blocking=True)
    with host_range("relay: wait for the host copy"):
        wait()
    owned = host.clone()  # the staging buffer is reused by the next step: one host copy of all spans
    typed: dict[torch.dtype, torch.Tensor] = {}
    copies = []
    for tensor, (first, _), span in zip(found, ranges, span_of):
        _, start, _, at = spans[span]
        if tensor.dtype not in typed:
            typed[tensor.dtype] = owned.view(tensor.dtype)
        offset = (at + first - start) // tensor.element_size()
        copies.append(typed[tensor.dtype].as_strided(tensor.shape, tensor.stride(), offset))
    return copies


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a view reaches, from its first element to past its last (an empty view: none)."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return first, first
    return first, first + size * (1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride())))


def warm_host_copy(device: torch.device) -> None:
    """Pay `host_copies`' first-use costs now. On an H200 a process's first side-stream copy to the host waited for
    the work queued on the device, and so did the first gather kernel of its kind when the copy had
    one. Both shapes of copy are made here: one tensor, and views of several storages, of sizes that are and are not
    multiples of 16 bytes."""
    zeros = torch.zeros(64, device=device)
    host_copies([RelayItem("warm-up", tensors={"one": zeros[:1]})])
    host_copies([RelayItem("warm-up", tensors={"aligned": zeros[:4], "rows": zeros.reshape(4, 16)[1]}),
                 RelayItem("warm-up", tensors={"odd": zeros[:5].to(torch.uint8), "half": zeros.to(torch.bfloat16),
                                               "flags": zeros[:3] > 0, "empty": zeros[:0]})])
