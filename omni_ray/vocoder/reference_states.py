"""Cloned voices' primed decoder states: a reference's codes decoded into a stream's state once, reused by later
streams in the same voice."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrimedState:
    """A stateful codec's slot after decoding a reference's `frames` frames from position 0: the slot's state row,
    and the reference audio's last samples (one frame's at most) that a stream keeps for its lead-in."""

    frames: int
    state: torch.Tensor
    reference_audio: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.state.numel() * self.state.element_size() + self.reference_audio.numel() * 4


def reference_key(codes: torch.Tensor) -> str:
    """The content key of reference codes [Q, T]: equal codes, equal key."""
    flat = codes.detach().to("cpu", torch.long).contiguous()
    return f"{tuple(flat.shape)}:{hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).hexdigest()}"


class PrimedStates:
    """Least-recently-used primed states within `max_bytes` (device memory, where the codec's state lives). A stream
    that starts from a reference whose codes are kept copies the state into its slot instead of decoding the
    reference: its audio is the same, and its first chunk waits for one copy instead of the reference's decode
    calls. Used from the streams' event loop and the decode thread, so guarded by a lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, PrimedState] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def lookup(self, key: str) -> PrimedState | None:
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            return entry

    def save(self, key: str, entry: PrimedState) -> None:
        """Keep `entry`, evicting the least recently used to make room; one larger than the budget is not kept."""
        with self._lock:
            if key in self.entries or entry.nbytes > self.max_bytes:
                return
            while self.bytes + entry.nbytes > self.max_bytes and self.entries:
                _, evicted = self.entries.popitem(last=False)
                self.bytes -= evicted.nbytes
            self.entries[key] = entry
            self.bytes += entry.nbytes

    def stats(self) -> dict[str, float]:
        return {"reference_state_hits": self.hits, "reference_state_misses": self.misses,
                "reference_state_bytes": self.bytes, "reference_state_entries": len(self.entries)}
