"""Preallocated slot-based KV cache: one fixed-length slot per running request, kept compact (slots 0..n-1)."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import torch


class KVCacheFull(RuntimeError):
    """No free slot, or a request outgrew its slot."""


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class SlotKVCache:
    """K/V tensors per layer shaped [rows, max_len, kv_heads, head_dim]; slots are handed out and returned.

    The slots in use are always 0..used_slots-1: releasing a slot moves the highest used slot into it (`release`
    says which), so a decode batch over every running request reads its keys as a view of the first rows, with no
    gather. `rows` covers the largest power-of-two batch bucket plus a last scratch row where padding rows of a
    fixed-shape batch read and write, never in a live slot."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        rows = max(_pow2_at_least(num_slots), num_slots + 1)
        shape = (rows, max_len, num_kv_heads, head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.num_slots = num_slots
        self.max_len = max_len
        self.rows = rows
        self.scratch_slot = rows - 1
        self._used = 0

    @property
    def free_slots(self) -> int:
        return self.num_slots - self._used

    @property
    def used_slots(self) -> int:
        return self._used

    def allocate(self) -> int:
        if self._used >= self.num_slots:
            raise KVCacheFull("no free KV cache slot")
        self._used += 1
        return self._used - 1

    def release(self, slot: int) -> int | None:
        """Free `slot`. If it was not the highest used slot, that one's contents move into it: returns the slot
        that moved (its owner now lives in `slot`), else None."""
        if not 0 <= slot < self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used -= 1
        last = self._used
        if slot == last:
            return None
        for k, v in self.layers:
            k[slot].copy_(k[last])
            v[slot].copy_(v[last])
        return last

    def check_fits(self, length: int) -> None:
        if length > self.max_len:
            raise KVCacheFull(f"sequence of {length} positions exceeds the KV slot length {self.max_len}")


class HasSlot(Protocol):
    slot: int


S = TypeVar("S", bound=HasSlot)


class SlotTable(Generic[S]):
    """Hands KV slots to sequences and follows the cache's compaction: when a release moves another sequence's
    slot, that sequence's `slot` and its rows of the per-slot side tensors (e.g. token histories) move too."""

    def __init__(self, cache: SlotKVCache, side_tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self.cache = cache
        self.side_tensors = side_tensors
        self._owners: dict[int, S] = {}

    def allocate(self, seq: S) -> int:
        seq.slot = self.cache.allocate()
        self._owners[seq.slot] = seq
        return seq.slot

    def sequences(self) -> list[S]:
        """The sequences holding slots now."""
        return list(self._owners.values())

    def release(self, seq: S) -> None:
        if seq.slot < 0:
            return
        slot, seq.slot = seq.slot, -1
        del self._owners[slot]
        moved = self.cache.release(slot)
        if moved is not None:
            owner = self._owners.pop(moved)
            owner.slot = slot
            self._owners[slot] = owner
            for tensor in self.side_tensors:
                tensor[slot] = tensor[moved]
