"""CUDA graphs of a runner's fixed-shape step functions: one per shape bucket, captured on first use, then replayed."""

from __future__ import annotations

import bisect
import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from omni_ray.engine.host_inputs import upload

log = logging.getLogger(__name__)

StepFunction = Callable[..., dict[str, torch.Tensor]]


def bucket_pow2(n: int, minimum: int = 1, cap: int | None = None) -> int:
    """The smallest power of two ≥ n (and ≥ minimum), clamped to `cap` when given."""
    size = max(minimum, 1 << max(0, n - 1).bit_length())
    return min(size, cap) if cap is not None else size


def bucket_length(n: int, cap: int) -> int:
    """Sequence-length bucket: a power of two ≥ 16, never above `cap`."""
    return min(bucket_pow2(n, 16), cap)


def all_buckets(largest: int, minimum: int = 1) -> list[int]:
    """Every bucket_pow2 value up to the one that covers `largest`."""
    sizes = [minimum]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class GraphCache:
    """Runs `fn(**inputs)` for a shape key: replayed from a CUDA graph when enabled, eagerly otherwise.

    Inputs must have the key's exact shapes (callers pad to a bucket); they are copied into the graph's static
    buffers, from the device or from the host. Outputs are the graph's own buffers, valid until the next `run` of
    any key (all graphs share one memory pool), so callers consume or clone them first. `fn` must not sync with the
    host, and everything it writes must be idempotent for the same inputs (capture runs it once eagerly, then
    replays it). Nor may `fn` keep a tensor it allocates inside the capture (a lazily made buffer, say) for later
    runs: it lies in the shared pool, where graphs captured before write their intermediates at every replay
    (an earlier graph's replay once wrote over the persistent pass's counters kept that way). Each capture
    checks the pool for such tensors and logs them (`kept_in_pool`)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self._graphs: dict[Hashable, _Captured] = {}
        self.uncapturable: set[Hashable] = set()  # keys whose capture failed: they run eagerly
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        # Its own capture stream: cuBLAS gives each (handle, stream) its own workspace and a graph keeps the one it was
        # captured with, so graphs captured on torch's one default capture stream share a workspace, and two
        # runners replaying at once on their own streams (engine lanes) would both write it.
        self._capture_stream = torch.cuda.Stream(device) if self.enabled else None
        self.capture_ms = 0.0
        self.kept_in_pool: list[int] = []  # bytes of each block a capture allocated and something still holds

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        """Captured, or known not to be capturable (it then runs eagerly)."""
        return key in self._graphs or key in self.uncapturable

    def run(self, key: Hashable, fn: StepFunction, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs may sit on the device or on the host: a replay copies host ones straight into the graph's buffers
        (pinned first, so the host does not wait for the device's queued work)."""
        entry = self._graphs.get(key) if self.enabled else None
        on_host = {name: value for name, value in inputs.items() if value.is_cpu and self.device.type != "cpu"}
        if entry is None and on_host:
            inputs = inputs | upload(on_host, self.device)
        if not self.enabled or key in self.uncapturable:
            return fn(**inputs)
        if entry is None:
            try:
                entry = self._capture(key, fn, inputs)
            except Exception:  # e.g. a module that syncs with the host: still correct, just eager
                log.warning("CUDA graph capture of %s failed; running it eagerly", key, exc_info=True)
                self.uncapturable.add(key)
                torch.cuda.synchronize(self.device)
                return fn(**inputs)
        for name, buffer in entry.inputs.items():
            buffer.copy_(on_host[name].pin_memory() if name in on_host else inputs[name], non_blocking=True)
        entry.graph.replay()
        return entry.outputs

    def prepare(self, key: Hashable, fn: StepFunction, example_inputs: dict[str, torch.Tensor]) -> None:
        """Capture `key` now from `example_inputs` whose writes are harmless (scratch rows), if it is not captured
        yet. For a `fn` whose writes are not idempotent (read-modify-write state): a `run` that captures would run
        it twice on the real inputs, a prepared key only replays."""
        if self.enabled and key not in self:
            self.run(key, fn, example_inputs)

    def _capture(self, key: Hashable, fn: StepFunction, inputs: dict[str, torch.Tensor]) -> _Captured:
        start = time.perf_counter()
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm up kernels (and their lazy library init) outside the capture
            fn(**static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.cuda.stream(self._capture_stream):  # cuBLAS's workspaces for this stream, outside the pool
            _use_cublas(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"):
            outputs = fn(**static)
        entry = _Captured(graph, static, outputs)
        self._graphs[key] = entry
        elapsed = (time.perf_counter() - start) * 1000
        self.capture_ms += elapsed
        log.info("captured CUDA graph %s in %.0f ms (%d graphs)", key, elapsed, len(self._graphs))
        kept = self._kept_in_pool()
        if len(kept) > len(self.kept_in_pool):
            log.error("after capturing CUDA graph %s, %d block(s) of its pool (%s bytes) are held by something other "
                      "than the graphs' outputs: a tensor allocated inside a capture and kept, which replays of "
                      "other graphs write over", key, len(kept), ", ".join(map(str, kept)))
        self.kept_in_pool = kept
        return entry

    def _kept_in_pool(self) -> list[int]:
        """The sizes of the live blocks in this cache's pool that hold none of the graphs' outputs."""
        outputs = [tensor.untyped_storage().data_ptr() for entry in self._graphs.values()
                   for tensor in entry.outputs.values()]
        kept = _live_blocks_without(self._pool, self.device, outputs)
        if kept:  # a tensor in a reference cycle may be unreachable yet uncollected
            gc.collect()
            kept = _live_blocks_without(self._pool, self.device, outputs)
        return [size for _, size in kept]


def _live_blocks_without(pool: tuple[int, int], device: torch.device, addresses: list[int]) -> list[tuple[int, int]]:
    """(address, size) of each allocated block of `pool` on `device` that contains none of `addresses`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    blocks = [(block["address"], block["size"]) for segment in torch.cuda.memory_snapshot()
              if segment["device"] == index and tuple(segment["segment_pool_id"]) == tuple(pool)
              for block in segment["blocks"] if block["state"] == "active_allocated"]
    ordered = sorted(addresses)  # a block holds one when the first address at or past its start lies inside it
    return [(start, size) for start, size in blocks
            if (i := bisect.bisect_left(ordered, start)) == len(ordered) or ordered[i] >= start + size]


def _use_cublas(device: torch.device) -> None:
    """One tiny matmul and one with a bias, so that cuBLAS and cuBLASLt allocate the current stream's workspaces now
    (inside a capture they would come from the graphs' pool and stay there)."""
    a = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
    torch.nn.functional.linear(a, a, a[0])
    torch.mm(a, a)
