"""Unit tests of the fixed-shape batching that CUDA graphs replay: buckets, padding, dummy rows, warm-up shapes."""

from __future__ import annotations

import torch

from omni_ray.engine.cuda_graphs import GraphCache, all_buckets, bucket_length, bucket_pow2
from omni_ray.engine.fixed_shape import (
    decode_positions,
    last_positions,
    pad_prefill,
    prefill_shape,
    run_prefill,
    split_rows,
    warmup_shapes,
    within_prefill_budget,
)
from omni_ray.engine.kv_cache import SlotKVCache

CPU = torch.device("cpu")


def _cache(num_slots: int = 5, max_len: int = 100) -> SlotKVCache:
    return SlotKVCache(1, num_slots, max_len, 1, 4, torch.float32, "cpu")


def test_buckets() -> None:
    assert [bucket_pow2(n) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert [bucket_length(n, 100) for n in (1, 16, 17, 64, 65, 99)] == [16, 16, 32, 64, 100, 100]
    assert all_buckets(20) == [1, 2, 4, 8, 16, 32] and all_buckets(100, 16) == [16, 32, 64, 128]


def test_cache_rows_cover_every_decode_bucket_plus_scratch() -> None:
    cache = _cache(num_slots=5)
    assert cache.rows == 8 and cache.scratch_slot == 7  # bucket 8 covers 5 live slots; scratch never allocated
    assert _cache(num_slots=8).rows == 9


def test_decode_positions_put_dummy_rows_at_the_last_position() -> None:
    cache = _cache(num_slots=5, max_len=100)
    for _ in range(3):
        cache.allocate()
    positions, kv_len = decode_positions([(0, 7), (2, 20)], cache)  # slot 1 does not decode this step
    assert positions.tolist() == [7, 99, 20, 99]  # 3 slots in use → 4 rows
    assert kv_len == 32


def test_pad_prefill_uses_the_scratch_slot_for_padding_rows() -> None:
    cache = _cache(num_slots=5, max_len=100)
    prompts = [torch.randn(5, 3), torch.randn(20, 3), torch.randn(9, 3)]
    embeds, slots = pad_prefill(prompts, [0, 1, 2], cache)
    assert embeds.shape == (4, 32, 3)
    assert slots.tolist() == [0, 1, 2, cache.scratch_slot]
    expected = torch.zeros(4, 32, 3)
    for row, prompt in enumerate(prompts):
        expected[row, : prompt.shape[0]] = prompt
    assert torch.equal(embeds, expected)  # each prompt at the start of its row, zeros after it and in the padding row
    last = last_positions(torch.arange(4 * 32).reshape(4, 32, 1).float(), [1, 2], [20, 9])
    assert last.flatten().tolist() == [32 + 19, 64 + 8]


def test_prefill_budget_takes_the_longest_fitting_prefix() -> None:
    cache = _cache(num_slots=8, max_len=512)
    lengths = [100, 100, 100, 300]
    assert within_prefill_budget(lengths, lambda n: n, cache, 512) == [100, 100, 100]  # 4 rows x 128
    assert within_prefill_budget(lengths, lambda n: n, cache, 2048) == lengths  # 4 rows x 512
    assert within_prefill_budget([400, 10], lambda n: n, cache, 64) == [400]  # always at least one


def test_warmup_shapes_cover_every_decode_bucket_within_the_prefill_budget() -> None:
    cache = _cache(num_slots=5, max_len=100)
    decode, prefill = warmup_shapes(cache, max_batch=5, max_prefill_tokens=128)
    assert decode == [(rows, kv) for rows in (1, 2, 4, 8) for kv in (16, 32, 64, 100)]
    assert all(rows * length <= 128 for rows, length in prefill)
    assert (1, 100) in prefill and (8, 16) in prefill and (8, 32) not in prefill


def test_a_prefill_past_the_graph_limit_runs_at_its_own_rows_and_length() -> None:
    cache = _cache(num_slots=40, max_len=2044)
    assert prefill_shape(32, 100, cache, None) == (32, 128, True)  # every prefill at its bucket
    assert prefill_shape(32, 100, cache, 4096) == (32, 128, True)  # 4096 padded tokens: within the limit
    assert prefill_shape(32, 100, cache, 2048) == (32, 112, False)  # 100 rounded up to 16 positions
    assert prefill_shape(20, 100, cache, 2048) == (20, 112, False)  # no padding rows
    assert prefill_shape(3, 100, cache, 2048) == (4, 128, True)  # 512 padded tokens: a graph
    assert prefill_shape(2, 2040, cache, 0) == (2, 2044, False)  # never past the slot's length
    _, prefill = warmup_shapes(cache, max_batch=32, max_prefill_tokens=8192, graph_tokens=2048)
    assert max(rows * length for rows, length in prefill) == 2048  # only the shapes that run from a graph


class _RecordingGraphs(GraphCache):
    """A graph cache (eager off CUDA) that records the keys it is asked to run."""

    def __init__(self) -> None:
        super().__init__(CPU, enabled=False)
        self.keys: list[tuple[object, ...]] = []

    def run(self, key, fn, inputs):  # type: ignore[no-untyped-def]
        self.keys.append(key)
        return super().run(key, fn, inputs)


def test_run_prefill_pads_rows_to_the_shape_it_picks_and_uses_a_graph_only_within_the_limit() -> None:
    cache = _cache(num_slots=8, max_len=512)
    prompts = [torch.ones(5, 3), 2 * torch.ones(20, 3), 3 * torch.ones(9, 3)]
    seen: list[tuple[tuple[int, ...], list[int]]] = []

    def forward(embeds: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append((tuple(embeds.shape), slots.tolist()))
        return {"hidden": embeds}

    graphs = _RecordingGraphs()
    out = run_prefill(graphs, forward, prompts, [0, 1, 2], cache, None)
    assert graphs.keys == [("prefill", 4, 32)] and seen[-1] == ((4, 32, 3), [0, 1, 2, cache.scratch_slot])
    out = run_prefill(graphs, forward, prompts, [0, 1, 2], cache, 64)  # 4 x 32 padded tokens > 64: no graph
    assert graphs.keys == [("prefill", 4, 32)] and seen[-1] == ((3, 32, 3), [0, 1, 2])
    assert last_positions(out["hidden"], [0, 1, 2], [5, 20, 9])[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert bool((out["hidden"][0, 5:] == 0).all())


def test_a_prefill_past_the_graph_limit_splits_into_graph_sized_parts_at_its_bucket_length() -> None:
    cache = _cache(num_slots=40, max_len=2044)
    assert split_rows(21, 100, cache, 2048) == 16  # 16 x 128 padded tokens a part: 16 + 5 (a part of 8 rows)
    assert split_rows(16, 120, cache, 2048) == 0  # within the limit as it is: one graph, no parts
    assert split_rows(16, 130, cache, 2048) == 8  # 16 x 256 > 2048: two parts of 8
    assert split_rows(3, 100, cache, None) == 0 and split_rows(2, 2040, cache, 1024) == 0  # no limit; too long a row
    prompts = [float(i + 1) * torch.ones(n, 2) for i, n in enumerate([5, 20, 9])]
    graphs = _RecordingGraphs()
    out = run_prefill(graphs, lambda embeds, slots: {"hidden": embeds, "slot": slots}, prompts, [7, 8, 9],
                      _cache(num_slots=10, max_len=512), graph_tokens=64, split=True)  # 4 x 32 > 64: parts of 2
    assert graphs.keys == [("prefill", 2, 32), ("prefill", 1, 32)]  # the last part of one row at its bucket
    assert out["slot"].tolist() == [7, 8, 9] and out["hidden"].shape == (3, 32, 2)  # each part's own rows, in order
    assert last_positions(out["hidden"], [0, 1, 2], [5, 20, 9])[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert bool((out["hidden"][2, 9:] == 0).all())


def test_graph_cache_runs_eagerly_off_cuda() -> None:
    graphs = GraphCache(CPU, enabled=True)
    assert not graphs.enabled
    out = graphs.run(("k",), lambda x: {"y": x + 1}, {"x": torch.ones(2)})
    assert out["y"].tolist() == [2.0, 2.0] and len(graphs) == 0
