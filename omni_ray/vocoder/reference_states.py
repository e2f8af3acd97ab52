"""Cloned voices' primed decoder states: a reference's codes decoded into a stream's state once, reused by later
streams in the same voice."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from omni_ray.byte_budget_cache import ByteBudgetCache


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


class PrimedStates(ByteBudgetCache[PrimedState]):
    """Least-recently-used primed states within `max_bytes` (device memory, where the codec's state lives). A stream
    that starts from a reference whose codes are kept copies the state into its slot instead of decoding the
    reference: its audio is the same, and its first chunk waits for one copy instead of the reference's decode
    calls. Used from the streams' event loop and the decode thread (the cache is thread-safe)."""

    def stats(self) -> dict[str, float]:
        return {"reference_state_hits": self.hits, "reference_state_misses": self.misses,
                "reference_state_bytes": self.bytes, "reference_state_entries": len(self.entries)}
