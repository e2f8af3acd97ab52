"""Stateful streaming Code2Wav: decoding only new frames per chunk, with attention and convolution state carried,
equals a one-shot decode of every frame, alone, batched across streams at different positions, and through the
streaming decoder and the batching worker (tiny Code2Wav with the released geometry, fp32, CPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_streaming_vocoder import SPF, TRIM, _codes, _RecordingCodec, _tiny_code2wav

from omni_ray.errors import CapacityError
from omni_ray.vocoder import ChunkSchedule, Code2WavCodec, StatefulStreamingDecoder, StreamingDecoder, step_shapes
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


@pytest.mark.parametrize("stateful", [True, False])
def test_decodes_on_push_says_when_a_push_decodes(codec: Code2WavCodec, stateful: bool) -> None:
    """The vocoder stage pushes frames that complete no chunk on its event loop and only the others through a
    thread: `decodes_on_push` must name exactly the pushes that decode (bursts of 1-3 frames over the ramp and the
    steady chunks)."""
    schedule = ChunkSchedule((1, 2, 4), 8, 25)
    if stateful:
        batching = BatchingStatefulCodec(codec)
        decoder: StatefulStreamingDecoder | StreamingDecoder = StatefulStreamingDecoder(batching, schedule)
        decodes = lambda: batching.worker.windows  # noqa: E731
    else:
        window = _RecordingCodec(codec)
        decoder = StreamingDecoder(window, schedule)
        decodes = lambda: len(window.windows)  # noqa: E731
    predicted, seen = [], []
    for burst in [1, 1, 2, 1, 3, 1, 1, 2, 3, 3, 1, 2, 2, 3]:
        predicted.append(decoder.decodes_on_push(burst))
        before = decodes()
        decoder.push(_codes(burst))
        seen.append(decodes() > before)
    decoder.finish()
    assert predicted == seen and any(seen) and not all(seen)
