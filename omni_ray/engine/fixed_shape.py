"""Fixed-shape prefill and decode batches over a slot KV cache: padding to buckets, and the graph-capturable forwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from omni_ray.engine.cuda_graphs import GraphCache, all_buckets, bucket_length, bucket_pow2
from omni_ray.engine.host_inputs import to_device
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderStack

S = TypeVar("S")


def within_prefill_budget(seqs: list[S], length: Callable[[S], int], cache: SlotKVCache, budget: int) -> list[S]:
    """The longest prefix of `seqs` whose padded prefill batch holds at most `budget` tokens (always at least one
    sequence); the rest prefill in a later step."""
    for count in range(len(seqs), 1, -1):
        longest = max(length(s) for s in seqs[:count])
        if bucket_pow2(count) * bucket_length(longest, cache.max_len) <= budget:
            return seqs[:count]
    return seqs[:1]


@dataclass
class PrefillTally:
    """A runner's prefills so far: the batches it ran and the sequences in them. Over an interval, sequences per
    batch says how a burst of requests was taken in: all at once, or in waves (each wave reads the weights again)."""

    batches: int = 0
    sequences: int = 0

    def add(self, count: int) -> None:
        self.batches += 1
        self.sequences += count


PREFILL_LENGTH_STEP = 16  # an unbucketed prefill's length is rounded up to this


def prefill_shape(num_prompts: int, longest: int, cache: SlotKVCache, graph_tokens: int | None) -> tuple[int, int, bool]:
    """(rows, length, from a graph) of a prefill batch: at its bucket (rows a power of two, length a power of two
    ≥ 16) while that holds at most `graph_tokens` padded tokens (None: always), replayed from a graph; past that,
    at its own rows and its longest prompt rounded up to 16 positions, run eagerly. A prefill that large is
    compute-bound, so a graph saves little, while the buckets' padding can cost up to half its work (100-token
    prompts run as 128)."""
    rows, length = bucket_pow2(num_prompts), bucket_length(longest, cache.max_len)
    if graph_tokens is None or rows * length <= graph_tokens:
        return rows, length, True
    return num_prompts, min(-(-longest // PREFILL_LENGTH_STEP) * PREFILL_LENGTH_STEP, cache.max_len), False


def split_rows(num_prompts: int, longest: int, cache: SlotKVCache, graph_tokens: int | None) -> int:
    """Prompts per graph-sized part of a prefill that is past `graph_tokens` at its bucket: the most rows (a power of
    two) whose bucket at the batch's length holds at most `graph_tokens` tokens; 0 when the batch runs from one
    graph as it is, or when not even one row fits (a prompt that long runs eagerly)."""
    if graph_tokens is None or prefill_shape(num_prompts, longest, cache, graph_tokens)[2]:
        return 0
    rows, length = 1, bucket_length(longest, cache.max_len)
    while 2 * rows * length <= graph_tokens:
        rows *= 2
    return rows if rows * length <= graph_tokens else 0


def run_prefill(
    graphs: GraphCache, forward: Callable[..., dict[str, torch.Tensor]], prompts: list[torch.Tensor],
    slots: list[int], cache: SlotKVCache, graph_tokens: int | None, split: bool = False,
) -> dict[str, torch.Tensor]:
    """`forward(embeds, slots)` over the prompts padded to their `prefill_shape`: row i is prompts[i]. With `split`, a
    batch past `graph_tokens` runs as parts of `split_rows` prompts, each replayed from its graph at the batch's
    bucket length, instead of eagerly at its own shape: each part reads the weights again, and the host's launch is
    short where an eager pass of a burst's wave takes 40-130 ms to launch (`engine.split_large_prefills`). The
    outputs (rows first) are then the parts' rows in order."""
    longest = max(p.shape[0] for p in prompts)
    part = split_rows(len(prompts), longest, cache, graph_tokens) if split else 0
    if part:
        length = bucket_length(longest, cache.max_len)
        parts = []
        for start in range(0, len(prompts), part):
            chunk = prompts[start : start + part]
            rows = bucket_pow2(len(chunk))
            embeds, slot_t = pad_prefill(chunk, slots[start : start + part], cache, rows, length)
            out = graphs.run(("prefill", rows, length), forward, {"embeds": embeds, "slots": slot_t})
            # copied out before a later part's replay of the same graph writes its outputs again
            parts.append({name: value[: len(chunk)].clone() for name, value in out.items()})
        return {name: torch.cat([out[name] for out in parts]) for name in parts[0]}
    rows, length, graphed = prefill_shape(len(prompts), longest, cache, graph_tokens)
    embeds, slot_t = pad_prefill(prompts, slots, cache, rows, length)
    if graphed:
        return graphs.run(("prefill", rows, length), forward, {"embeds": embeds, "slots": slot_t})
    return forward(embeds=embeds, slots=slot_t)


def pad_prefill(
    prompts: list[torch.Tensor], slots: list[int], cache: SlotKVCache, rows: int | None = None, length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt embeddings [T_i, H] → [rows, length, H] zero-padded (by default to a bucket), and their slots [rows];
    padding rows use the scratch slot. Padding positions past a row's length write cache entries that decode
    overwrites before it ever attends to them. The prompts land in one indexed copy whatever their count (a copy per
    prompt meant 32 launches before a 32-request prefill could start)."""
    rows = rows or bucket_pow2(len(prompts))
    length = length or bucket_length(max(p.shape[0] for p in prompts), cache.max_len)
    first = prompts[0]
    padded = torch.zeros(rows, length, first.shape[-1], dtype=first.dtype, device=first.device)
    places = torch.cat([torch.arange(row * length, row * length + p.shape[0]) for row, p in enumerate(prompts)])
    padded.view(rows * length, -1).index_copy_(0, to_device(places, first.device), torch.cat(prompts))
    slot_t = to_device(torch.tensor(slots + [cache.scratch_slot] * (rows - len(slots)), dtype=torch.long), first.device)
    return padded, slot_t


def decode_positions(seqs: list[tuple[int, int]], cache: SlotKVCache) -> tuple[torch.Tensor, int]:
    """A decode batch over slots 0..R-1 (R: the power-of-two bucket of the slots in use), row r being slot r:
    seqs holds (slot, position) of the rows that decode; every other row is a dummy writing at the last cache
    position, which a sequence always overwrites before reading. Returns positions [R] on the host (for
    `host_inputs.upload` with the step's other inputs) and the key-range bucket covering every real row."""
    rows = bucket_pow2(cache.used_slots)
    positions = [cache.max_len - 1] * rows
    for slot, position in seqs:
        positions[slot] = position
    kv_len = bucket_length(max(p for _, p in seqs) + 1, cache.max_len)
    return torch.tensor(positions, dtype=torch.long), kv_len


def warmup_shapes(
    cache: SlotKVCache, max_batch: int, max_prefill_tokens: int, prefill_len: int = 256, graph_tokens: int | None = None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """What a runner captures before serving: every (rows, key range) decode bucket, and every (rows, length)
    prefill bucket with length up to `prefill_len` within the prefill token budget and `graph_tokens` (longer
    prompts capture on first use; past `graph_tokens` a prefill runs without a graph)."""
    rows = all_buckets(max_batch)
    decode = {(r, min(kv, cache.max_len)) for r in rows for kv in all_buckets(cache.max_len, 16)}
    lengths = all_buckets(min(prefill_len, cache.max_len), 16)
    limit = max_prefill_tokens if graph_tokens is None else min(max_prefill_tokens, graph_tokens)
    prefill = {(r, min(n, cache.max_len)) for r in rows for n in lengths if r * n <= limit}
    return sorted(decode), sorted(prefill)


def run_decode(
    graphs: GraphCache, forward: Callable[..., dict[str, torch.Tensor]], kv_len: int, inputs: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """`forward(kv_len=kv_len, **inputs)` for a decode bucket: one graph per (rows, key range)."""
    rows = next(iter(inputs.values())).shape[0]
    return graphs.run(("decode", rows, kv_len), lambda **tensors: forward(kv_len=kv_len, **tensors), inputs)


def dummy_decode_positions(rows: int, cache: SlotKVCache, device: torch.device) -> torch.Tensor:
    """Positions for a warm-up decode: every row a dummy at the last cache position (free slots only)."""
    return torch.full((rows,), cache.max_len - 1, dtype=torch.long, device=device)


def capture_prefills(
    graphs: GraphCache, cache: SlotKVCache, shapes: list[tuple[int, int]], width: int, dtype: torch.dtype,
    forward: Callable[..., dict[str, torch.Tensor]],
) -> None:
    """Warm-up: capture `forward(embeds, slots)` for every (rows, length) prefill shape, all rows in the scratch slot."""
    for rows, length in shapes:
        embeds = torch.zeros(rows, length, width, dtype=dtype, device=graphs.device)
        slots = torch.full((rows,), cache.scratch_slot, dtype=torch.long, device=graphs.device)
        graphs.run(("prefill", rows, length), forward, {"embeds": embeds, "slots": slots})


def prefill_forward(
    stack: DecoderStack, cache: SlotKVCache, embeds: torch.Tensor, slots: torch.Tensor, capture: tuple[int, ...] = ()
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Rows [N, T] written from position 0 of their slots (graph-capturable)."""
    rows, length = embeds.shape[:2]
    batch = AttentionBatch.prefill(slots, length)
    positions = torch.arange(length, device=embeds.device)[None].expand(rows, -1)
    return stack(embeds, positions, cache.layers, batch, capture)


def decode_forward(
    stack: DecoderStack, cache: SlotKVCache, embeds: torch.Tensor, positions: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """One token per row, row r in slot r: embeds [R, 1, H] at positions [R] → normed hidden [R, H]
    (graph-capturable; keys are a view of the cache, no gather)."""
    slots = torch.arange(positions.shape[0], device=positions.device)
    batch = AttentionBatch.from_tensors(slots, positions, 1, kv_len, rows_are_slots=True)
    hidden, _ = stack(embeds, positions[:, None], cache.layers, batch)
    return hidden[:, 0]


def last_positions(hidden: torch.Tensor, rows: list[int], lengths: list[int]) -> torch.Tensor:
    """The state of row rows[i] at position lengths[i] - 1 of a padded [N_b, T_b, H] batch → [len(rows), H]."""
    index = to_device(torch.tensor([[row, length - 1] for row, length in zip(rows, lengths)]), hidden.device)
    return hidden[index[:, 0], index[:, 1]]
