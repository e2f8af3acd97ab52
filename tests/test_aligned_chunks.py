"""Chunks aligned to the producer's step clock: streams started at different steps decode together after their
ramps, each stream's audio still equals its one-shot decode, and every call has a shape the codec warmed up (tiny
Code2Wav with the released geometry, fp32, CPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_stateful_vocoder import _one_shot
from test_streaming_vocoder import SPF, TRIM, _codes, _RecordingCodec, _tiny_code2wav

from omni_ray.vocoder import ChunkSchedule, Code2WavCodec, StatefulStreamingDecoder, StreamingDecoder, step_shapes
from omni_ray.vocoder import decode_window_lengths
from omni_ray.vocoder.batching import BatchingStatefulCodec
from omni_ray.vocoder.schedule import split_into_calls

ALIGNED = ChunkSchedule((1, 2, 4), 8, 25, aligned=True)


@pytest.fixture(scope="module")
def codec() -> Code2WavCodec:
    return Code2WavCodec(_tiny_code2wav(), max_streams=8)


class _ShapeRecorder:
    """A `StatefulCodec` over the batching worker that records each call's (new frames, first call)."""

    def __init__(self, inner: BatchingStatefulCodec) -> None:
        self.inner = inner
        self.num_quantizers, self.samples_per_frame, self.trim = inner.num_quantizers, inner.samples_per_frame, inner.trim
        self.calls: list[tuple[int, bool]] = []

    def open_stream(self) -> int:
        return self.inner.open_stream()

    def close_stream(self, slot: int) -> None:
        self.inner.close_stream(slot)

    def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor:
        self.calls.append((int(codes.shape[1]), first))
        return self.inner.step(codes, position, slot, first)


def test_streams_started_at_different_steps_decode_at_the_same_steps_after_their_ramps(codec: Code2WavCodec) -> None:
    """Four streams start at steps 0, 3, 5 and 6 of a shared clock and push a frame per step (the third sits out
    steps 22-24, as a Talker row waiting for the Thinker does). After each ramp (1, 2, 4 frames), every chunk ends at
    a step ending a period of 8 (or, for the period the third stream left early, at its next step), so all four
    decode at the same steps; each stream's chunks join into its one-shot decode; every call's shape is one the
    schedule's `step_shapes` warms up."""
    starts, length = (0, 3, 5, 6), 45
    skipped = {2: {22, 23, 24}}
    recorder = _ShapeRecorder(BatchingStatefulCodec(codec, max_batch=4))
    decoders = [StatefulStreamingDecoder(recorder, ALIGNED) for _ in starts]
    codes = [_codes(length, seed=30 + index) for index in range(len(starts))]
    sent = [0] * len(starts)
    decode_steps: list[list[int]] = [[] for _ in starts]
    chunks: list[list[torch.Tensor]] = [[] for _ in starts]

    def push(index: int, clock: int) -> None:
        if clock < starts[index] or sent[index] >= length or clock in skipped.get(index, ()):
            return
        decoder = decoders[index]
        got = decoder.push(codes[index][:, sent[index] : sent[index] + 1], clock)
        if got and decoder.frames_received > 7:  # past the ramp
            decode_steps[index].append(clock)
        chunks[index] += got
        sent[index] += 1

    with ThreadPoolExecutor(max_workers=len(starts)) as pool:
        for clock in range(80):
            list(pool.map(lambda index: push(index, clock), range(len(starts))))
    for index, decoder in enumerate(decoders):
        last = decoder.finish()
        chunks[index] += [last] if last is not None else []
        torch.testing.assert_close(torch.cat(chunks[index]), _one_shot(codec, codes[index]), rtol=0, atol=1e-5)
        assert decoder.samples_emitted == length * SPF - TRIM
    for index, steps in enumerate(decode_steps):
        ends = [step for step in steps if step != 25 or index != 2]  # stream 2 learnt of the period's end at 25
        assert all((step + 1) % 8 == 0 for step in ends) and len(ends) >= len(steps) - 1, (index, steps)
    assert {15, 31, 39} <= set.intersection(*(set(steps) for steps in decode_steps))
    assert 25 in decode_steps[2]
    assert set(recorder.calls) <= set(step_shapes(ALIGNED))
    assert recorder.inner.worker.batches < recorder.inner.worker.windows  # streams' calls ran together
    assert codec.states is not None and codec.states.in_use == 0


def test_without_a_clock_an_aligned_schedule_is_the_plain_one(codec: Code2WavCodec) -> None:
    plain = StatefulStreamingDecoder(BatchingStatefulCodec(codec), ChunkSchedule((1, 2, 4), 8, 25))
    aligned = StatefulStreamingDecoder(BatchingStatefulCodec(codec), ALIGNED)
    codes = _codes(30, seed=3)
    for frame in range(30):
        sizes = [[c.numel() for c in d.push(codes[:, frame : frame + 1])] for d in (plain, aligned)]
        assert sizes[0] == sizes[1]
    for decoder in (plain, aligned):
        decoder.close()


@pytest.mark.parametrize("n_ref", [0, 3, 40])
def test_aligned_windows_stay_within_the_warmed_up_window_lengths(codec: Code2WavCodec, n_ref: int) -> None:
    schedule = ChunkSchedule((1, 2, 4), 8, 6, aligned=True)
    allowed = set(decode_window_lengths(schedule, reference_frames=n_ref))
    recorder = _RecordingCodec(codec)
    ref = _codes(n_ref, seed=7) if n_ref else None
    for offset in range(8):  # every phase of the clock at the stream's start
        decoder = StreamingDecoder(recorder, schedule, reference_codes=ref)
        codes = _codes(30, seed=offset)
        for frame in range(30):
            decoder.push(codes[:, frame : frame + 1], offset + frame)
        decoder.finish()
    assert recorder.windows and set(recorder.windows) <= allowed


def test_aligned_schedules_warm_up_every_power_of_two_below_the_steady_chunk() -> None:
    assert step_shapes(ALIGNED) == [(1, True), (1, False), (2, False), (4, False), (8, False)]
    assert ChunkSchedule((2, 2), 6, 1, aligned=True).later_sizes() == [6, 4, 2, 1]
    assert split_into_calls(7, ALIGNED.later_sizes()) == [4, 2, 1]
    assert split_into_calls(8, ALIGNED.later_sizes()) == [8]
    with pytest.raises(ValueError, match="add up"):
        split_into_calls(3, [2])
    with pytest.raises(ValueError, match="aligned"):
        ChunkSchedule(aligned="yes")  # type: ignore[arg-type]
