"""The chunk schedule of a streaming vocoder: how many frames each chunk decodes, and the decode shapes that makes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkSchedule", "decode_window_lengths", "reference_call_sizes", "split_into_calls", "step_shapes"]


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk sizes in new frames: ``ramp`` first (low first-packet latency), then ``steady``.

    ``left_context`` is how many already-decoded frames precede the new frames in each decode
    window (capped by what exists). More context means closer to one-shot quality; at or above
    the codec's receptive field the streamed output equals the one-shot decode.

    ``aligned``: after the ramp, a chunk ends where the producer's step clock (pushed with the frames) ends a
    period of ``steady`` steps, so every stream fed by one producer decodes at the same steps, in one batched call,
    whenever it started; a chunk then holds up to ``steady`` frames (fewer for the chunk that brings a stream into
    step, or after steps the stream sat out). Without a clock the schedule is the plain one.
    """

    ramp: tuple[int, ...] = (1, 2, 4)
    steady: int = 8
    left_context: int = 25
    aligned: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ramp", tuple(self.ramp))
        for name, value in [("steady", self.steady), ("left_context", self.left_context)] + [
            (f"ramp[{i}]", v) for i, v in enumerate(self.ramp)
        ]:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ChunkSchedule.{name} must be a positive int, got {value!r}")
        if not isinstance(self.aligned, bool):
            raise ValueError(f"ChunkSchedule.aligned must be a bool, got {self.aligned!r}")

    def chunk_size(self, index: int) -> int:
        """Number of new frames in the ``index``-th (0-based) chunk (at most, for an aligned chunk)."""
        return self.ramp[index] if index < len(self.ramp) else self.steady

    def aligns(self, index: int, clock: int | None) -> bool:
        """Whether the ``index``-th chunk ends on the producer's clock (aligned, past the ramp and a first chunk)."""
        return self.aligned and clock is not None and index >= max(len(self.ramp), 1)

    def later_sizes(self) -> list[int]:
        """The new-frame counts of a stream's calls after its first, largest first: the ramp's and the steady
        chunk, and when aligned every power of two below ``steady`` too, from which any shorter chunk is made."""
        sizes = {*self.ramp[1:], self.steady}
        if self.aligned:
            sizes.update(1 << bit for bit in range(self.steady.bit_length()) if 1 << bit < self.steady)
        return sorted(sizes, reverse=True)


def decode_window_lengths(schedule: ChunkSchedule, reference_frames: int = 0) -> list[int]:
    """Every window length (frames) a ``StreamingDecoder`` on this schedule can pass to ``decode``.

    Covers scheduled chunks and the partial chunk decoded by ``finish()`` at any stream length,
    for a stream started with ``reference_frames`` reference frames. The set is finite: once
    the left context saturates and the ramp is over, windows repeat.
    """
    if reference_frames < 0:
        raise ValueError(f"reference_frames must be >= 0, got {reference_frames}")
    lengths: set[int] = set()
    start = 0  # first new frame of the current chunk (reference frames are at negative indices)
    index = 0
    while True:
        context = min(schedule.left_context, start + reference_frames)
        size = schedule.chunk_size(index)
        lengths.add(context + size)  # a full scheduled chunk
        lengths.update(context + r for r in range(1, size))  # finish() with a partial chunk
        if index >= len(schedule.ramp) and context == schedule.left_context:
            break  # every later chunk yields the same windows
        start += size
        index += 1
    return sorted(lengths)


def step_shapes(schedule: ChunkSchedule, reference: bool = False) -> list[tuple[int, bool]]:
    """Every (new frames, first call) a ``StatefulStreamingDecoder`` on this schedule passes to ``step`` (its last,
    partial chunk is padded to the scheduled size); with `reference`, those of streams opened with reference codes
    too (their reference decoded in `reference_call_sizes` calls, the first of them a first call, then the first
    chunk a later one)."""
    shapes = {(schedule.chunk_size(0), True), *((size, False) for size in schedule.later_sizes())}
    if reference:
        sizes = reference_call_sizes(schedule)
        shapes.update((size, first) for size in sizes for first in (True, False))
        shapes.add((schedule.chunk_size(0), False))
    return sorted(shapes, key=lambda shape: (not shape[1], shape[0]))


def reference_call_sizes(schedule: ChunkSchedule) -> list[int]:
    """The call sizes a stateful stream decodes its reference frames in, largest first: the later calls' sizes and
    1, so that any count splits into them (`split_into_calls`)."""
    return sorted({*schedule.later_sizes(), 1}, reverse=True)


def split_into_calls(size: int, sizes: list[int]) -> list[int]:
    """`size` frames as calls of the given `sizes` (largest first), taking the largest that fits each time."""
    out = []
    for piece in sizes:
        while size >= piece:
            out.append(piece)
            size -= piece
    if size:
        raise ValueError(f"no call sizes {sizes} add up to {size} more frames")
    return out
