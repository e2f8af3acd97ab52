"""Prompt-prefix KV reuse: the keys and values of a prompt's leading positions, kept by content key, copied into a new
request's slot so that its prefill computes only the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_ray.byte_budget_cache import ByteBudgetCache
from omni_ray.engine.kv_cache import SlotKVCache


@dataclass
class PrefixEntry:
    """One prefix's keys and values, per layer [length, kv_heads, head_dim] each."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


class PrefixCache(ByteBudgetCache[PrefixEntry]):
    """Least-recently-used prefixes within `max_bytes` of device memory. A key names a prefix's whole content (its
    positions' inputs), so an entry is reused only for the same leading positions; the caller picks where a prompt's
    shared part ends."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.reused_positions = 0  # prompt positions whose prefill a hit saved

    def lookup(self, key: str, length: int) -> PrefixEntry | None:
        entry = self.get(key, lambda entry: entry.length == length)
        if entry is not None:
            self.reused_positions += length
        return entry

    def save(self, key: str, cache: SlotKVCache, slot: int, length: int) -> None:
        """Keep slot `slot`'s first `length` positions (already written) under `key`, evicting the least recently used
        entries to make room; a prefix larger than the whole budget is not kept."""
        if key in self or length <= 0:
            return
        self.put(key, PrefixEntry(length, [(k[slot, :length].clone(), v[slot, :length].clone()) for k, v in cache.layers]))

    @staticmethod
    def restore(entry: PrefixEntry, cache: SlotKVCache, slot: int) -> None:
        """Write a prefix's keys and values into positions 0..length-1 of `slot`."""
        for (k, v), (pk, pv) in zip(cache.layers, entry.layers):
            k[slot, : entry.length].copy_(pk)
            v[slot, : entry.length].copy_(pv)

    def stats(self) -> dict[str, float]:
        return {"prefix_cache_hits": self.hits, "prefix_cache_misses": self.misses,
                "prefix_cache_reused_positions": self.reused_positions, "prefix_cache_bytes": self.bytes,
                "prefix_cache_entries": len(self.entries)}
