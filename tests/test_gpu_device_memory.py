"""Counter sets in device memory of their own stay out of PyTorch's allocator: one set per stream, at rest as made, at
addresses no allocator segment holds, and untouched by the replays of graphs captured before them in a shared pool
(where a tensor allocated in a later capture can sit on an earlier graph's intermediates). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from omni_ray.device_memory import StreamCounterSets
from omni_ray.engine.cuda_graphs import GraphCache
from omni_ray.layers import persistent_pass, small_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _allocator_segments() -> list[tuple[int, int]]:
    return [(segment["address"], segment["address"] + segment["total_size"])
            for segment in torch.cuda.memory_snapshot()]


def _inside(tensor: torch.Tensor, segments: list[tuple[int, int]]) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(start < high and low < end for low, high in segments)


def _prefill(x: torch.Tensor, length: torch.Tensor) -> dict[str, torch.Tensor]:
    """Small int64 intermediates holding 113 (as a prompt length), freed at the end of each capture."""
    lengths = length.to(torch.int64).expand(x.shape[0]).clone()
    positions = lengths - 1
    return {"out": x.sum(-1) + positions.float()}


def test_each_stream_gets_its_own_set_at_rest_and_a_set_runs_out_cleanly() -> None:
    device = torch.device("cuda")
    sets = StreamCounterSets(words=3, sets=2, at_rest=[7, 0, -1])
    first = sets.for_current_stream(device)
    assert first is not None and first.tolist() == [7, 0, -1]
    assert sets.for_current_stream(device) is first
    other = torch.cuda.Stream(device)
    with torch.cuda.stream(other):
        second = sets.for_current_stream(device)
    assert second is not None and second.data_ptr() == first.data_ptr() + 3 * 4
    with torch.cuda.stream(torch.cuda.Stream(device, priority=-1)):
        assert sets.for_current_stream(device) is None  # both sets taken


def test_counters_a_capture_asks_for_sit_outside_the_graph_pool_and_survive_earlier_graphs_replays() -> None:
    device = torch.device("cuda")
    graphs = GraphCache(device, enabled=True)
    length = torch.tensor([113], dtype=torch.int32, device=device)
    for rows in (1, 2, 4):
        graphs.run(("prefill", rows), _prefill, {"x": torch.randn(rows, 64, device=device), "length": length})
    persistent_pass._barrier_sets.make_slab(device)  # as the pass's build() does, before any capture
    asked: list[torch.Tensor] = []

    def decode(x: torch.Tensor) -> dict[str, torch.Tensor]:  # asks for its stream's counters, as a launch does
        asked.extend([persistent_pass.barrier_counters(x.device), small_batch.arrival_counters(x.device)])
        return {"out": x * 2}

    graphs.run(("decode", 1), decode, {"x": torch.randn(1, 64, device=device)})
    barrier, arrivals = asked[-2:]  # the ones the capture on the cache's own stream asked for
    segments = _allocator_segments()
    assert not _inside(barrier, segments) and not _inside(arrivals, segments)
    at_rest = barrier.clone()
    for rows in (1, 2, 4):
        graphs.run(("prefill", rows), _prefill, {"x": torch.randn(rows, 64, device=device), "length": length})
    torch.cuda.synchronize(device)
    assert torch.equal(barrier, at_rest) and not arrivals.any()


def test_a_graph_cache_reports_a_tensor_a_capture_allocated_and_kept() -> None:
    device = torch.device("cuda")
    clean, keeping = GraphCache(device, enabled=True), GraphCache(device, enabled=True)
    weight = torch.randn(64, 64, device=device)
    kept: dict[int, torch.Tensor] = {}

    def step(x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": torch.relu(x @ weight).sum(-1)}

    def step_keeping_a_buffer(x: torch.Tensor) -> dict[str, torch.Tensor]:
        stream = torch.cuda.current_stream(device).stream_id  # made lazily per stream: inside the capture
        kept.setdefault(stream, torch.zeros(1000, device=device)).add_(1)
        return step(x)

    for rows in (1, 2, 4):
        clean.run(rows, step, {"x": torch.randn(rows, 64, device=device)})
        keeping.run(rows, step_keeping_a_buffer, {"x": torch.randn(rows, 64, device=device)})
    assert clean.kept_in_pool == []
    assert len(keeping.kept_in_pool) == 1 and keeping.kept_in_pool[0] >= 4000


def test_the_allocator_counters_count_a_retry_that_freed_the_cache() -> None:
    """`cuda_allocator_stats` (the stages' `/metrics`, the step trace): an allocation that fits only once the
    allocator gives a cached block back counts one retry (with expandable segments or without)."""
    from omni_ray.engine.profiling import cuda_allocator_stats

    before = cuda_allocator_stats()
    assert set(before) == {"cuda_alloc_retries", "cuda_ooms"}
    free, _ = torch.cuda.mem_get_info()
    cached = torch.empty(int(free * 0.45), dtype=torch.uint8, device="cuda")
    held = torch.empty(int(free * 0.45), dtype=torch.uint8, device="cuda")
    del cached  # kept in the allocator's cache: too small for the next one, and the card has about 10% left
    larger = torch.empty(int(free * 0.5), dtype=torch.uint8, device="cuda")
    del larger, held
    torch.cuda.empty_cache()
    after = cuda_allocator_stats()
    assert after["cuda_alloc_retries"] == before["cuda_alloc_retries"] + 1 and after["cuda_ooms"] == before["cuda_ooms"]
