"""Preallocated slot-based KV cache: one fixed-length slot per running request."""

from __future__ import annotations

import torch


class KVCacheFull(RuntimeError):
    """No free slot, or a request outgrew its slot."""


class SlotKVCache:
    """K/V tensors per layer shaped [num_slots + 1, max_len, kv_heads, head_dim]; slots are handed out and returned.

    The extra last slot is scratch: padding rows of a fixed-shape batch read and write there, never in a live slot."""

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
        shape = (num_slots + 1, max_len, num_kv_heads, head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.max_len = max_len
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise KVCacheFull("no free KV cache slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def check_fits(self, length: int) -> None:
        if length > self.max_len:
            raise KVCacheFull(f"sequence of {length} positions exceeds the KV slot length {self.max_len}")
