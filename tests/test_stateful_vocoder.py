"""Stateful streaming Code2Wav: decoding only new frames per chunk, with attention and convolution state carried,
equals a one-shot decode of every frame, alone, batched across streams at different positions, and through the
streaming decoder and the batching worker (tiny Code2Wav with the released geometry, fp32, CPU)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from test_streaming_vocoder import SPF, TRIM, _codes, _tiny_code2wav

from omni_ray.errors import CapacityError
from omni_ray.vocoder import ChunkSchedule, Code2WavCodec, StatefulStreamingDecoder, step_shapes
from omni_ray.vocoder.batching import BatchingStatefulCodec, stacked
from omni_ray.vocoder.code2wav_state import StatefulCode2Wav, StateStore


@pytest.fixture(scope="module")
def codec() -> Code2WavCodec:
    return Code2WavCodec(_tiny_code2wav(), max_streams=8)


def _one_shot(codec: Code2WavCodec, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return codec.module(codes[None]).flatten()


def test_chunks_of_new_frames_equal_the_one_shot_decode_past_the_attention_window(codec: Code2WavCodec) -> None:
    codes = _codes(100)  # longer than the 72-frame attention window
    stateful = StatefulCode2Wav(codec.module)
    pieces, state, position = [], None, 0
    for size in (1, 2, 4, 8, 3, *(8,) * 10, 2):  # 100 frames in uneven chunks
        wav, state = stateful.step(codes[None, :, position : position + size], torch.tensor([position]), state)
        expected = size * SPF - (TRIM if position == 0 else 0)
        assert wav.shape == (1, expected)
        pieces.append(wav[0])
        position += size
    streamed, whole = torch.cat(pieces), _one_shot(codec, codes)
    assert position == 100 and streamed.shape == whole.shape == (100 * SPF - TRIM,)
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    assert whole.std() > 0.01  # the comparison is not between near-zero signals


def test_streams_at_different_positions_step_together_from_their_slots(codec: Code2WavCodec) -> None:
    """Stream a has decoded 24 frames and stream b 8; then one batched call steps both by 8 frames, each from its
    own state slot, and each gets its own one-shot samples. Padding rows (the batch of 2 runs as is; 3 rows pad to
    4) write only the scratch slot."""
    a, b, c = _codes(40, seed=1), _codes(40, seed=2), _codes(40, seed=3)
    slot_a, slot_b, slot_c = codec.open_stream(), codec.open_stream(), codec.open_stream()
    assert codec.states is not None and codec.states.in_use == 3
    try:
        codec.step_batch(a[None, :, :24], torch.tensor([0]), torch.tensor([slot_a]), True)
        codec.step_batch(torch.stack([b[:, :8], c[:, :8]]), torch.tensor([0, 0]), torch.tensor([slot_b, slot_c]), True)
        both = codec.step_batch(torch.stack([a[:, 24:32], b[:, 8:16], c[:, 8:16]]), torch.tensor([24, 8, 8]),
                                torch.tensor([slot_a, slot_b, slot_c]), False)
        for row, (codes, start) in enumerate(((a, 24), (b, 8), (c, 8))):
            expected = _one_shot(codec, codes[:, : start + 8])[start * SPF - TRIM :]
            torch.testing.assert_close(both[row], expected, rtol=0, atol=1e-5)
    finally:
        for slot in (slot_a, slot_b, slot_c):
            codec.close_stream(slot)
    assert codec.states.in_use == 0
    with pytest.raises(ValueError, match="not in use"):
        codec.close_stream(slot_a)


def test_the_state_store_keeps_each_slots_state_tensors_apart_in_its_one_buffer() -> None:
    """State tensors of several shapes, handed in as strided views (as a step keeps them), scattered into two slots
    and gathered back in another order: each slot's tensors come back as they went in, the untouched slot stays zero,
    and a second scatter into one slot leaves the other as it was."""
    store = StateStore([(3, 4), (2,), (5, 1)], torch.float32, torch.device("cpu"), capacity=4)
    first = [torch.randn(2, 4, 3).transpose(1, 2), torch.randn(2, 6)[:, 1:3], torch.randn(2, 5, 3)[..., 1:2]]
    store.scatter(torch.tensor([2, 0]), first)
    got = store.gather(torch.tensor([0, 1, 2]))
    assert [tuple(t.shape) for t in got] == [(3, 3, 4), (3, 2), (3, 5, 1)]
    for sent, back in zip(first, got):
        assert torch.equal(back[0], sent[1]) and torch.equal(back[2], sent[0]) and not back[1].any()
    second = [torch.full((1, *t.shape[1:]), 7.0) for t in first]
    store.scatter(torch.tensor([2]), second)
    for sent, back in zip(first, store.gather(torch.tensor([0, 2]))):
        assert torch.equal(back[0], sent[1]) and bool((back[1] == 7).all())
    assert store.bytes_per_stream() == (12 + 2 + 5) * 4


def test_a_full_state_store_refuses_a_stream_with_a_clear_error() -> None:
    small = Code2WavCodec(_tiny_code2wav(), max_streams=1)
    slot = small.open_stream()
    with pytest.raises(CapacityError, match="max_streams"):
        small.open_stream()
    small.close_stream(slot)
    assert small.open_stream() == slot


def test_streaming_decoder_over_the_batching_worker_equals_one_shot_for_concurrent_streams(codec: Code2WavCodec) -> None:
    """Several streams at once, frames pushed in uneven pieces, ending on a partial chunk: each stream's chunks
    join into its own one-shot decode."""
    schedule = ChunkSchedule((1, 2, 4), 8, 25)
    worker = BatchingStatefulCodec(codec, max_batch=4)
    lengths = (37, 20, 9, 53)

    def run(index: int) -> torch.Tensor:
        codes = _codes(lengths[index], seed=10 + index)
        decoder = StatefulStreamingDecoder(worker, schedule)
        chunks, sent = [], 0
        for piece in (3, 1, 5, 2, 7) * 20:
            if sent >= codes.shape[1]:
                break
            chunks += decoder.push(codes[:, sent : sent + piece])
            sent += piece
        last = decoder.finish()  # frees the stream's slot
        chunks += [last] if last is not None else []
        assert decoder.samples_emitted == lengths[index] * SPF - TRIM
        return torch.cat(chunks)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(4)))
    for index, streamed in enumerate(results):
        whole = _one_shot(codec, _codes(lengths[index], seed=10 + index))
        torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    assert worker.worker.batches < worker.worker.windows  # some steps of different streams ran together
    assert codec.states is not None and codec.states.in_use == 0


def test_closing_an_unfinished_stream_frees_its_slot(codec: Code2WavCodec) -> None:
    decoder = StatefulStreamingDecoder(BatchingStatefulCodec(codec), ChunkSchedule((1, 2, 4), 8, 25))
    assert codec.states is not None and codec.states.in_use == 1
    assert len(decoder.push(_codes(5))) == 2  # chunks of 1 and 2 frames; 2 frames wait for a chunk of 4
    decoder.close()
    decoder.close()
    assert codec.states.in_use == 0
    with pytest.raises(RuntimeError, match="closed"):
        decoder.push(_codes(4))


def test_step_shapes_cover_the_schedule() -> None:
    assert step_shapes(ChunkSchedule((1, 2, 4), 8, 25)) == [(1, True), (2, False), (4, False), (8, False)]
    assert step_shapes(ChunkSchedule((2, 2), 6, 1)) == [(2, True), (2, False), (6, False)]


class _DeviceRecordingDecoder:
    """A `StatefulBatchDecoder` that records the device of the codes each batched step is handed (zeros out)."""

    num_quantizers, samples_per_frame, sample_rate, trim = 16, SPF, 24000, TRIM

    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def open_stream(self) -> int:
        return 0

    def close_stream(self, slot: int) -> None:
        pass

    def step_batch(self, codes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, first: bool) -> torch.Tensor:
        self.devices.append(codes.device)
        return torch.zeros(codes.shape[0], codes.shape[-1] * SPF - (TRIM if first else 0))


def test_codes_relayed_on_a_device_reach_the_batched_step_there() -> None:
    """Frames a relay hands over on a GPU are kept and batched on it, not copied to the host per stream and back
    (the meta device stands in for a GPU here); a stream fed on the host still batches with them."""
    decoder = _DeviceRecordingDecoder()
    codec = BatchingStatefulCodec(decoder)
    schedule = ChunkSchedule((1, 2, 4), 8, 25)
    on_device = StatefulStreamingDecoder(codec, schedule)
    chunks = [len(on_device.push(_codes(n).to("meta"))) for n in (1, 2, 3)]  # chunks of 1, then 2, then 4 waits
    assert chunks == [1, 1, 0] and decoder.devices == [torch.device("meta")] * 2
    assert on_device.finish() is not None and decoder.devices[-1] == torch.device("meta")
    assert stacked([_codes(2).to("meta"), _codes(2)]).device == torch.device("meta")  # a host-fed stream joins


def test_streams_on_one_event_loop_decode_in_one_batch_per_step(codec: Code2WavCodec) -> None:
    """As the vocoder stage runs its streams: each a coroutine on one event loop, its codec calls submitted to the
    batching worker without a thread of its own. Four streams push a frame per step: the calls they make at the same
    step (chunks of 1, 2, 4, 8 frames, then the partial last one) run as one batched call each, and each stream's
    chunks join into its one-shot decode."""
    worker = BatchingStatefulCodec(codec, max_batch=4, gather_s=0.05)
    schedule = ChunkSchedule((1, 2, 4), 8, 25)
    codes = [_codes(21, seed=40 + index) for index in range(4)]

    async def run() -> list[torch.Tensor]:
        decoders = [StatefulStreamingDecoder(worker, schedule) for _ in codes]
        chunks: list[list[torch.Tensor]] = [[] for _ in codes]
        for step in range(21):
            pushed = await asyncio.gather(*(decoder.push_async(codes[index][:, step : step + 1], step,
                                                               worker.worker.submit_nowait)
                                            for index, decoder in enumerate(decoders)))
            for index, got in enumerate(pushed):
                chunks[index] += got
        lasts = await asyncio.gather(*(decoder.finish_async(worker.worker.submit_nowait) for decoder in decoders))
        return [torch.cat([*got, last]) for got, last in zip(chunks, lasts)]

    streamed = asyncio.run(run())
    for index, samples in enumerate(streamed):
        torch.testing.assert_close(samples, _one_shot(codec, codes[index]), rtol=0, atol=1e-5)
    assert (worker.worker.batches, worker.worker.windows) == (5, 20)
    assert codec.states is not None and codec.states.in_use == 0


def test_a_stream_cancelled_with_a_call_in_flight_frees_its_slot_once_the_call_has_run(codec: Code2WavCodec) -> None:
    """The stage closes an aborted stream while its decode call may still be queued: the call still reads and
    writes the stream's state slot, so the slot is freed only once the call has run, not when the stream closes."""
    held: list[Future[torch.Tensor]] = []

    def submit(call: object) -> Future[torch.Tensor]:
        held.append(Future())
        return held[-1]

    async def run() -> None:
        decoder = StatefulStreamingDecoder(BatchingStatefulCodec(codec), ChunkSchedule((1, 2, 4), 8, 25))
        task = asyncio.ensure_future(decoder.push_async(_codes(1), 0, submit))
        while not held:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        decoder.close()
        assert codec.states is not None and codec.states.in_use == 1  # the call still holds the slot
        held[0].set_result(torch.zeros(SPF))
        assert codec.states.in_use == 0
        with pytest.raises(RuntimeError, match="closed"):
            decoder.push(_codes(2))

    asyncio.run(run())


@pytest.mark.parametrize("reference_frames", [1, 5, 13])
def test_a_stream_opened_with_reference_codes_continues_their_decode(codec: Code2WavCodec,
                                                                     reference_frames: int) -> None:
    """Reference codes (a cloned voice's) go into the stream's state ahead of its first chunk: the chunks are the
    one-shot decode of [reference + new frames] from the first new frame on (Code2Wav's held-back 555 samples of
    the reference come out of the first chunk's call and are dropped with the rest of the reference audio), and
    `reference_tail` gives the reference audio's last samples. Every call is a shape `step_shapes` declares."""
    reference, new = _codes(reference_frames, seed=11), _codes(19, seed=12)
    joined = _one_shot(codec, torch.cat([reference, new], dim=1))
    schedule = ChunkSchedule()
    shapes: list[tuple[int, bool]] = []

    class Recording(BatchingStatefulCodec):
        def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor:
            shapes.append((int(codes.shape[1]), first))
            return super().step(codes, position, slot, first)

    decoder = StatefulStreamingDecoder(Recording(codec), schedule, reference_codes=reference)
    chunks = decoder.push(new[:, :12])  # chunks of 1, 2 and 4 frames; 5 left for finish()
    last = decoder.finish()
    assert last is not None
    audio = torch.cat([*chunks, last])
    assert decoder.reference_frames == reference_frames
    assert audio.shape == (12 * SPF - TRIM,)
    torch.testing.assert_close(audio, joined[reference_frames * SPF : reference_frames * SPF + 12 * SPF - TRIM],
                               rtol=0, atol=1e-5)
    last_reference_frame = joined[(reference_frames - 1) * SPF : reference_frames * SPF]
    torch.testing.assert_close(decoder.reference_tail(SPF), last_reference_frame, rtol=0, atol=1e-5)
    assert set(shapes) <= set(step_shapes(schedule, reference=True)) and shapes[0][1]
    assert codec.states is not None and codec.states.in_use == 0


def test_a_voice_decoded_before_starts_from_its_kept_state_with_the_same_audio(codec: Code2WavCodec) -> None:
    """With primed states kept, the first stream in a voice decodes the reference and keeps the state after it; a
    later stream in that voice makes no reference call (its first call is its first chunk's, a later call at the
    reference's position) and its audio and reference tail equal the first's, sample for sample, while a stream in
    another voice between them is decoded from its own reference. A budget smaller than one state keeps none."""
    reference, other, new = _codes(13, seed=21), _codes(6, seed=22), _codes(15, seed=23)
    schedule = ChunkSchedule()
    calls: list[tuple[int, int, bool]] = []

    class Recording(BatchingStatefulCodec):
        def step(self, codes: torch.Tensor, position: int, slot: int, first: bool) -> torch.Tensor:
            calls.append((int(codes.shape[1]), position, first))
            return super().step(codes, position, slot, first)

    def speak(worker: BatchingStatefulCodec, voice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
        calls.clear()
        decoder = StatefulStreamingDecoder(worker, schedule, reference_codes=voice)
        chunks = decoder.push(new[:, :12])
        last = decoder.finish()
        assert last is not None
        return torch.cat([*chunks, last]), decoder.reference_tail(SPF), list(calls)

    worker = Recording(codec, primed_bytes=64 * 2**20)
    assert worker.primed_states is not None
    first_audio, first_tail, first_calls = speak(worker, reference)
    assert first_calls[0] == (8, 0, True)  # the reference's 13 frames: 8, 4 and 1
    other_audio, _, _ = speak(worker, other)
    again_audio, again_tail, again_calls = speak(worker, reference)
    assert again_calls[0] == (1, 13, False)  # straight to the first chunk, after the reference's 13 frames
    assert len(again_calls) == len(first_calls) - 3
    torch.testing.assert_close(again_audio, first_audio, rtol=0, atol=0)
    torch.testing.assert_close(again_tail, first_tail, rtol=0, atol=0)
    joined_other = _one_shot(codec, torch.cat([other, new], dim=1))
    torch.testing.assert_close(other_audio, joined_other[6 * SPF : 6 * SPF + 12 * SPF - TRIM], rtol=0, atol=1e-5)
    assert worker.primed_states.stats()["reference_state_hits"] == 1
    assert worker.primed_states.stats()["reference_state_entries"] == 2

    tiny = Recording(codec, primed_bytes=1)
    speak(tiny, reference)
    _, _, calls_again = speak(tiny, reference)
    assert tiny.primed_states is not None and calls_again[0] == (8, 0, True) and not tiny.primed_states.entries
    assert codec.states is not None and codec.states.in_use == 0
