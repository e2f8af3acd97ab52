"""Codec-agnostic streaming vocoder: turns arriving codec frames into final PCM chunks."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "Codec",
    "ChunkSchedule",
    "StatefulCodec",
    "StatefulStreamingDecoder",
    "StreamingDecoder",
    "decode_window_lengths",
    "measure_trim",
    "step_shapes",
]


@runtime_checkable
class Codec(Protocol):
    """A causal frame-to-waveform decoder.

    ``decode`` takes ``[num_quantizers, T]`` int64 codes (a window of frames) and returns the
    codec's own 1-D float output for that window, which is ``T * samples_per_frame - trim``
    samples long: the last ``trim`` samples of a window depend on frames after it.
    """

    num_quantizers: int
    samples_per_frame: int
    sample_rate: int
    trim: int

    def decode(self, codes: torch.Tensor) -> torch.Tensor: ...


def measure_trim(codec: Codec, frames: int = 2) -> int:
    """Decode ``frames`` all-zero frames once and return how many trailing samples are missing."""
    codes = torch.zeros(codec.num_quantizers, frames, dtype=torch.long)
    produced = int(codec.decode(codes).numel())
    trim = frames * codec.samples_per_frame - produced
    if trim < 0 or produced == 0:
        raise ValueError(
            f"cannot measure trim from {frames} frames: decode produced {produced} samples "
            f"(expected between 1 and {frames * codec.samples_per_frame}); try more frames"
        )
    return trim


@dataclass(frozen=True)
class ChunkSchedule:
    """Chunk sizes in new frames: ``ramp`` first (low first-packet latency), then ``steady``.

    ``left_context`` is how many already-decoded frames precede the new frames in each decode
    window (capped by what exists). More context means closer to one-shot quality; at or above
    the codec's receptive field the streamed output equals the one-shot decode.

    ``aligned``: after the ramp, a chunk ends where the producer's step clock (pushed with the frames) ends a
    period of ``steady`` steps, so every stream fed by one producer decodes at the same steps, in one batched call,
    whenever it started; a chunk then holds up to ``steady`` frames (fewer on the way into step, or when the stream
    skipped steps). Without a clock the schedule is the plain one.
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


def step_shapes(schedule: ChunkSchedule) -> list[tuple[int, bool]]:
    """Every (new frames, first call) a ``StatefulStreamingDecoder`` on this schedule passes to ``step`` (its last,
    partial chunk is padded to the scheduled size)."""
    return [(schedule.chunk_size(0), True), *sorted((size, False) for size in schedule.later_sizes())]


def split_into_calls(size: int, sizes: list[int]) -> list[int]:
    """`size` frames as calls of the given sizes (largest first; they include 1 or `size` itself), largest first."""
    out = []
    for piece in sizes:
        while size >= piece:
            out.append(piece)
            size -= piece
    if size:
        raise ValueError(f"no call sizes {sizes} add up to {size} more frames")
    return out


def joined_frames(held: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`held` then `codes` along the frame axis, on the codes' device. Codes relayed on a GPU stay there: copied to
    the host, each stream's frames waited for the copy (in the 1-GPU service under MPS, 32 such copies per vocoder
    step took 28 ms of host time at 32 streams, session 15's profile), and the decode then copied them back. A GPU
    tensor is marked as used on the current stream, which its maker's stream (the relay's) may not be."""
    if codes.is_cuda:
        codes.record_stream(torch.cuda.current_stream(codes.device))
    if held.shape[1] == 0:
        return codes
    return torch.cat([held.to(codes.device), codes], dim=1)


class _ScheduledDecoder:
    """What both streaming decoders share: frames in, chunks of final samples out on the schedule, and the counts.
    Subclasses keep the frames (`_append`) and decode the next `size` of them (`_decode_next`)."""

    def __init__(self, codec: Codec | StatefulCodec, schedule: ChunkSchedule | None) -> None:
        self.codec = codec
        self.schedule = schedule if schedule is not None else ChunkSchedule()
        self._spf = int(codec.samples_per_frame)
        self._trim = int(codec.trim)
        self._q = int(codec.num_quantizers)
        self._received = 0  # new frames pushed so far
        self._decoded = 0  # new frames already decoded as "new" in some chunk
        self._emitted = 0  # samples emitted so far (all final)
        self._chunk_index = 0
        self._finished = False
        self._clock: int | None = None  # the producer's step at the last frame pushed (aligned schedules)

    # -- public API ---------------------------------------------------------------------------

    @property
    def frames_received(self) -> int:
        """New frames pushed so far (reference frames excluded)."""
        return self._received

    @property
    def samples_emitted(self) -> int:
        """Samples emitted so far."""
        return self._emitted

    @property
    def pending_frames(self) -> int:
        """Frames pushed but not yet decoded (waiting for the schedule's next chunk)."""
        return self._received - self._decoded

    def decodes_on_push(self, frames: int, clock: int | None = None) -> bool:
        """Whether pushing `frames` more frames (the last at the producer's step `clock`) completes a chunk (so
        `push` decodes, and may wait for a batched decode); otherwise `push` only keeps them and returns no chunk."""
        if not self.schedule.aligns(self._chunk_index, clock):
            return self.pending_frames + frames >= self.schedule.chunk_size(self._chunk_index)
        assert clock is not None
        return frames > 1 or self._period_ended(clock) or self._period_ends(clock, self.pending_frames + frames)

    def push(self, frames: torch.Tensor, clock: int | None = None) -> list[torch.Tensor]:
        """Add ``[num_quantizers, n]`` frames (n >= 0); return every chunk the schedule now allows.

        `clock`: the producer's step count at the last of these frames (one frame per step before it), which an
        aligned schedule ends its chunks on. Each returned chunk is a 1-D float32 tensor of final samples.
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        codes = self._check_codes(frames, "frames")
        count = int(codes.shape[1])
        if not self.schedule.aligned or clock is None:
            return self._take(codes)
        chunks: list[torch.Tensor] = []
        for index in range(count):  # frame by frame against the clock
            chunks += self._take(codes[:, index : index + 1], clock - (count - 1 - index))
        return chunks

    def _take(self, codes: torch.Tensor, clock: int | None = None) -> list[torch.Tensor]:
        """Keep `codes` (frames made up to the producer's step `clock`) and decode the chunks now due."""
        chunks: list[torch.Tensor] = []
        if clock is not None and self.schedule.aligns(self._chunk_index, clock) and self._period_ended(clock):
            chunks += self._next_chunk(self.pending_frames)  # its period ended at a step this stream sat out
        if codes.shape[1]:
            self._append(codes)
            self._received += int(codes.shape[1])
        if clock is not None:
            self._clock = clock
        while self.pending_frames:
            if self.schedule.aligns(self._chunk_index, clock):
                assert clock is not None
                if not self._period_ends(clock, self.pending_frames):
                    break
                size = min(self.pending_frames, self.schedule.steady)
            else:
                size = self.schedule.chunk_size(self._chunk_index)
                if self.pending_frames < size:
                    break
            chunks += self._next_chunk(size)
        return chunks

    def _period_ended(self, clock: int) -> bool:
        """Whether frames are pending from a clock period before `clock`'s."""
        steady = self.schedule.steady
        return self.pending_frames > 0 and self._clock is not None and clock // steady > self._clock // steady

    def _period_ends(self, clock: int, pending: int) -> bool:
        """Whether `pending` frames, the last made at step `clock`, make an aligned chunk now."""
        return pending >= self.schedule.steady or (pending > 0 and (clock + 1) % self.schedule.steady == 0)

    def _next_chunk(self, size: int) -> list[torch.Tensor]:
        chunk = self._decode_next(size)
        self._chunk_index += 1
        return [chunk] if chunk is not None else []

    def finish(self) -> torch.Tensor | None:
        """Decode the remaining (partial-chunk) frames and end the stream.

        Returns the last chunk, or ``None`` if nothing is left. The final ``trim`` samples of the
        stream are not produced, exactly as in a one-shot decode of all frames.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if self.pending_frames == 0:
            return None
        return self._decode_next(self.pending_frames)

    def _check_codes(self, codes: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(codes, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(codes).__name__}")
        if codes.dim() != 2 or codes.shape[0] != self._q:
            raise ValueError(
                f"{name} must have shape [num_quantizers={self._q}, n], got {tuple(codes.shape)}"
            )
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {codes.dtype}")
        return codes.to(torch.long)

    def _append(self, codes: torch.Tensor) -> None:
        raise NotImplementedError

    def _decode_next(self, size: int) -> torch.Tensor | None:
        raise NotImplementedError


class StreamingDecoder(_ScheduledDecoder):
    """Per-request streaming state: push codec frames, receive final PCM chunks.

    Sample bookkeeping uses positions relative to the first new (non-reference) frame: frame
    ``f`` covers samples ``[f * spf, (f + 1) * spf)``. A window over frames ``[w0, end)``
    yields samples ``[w0 * spf, end * spf - trim)``; everything before ``end * spf - trim`` is
    final, the last ``trim`` samples are held back and re-produced by the next window, which
    always reaches back far enough (the left context) to cover them. After ``finish()`` the
    emitted chunks total ``N * spf - trim`` samples, exactly a one-shot decode of the N frames.
    """

    def __init__(
        self,
        codec: Codec,
        schedule: ChunkSchedule | None = None,
        reference_codes: torch.Tensor | None = None,
    ) -> None:
        super().__init__(codec, schedule)
        if self._trim < 0:
            raise ValueError(f"codec.trim must be >= 0, got {self._trim}")
        # The window must reach back over the held-back samples: left_context * spf >= trim.
        if self.schedule.left_context * self._spf < self._trim:
            raise ValueError(
                f"left_context={self.schedule.left_context} frames cannot cover the codec's "
                f"{self._trim} held-back samples ({self._spf} samples per frame)"
            )
        ref = (
            self._check_codes(reference_codes, "reference_codes")
            if reference_codes is not None
            else torch.zeros(self._q, 0, dtype=torch.long)
        )
        self.reference_frames = int(ref.shape[1])
        # Only the tail that can ever be context is kept.
        keep = min(self.reference_frames, self.schedule.left_context)
        self._buf = ref[:, ref.shape[1] - keep :].clone()
        self._buf_start = -keep  # frame index of self._buf[:, 0]

    def _append(self, codes: torch.Tensor) -> None:
        self._buf = joined_frames(self._buf, codes)

    def _decode_next(self, size: int) -> torch.Tensor | None:
        start = self._decoded
        end = start + size
        window_start = max(start - self.schedule.left_context, -self.reference_frames)
        # left_context * spf >= trim guarantees the held-back samples are inside the window.
        assert window_start * self._spf <= self._emitted
        codes = self._buf[:, window_start - self._buf_start : end - self._buf_start]
        wav = self.codec.decode(codes).reshape(-1)
        expected = (end - window_start) * self._spf - self._trim
        if wav.numel() != expected:
            raise RuntimeError(
                f"codec returned {wav.numel()} samples for {end - window_start} frames, "
                f"expected {expected} (samples_per_frame={self._spf}, trim={self._trim})"
            )
        final_end = end * self._spf - self._trim  # samples before this are final
        offset = window_start * self._spf  # sample position of wav[0]
        chunk = None
        if final_end > self._emitted:
            chunk = wav[self._emitted - offset : final_end - offset].to(torch.float32, copy=True)
            self._emitted = final_end
        self._decoded = end
        self._drop_unneeded_frames()
        return chunk

    def _drop_unneeded_frames(self) -> None:
        keep_from = max(self._decoded - self.schedule.left_context, self._buf_start)
        if keep_from > self._buf_start:
            self._buf = self._buf[:, keep_from - self._buf_start :]
            self._buf_start = keep_from


@runtime_checkable
class StatefulCodec(Protocol):
    """A causal decoder that keeps each open stream's state (in a slot) between calls, so that a call decodes only
    its new frames: ``step(codes [Q, n], position, slot, first)`` → 1-D samples; a stream's first call yields
    ``n * samples_per_frame - trim`` samples, every later call ``n * samples_per_frame``."""

    num_quantizers: int
    samples_per_frame: int
    trim: int

    def open_stream(self) -> int: ...
    def close_stream(self, slot: int) -> None: ...
    def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor: ...


class StatefulStreamingDecoder(_ScheduledDecoder):
    """`StreamingDecoder`'s push/finish over a `StatefulCodec`: the same chunk schedule, but each chunk decodes only
    its new frames (no left context). Emitted chunks are final samples; after ``finish()`` they total
    ``N * spf - trim``, a one-shot decode of the N frames. The last partial chunk is padded with zero frames to
    its scheduled size (one decode shape per schedule step) and its output cut: the codec is causal, so frames
    after the real ones change nothing before them. The stream holds a codec state slot until ``close()`` (which
    ``finish()`` calls)."""

    def __init__(self, codec: StatefulCodec, schedule: ChunkSchedule | None = None) -> None:
        super().__init__(codec, schedule)
        self.stateful_codec = codec
        self._pending = torch.zeros(self._q, 0, dtype=torch.long)
        self._slot: int | None = codec.open_stream()
        self._lock = threading.Lock()  # a close() from another thread waits for a step in flight

    def finish(self) -> torch.Tensor | None:
        """Decode the remaining (partial-chunk) frames, end the stream and free its slot; None if nothing is left."""
        try:
            return super().finish()
        finally:
            self.close()

    def close(self) -> None:
        """Free the codec state slot (idempotent; an aborted stream calls it without finishing)."""
        with self._lock:
            if self._slot is not None:
                self.stateful_codec.close_stream(self._slot)
                self._slot = None

    def _append(self, codes: torch.Tensor) -> None:
        self._pending = joined_frames(self._pending, codes)

    def _decode_next(self, size: int) -> torch.Tensor:
        with self._lock:
            if self._slot is None:
                raise RuntimeError("the stream is closed")
            first = self._decoded == 0
            if self._finished or first:  # one call of the scheduled size (the last, partial chunk padded)
                calls = [max(size, self.schedule.chunk_size(self._chunk_index))]
            else:  # an aligned chunk may be shorter than its schedule's: calls of the sizes the codec has shapes for
                calls = split_into_calls(size, self.schedule.later_sizes())
            chunks = [self._step(min(call, self.pending_frames), call) for call in calls]
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _step(self, size: int, frames: int) -> torch.Tensor:
        """One codec call of `frames` new frames, the first `size` of them pending ones (the rest zero padding)."""
        assert self._slot is not None
        codes = self._pending[:, :size]
        if size < frames:
            codes = torch.cat([codes, codes.new_zeros(self._q, frames - size)], dim=1)
        first = self._decoded == 0
        wav = self.stateful_codec.step(codes, self._decoded, self._slot, first)
        chunk = wav.reshape(-1)[: max(size * self._spf - (self._trim if first else 0), 0)].to(torch.float32)
        self._pending = self._pending[:, size:]
        self._decoded += size
        self._emitted += int(chunk.numel())
        return chunk
