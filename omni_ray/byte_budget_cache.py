"""A least-recently-used cache of tensors within a byte budget, for state that later requests reuse by content."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Generic, Protocol, TypeVar


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


Entry = TypeVar("Entry", bound=Sized)


class ByteBudgetCache(Generic[Entry]):
    """Entries by key within `max_bytes` in all: a lookup makes its entry the most recently used, and a new entry
    evicts the least recently used ones until it fits (one larger than the whole budget is not kept). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.entries

    def get(self, key: str, usable: Callable[[Entry], bool] | None = None) -> Entry | None:
        """The entry under `key` (when `usable` accepts it), counted as a hit; else None, counted as a miss."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None or (usable is not None and not usable(entry)):
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: str, entry: Entry) -> None:
        with self._lock:
            if key in self.entries or entry.nbytes > self.max_bytes:
                return
            while self.bytes + entry.nbytes > self.max_bytes and self.entries:
                _, evicted = self.entries.popitem(last=False)
                self.bytes -= evicted.nbytes
            self.entries[key] = entry
            self.bytes += entry.nbytes
