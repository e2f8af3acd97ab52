"""The byte-budget LRU that the Talker's prefix cache and the vocoder's primed reference states share."""

from __future__ import annotations

from dataclasses import dataclass

from omni_ray.byte_budget_cache import ByteBudgetCache


@dataclass
class Blob:
    nbytes: int
    length: int = 0


def test_the_least_recently_used_leave_first_and_an_entry_over_the_budget_is_not_kept() -> None:
    cache: ByteBudgetCache[Blob] = ByteBudgetCache(100)
    cache.put("a", Blob(40))
    cache.put("b", Blob(40))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", Blob(40))
    assert list(cache.entries) == ["a", "c"] and cache.bytes == 80
    cache.put("huge", Blob(101))
    assert "huge" not in cache and cache.bytes == 80
    cache.put("a", Blob(10))  # a key kept already keeps its entry
    assert cache.entries["a"].nbytes == 40


def test_an_entry_the_caller_cannot_use_is_a_miss() -> None:
    cache: ByteBudgetCache[Blob] = ByteBudgetCache(100)
    cache.put("voice", Blob(10, length=7))
    assert cache.get("voice", lambda blob: blob.length == 8) is None
    assert cache.get("voice", lambda blob: blob.length == 7) is not None
    assert cache.get("other") is None
    assert (cache.hits, cache.misses) == (1, 2)
