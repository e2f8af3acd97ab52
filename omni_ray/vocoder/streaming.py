"""Codec-agnostic streaming vocoder: turns arriving codec frames into final PCM chunks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Generator, Protocol, TypeVar, runtime_checkable

import torch

from omni_ray.vocoder.reference_states import PrimedState, PrimedStates, reference_key
from omni_ray.vocoder.schedule import ChunkSchedule, reference_call_sizes, split_into_calls

Result = TypeVar("Result")

__all__ = ["Codec", "StatefulCodec", "StatefulStreamingDecoder", "StreamingDecoder", "measure_trim", "run_calls",
           "run_calls_async"]


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


def joined_frames(held: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`held` then `codes` along the frame axis, on the codes' device. Codes relayed on a GPU stay there: copied to
    the host, each stream's frames waited for the copy (in the 1-GPU service under MPS, 32 such copies per vocoder
    step took 28 ms of host time at 32 streams), and the decode then copied them back. A GPU
    tensor is marked as used on the current stream, which its maker's stream (the relay's) may not be."""
    if codes.is_cuda:
        codes.record_stream(torch.cuda.current_stream(codes.device))
    if held.shape[1] == 0:
        return codes
    return torch.cat([held.to(codes.device), codes], dim=1)


CodecCall = Any  # what a decoder asks its codec for: a window's codes, or a stateful step's `StepCall`
Calls = Generator[CodecCall, torch.Tensor, Result]  # yields codec calls, is sent their samples, returns its result
Submit = Callable[[CodecCall], concurrent.futures.Future[torch.Tensor]]  # e.g. `BatchWorker.submit_nowait`


def run_calls(calls: Calls[Result], run: Callable[[CodecCall], torch.Tensor]) -> Result:
    """Drive `calls` on this thread, each codec call run (and waited for) by `run`."""
    try:
        call = next(calls)
        while True:
            call = calls.send(run(call))
    except StopIteration as done:
        return done.value


async def run_calls_async(calls: Calls[Result], submit: Submit) -> Result:
    """Drive `calls` on the event loop: each codec call is `submit`ted (to a batching worker: the calls that many
    streams submit in one pass of the loop decode as one batch) and awaited without a thread of its own. Cancelled
    while a call is in flight, the decoder hears of it once the call has run (its state slot is in use until then)."""
    try:
        call = next(calls)
        while True:
            future = submit(call)
            try:
                samples = await asyncio.shield(asyncio.wrap_future(future))
            except asyncio.CancelledError:
                future.add_done_callback(lambda _: calls.close())
                raise
            except Exception as exc:
                call = calls.throw(exc)
                continue
            call = calls.send(samples)
    except StopIteration as done:
        return done.value


class _ScheduledDecoder:
    """What both streaming decoders share: frames in, chunks of final samples out on the schedule, and the counts.
    Subclasses keep the frames (`_append`), decode the next `size` of them (`_decode_next`, yielding the codec calls
    it needs) and run a codec call (`_run`). `push` and `finish` run their codec calls on the calling thread;
    `push_async` and `finish_async` hand them to a batching worker from the event loop."""

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
        self.reference_frames = 0  # frames decoded ahead of the first new one as its left context (a cloned voice)
        self._reference_audio = torch.zeros(0)  # the reference's last decoded samples (one frame's at most)

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

    def reference_tail(self, count: int) -> torch.Tensor:
        """The last `count` samples (at most one frame's) of the reference frames' audio, decoded with them as the
        first chunk's left context, from the first chunk on: a clone whose cut keeps some of the reference's audio
        prepends them (the stream itself starts at the first new frame)."""
        if not 0 <= count <= self._reference_audio.numel():
            raise ValueError(f"{count} reference samples asked for, {self._reference_audio.numel()} kept "
                             f"(reference frames: {self.reference_frames}; kept once the first chunk is decoded)")
        return self._reference_audio[self._reference_audio.numel() - count :].clone()

    def _keep_reference_audio(self, samples: torch.Tensor) -> None:
        """Samples just before the first new frame's (in order): the last frame's worth are kept."""
        joined = torch.cat([self._reference_audio, samples.reshape(-1).to(torch.float32)])
        self._reference_audio = joined[max(joined.numel() - self._spf, 0) :].clone()

    def push(self, frames: torch.Tensor, clock: int | None = None) -> list[torch.Tensor]:
        """Add ``[num_quantizers, n]`` frames (n >= 0); return every chunk the schedule now allows.

        `clock`: the producer's step count at the last of these frames (one frame per step before it), which an
        aligned schedule ends its chunks on. Each returned chunk is a 1-D float32 tensor of final samples.
        """
        return run_calls(self.push_calls(frames, clock), self._run)

    async def push_async(self, frames: torch.Tensor, clock: int | None, submit: Submit) -> list[torch.Tensor]:
        """`push`, its codec calls `submit`ted from the event loop (`run_calls_async`)."""
        return await run_calls_async(self.push_calls(frames, clock), submit)

    def push_calls(self, frames: torch.Tensor, clock: int | None = None) -> Calls[list[torch.Tensor]]:
        """`push` as the codec calls it makes (checked before the first)."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        return self._push_frames(self._check_codes(frames, "frames"), clock)

    def _push_frames(self, codes: torch.Tensor, clock: int | None) -> Calls[list[torch.Tensor]]:
        count = int(codes.shape[1])
        if not self.schedule.aligned or clock is None:
            return (yield from self._take(codes))
        chunks: list[torch.Tensor] = []
        for index in range(count):  # frame by frame against the clock
            chunks += yield from self._take(codes[:, index : index + 1], clock - (count - 1 - index))
        return chunks

    def _take(self, codes: torch.Tensor, clock: int | None = None) -> Calls[list[torch.Tensor]]:
        """Keep `codes` (frames made up to the producer's step `clock`) and decode the chunks now due."""
        chunks: list[torch.Tensor] = []
        if clock is not None and self.schedule.aligns(self._chunk_index, clock) and self._period_ended(clock):
            chunks += yield from self._next_chunk(self.pending_frames)  # its period ended at a step this stream sat out
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
            chunks += yield from self._next_chunk(size)
        return chunks

    def _period_ended(self, clock: int) -> bool:
        """Whether frames are pending from a clock period before `clock`'s."""
        steady = self.schedule.steady
        return self.pending_frames > 0 and self._clock is not None and clock // steady > self._clock // steady

    def _period_ends(self, clock: int, pending: int) -> bool:
        """Whether `pending` frames, the last made at step `clock`, make an aligned chunk now."""
        return pending >= self.schedule.steady or (pending > 0 and (clock + 1) % self.schedule.steady == 0)

    def _next_chunk(self, size: int) -> Calls[list[torch.Tensor]]:
        chunk = yield from self._decode_next(size)
        self._chunk_index += 1
        return [chunk] if chunk is not None else []

    def finish(self) -> torch.Tensor | None:
        """Decode the remaining (partial-chunk) frames and end the stream.

        Returns the last chunk, or ``None`` if nothing is left. The final ``trim`` samples of the
        stream are not produced, exactly as in a one-shot decode of all frames.
        """
        return run_calls(self.finish_calls(), self._run)

    async def finish_async(self, submit: Submit) -> torch.Tensor | None:
        """`finish`, its codec calls `submit`ted from the event loop (`run_calls_async`)."""
        return await run_calls_async(self.finish_calls(), submit)

    def finish_calls(self) -> Calls[torch.Tensor | None]:
        """`finish` as the codec calls it makes (checked before the first)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._finish_frames()

    def _finish_frames(self) -> Calls[torch.Tensor | None]:
        if self.pending_frames == 0:
            return None
        return (yield from self._decode_next(self.pending_frames))

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

    def _decode_next(self, size: int) -> Calls[torch.Tensor | None]:
        raise NotImplementedError

    def _run(self, call: CodecCall) -> torch.Tensor:
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

    def _run(self, call: CodecCall) -> torch.Tensor:
        return self.codec.decode(call)

    def _decode_next(self, size: int) -> Calls[torch.Tensor | None]:
        start = self._decoded
        end = start + size
        window_start = max(start - self.schedule.left_context, -self.reference_frames)
        # left_context * spf >= trim guarantees the held-back samples are inside the window.
        assert window_start * self._spf <= self._emitted
        codes = self._buf[:, window_start - self._buf_start : end - self._buf_start]
        wav = (yield codes).reshape(-1)
        expected = (end - window_start) * self._spf - self._trim
        if wav.numel() != expected:
            raise RuntimeError(
                f"codec returned {wav.numel()} samples for {end - window_start} frames, "
                f"expected {expected} (samples_per_frame={self._spf}, trim={self._trim})"
            )
        final_end = end * self._spf - self._trim  # samples before this are final
        offset = window_start * self._spf  # sample position of wav[0]
        if start == 0 and offset < 0:  # the reference frames' audio, decoded as this first window's context
            self._keep_reference_audio(wav[: -offset])
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
    ``finish()`` calls); closed while a step is in flight, it frees the slot once the step has run.

    `reference_codes` (a cloned voice's): decoded into the stream's state ahead of its first chunk, in calls of the
    sizes `reference_call_sizes` gives, their audio dropped (its last frame's kept for `reference_tail`); the
    chunks are then a one-shot decode of [reference + new frames] from the first new frame on."""

    def __init__(self, codec: StatefulCodec, schedule: ChunkSchedule | None = None,
                 reference_codes: torch.Tensor | None = None) -> None:
        super().__init__(codec, schedule)
        self.stateful_codec = codec
        self._pending = torch.zeros(self._q, 0, dtype=torch.long)
        self._reference = (self._check_codes(reference_codes, "reference_codes") if reference_codes is not None
                           else torch.zeros(self._q, 0, dtype=torch.long))  # not yet in the state
        self.reference_frames = int(self._reference.shape[1])
        self._position = 0  # frames through the codec state so far (reference frames included)
        self._slot: int | None = codec.open_stream()
        self._guard = threading.Lock()  # the slot against a close() from another thread
        self._in_flight = False  # a step on the slot has been asked for and not yet returned (or failed)
        self._close_asked = False

    def finish_calls(self) -> Calls[torch.Tensor | None]:
        """Decode the remaining (partial-chunk) frames, end the stream and free its slot; None if nothing is left."""
        calls = super().finish_calls()
        try:
            return (yield from calls)
        finally:
            self.close()

    def close(self) -> None:
        """Free the codec state slot (idempotent; an aborted stream calls it without finishing), or, with a step in
        flight, once that step has run: until then the step still reads and writes the slot."""
        with self._guard:
            if self._in_flight:
                self._close_asked = True
            else:
                self._release()

    def _release(self) -> None:
        if self._slot is not None:
            self.stateful_codec.close_stream(self._slot)
            self._slot = None

    def _append(self, codes: torch.Tensor) -> None:
        self._pending = joined_frames(self._pending, codes)

    def _run(self, call: CodecCall) -> torch.Tensor:
        return self.stateful_codec.step(*call)

    def _decode_next(self, size: int) -> Calls[torch.Tensor | None]:
        if self._reference.shape[1]:
            yield from self._prime()
        first = self._decoded == 0
        if self._finished or first:  # one call of the scheduled size (the last, partial chunk padded)
            calls = [max(size, self.schedule.chunk_size(self._chunk_index))]
        else:  # an aligned chunk may be shorter than its schedule's: calls of the sizes the codec has shapes for
            calls = split_into_calls(size, self.schedule.later_sizes())
        chunks = []
        for call in calls:
            chunks.append((yield from self._step(min(call, self.pending_frames), call)))
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _prime(self) -> Calls[None]:
        """Decode the reference frames into the state (their audio's last frame kept, the rest dropped); with a codec
        that keeps primed states (`primed_states`), a reference decoded before is copied into the slot instead, and
        one decoded now is kept."""
        reference, self._reference = self._reference, self._reference[:, :0]
        primed: PrimedStates | None = getattr(self.stateful_codec, "primed_states", None)
        key = reference_key(reference) if primed is not None else ""
        entry = primed.get(key) if primed is not None else None
        if entry is not None:
            self.stateful_codec.load_state(self._open_slot(), entry.state)  # type: ignore[attr-defined]
            self._position = entry.frames
            self._reference_audio = entry.reference_audio
            return
        yield from self._decode_reference(reference)
        if primed is not None:
            audio = self._reference_audio
            self.stateful_codec.save_state(  # type: ignore[attr-defined]
                self._open_slot(), lambda state: primed.put(key, PrimedState(int(reference.shape[1]), state, audio)))

    def _open_slot(self) -> int:
        with self._guard:
            if self._slot is None or self._close_asked:
                raise RuntimeError("the stream is closed")
            return self._slot

    def _decode_reference(self, reference: torch.Tensor) -> Calls[None]:
        done = 0
        for frames in split_into_calls(int(reference.shape[1]), reference_call_sizes(self.schedule)):
            start = self._output_start()
            wav = yield from self._call(reference[:, done : done + frames])
            self._keep_reference_audio(wav[: max(-start, 0)])
            done += frames
            self._position += frames

    def _step(self, size: int, frames: int) -> Calls[torch.Tensor]:
        """One codec call of `frames` new frames, the first `size` of them pending ones (the rest zero padding)."""
        codes = self._pending[:, :size]
        if size < frames:
            codes = torch.cat([codes, codes.new_zeros(self._q, frames - size)], dim=1)
        start = self._output_start()
        wav = yield from self._call(codes)
        if start < 0:  # the first call after the reference's: its head is the reference audio's last `trim` samples
            self._keep_reference_audio(wav[: -start])
        final_end = (self._decoded + size) * self._spf - self._trim
        chunk = wav[self._emitted - start : final_end - start].to(torch.float32)
        self._pending = self._pending[:, size:]
        self._decoded += size
        self._position += size
        self._emitted += int(chunk.numel())
        return chunk

    def _output_start(self) -> int:
        """The stream sample (0: the first new frame's first) at which the next call's output starts: a stream's
        first call yields every sample from its first frame on, a later one from `trim` samples before its first."""
        start = (self._position - self.reference_frames) * self._spf
        return start if self._position == 0 else start - self._trim

    def _call(self, codes: torch.Tensor) -> Calls[torch.Tensor]:
        """One codec call on the stream's slot, at its position: the samples it yields, flat."""
        with self._guard:
            if self._slot is None or self._close_asked:
                raise RuntimeError("the stream is closed")
            self._in_flight = True
        try:
            wav = yield (codes, self._position, self._slot, self._position == 0)
        finally:
            with self._guard:
                self._in_flight = False
                if self._close_asked:
                    self._release()
        return wav.reshape(-1)
