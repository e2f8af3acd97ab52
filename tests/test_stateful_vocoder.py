"""Stateful streaming Code2Wav: decoding only new frames per chunk, with attention and convolution state carried,
equals a one-shot decode of every frame, alone, batched across streams at different positions, and through the
streaming decoder and the batching worker (tiny Code2Wav with the released geometry, fp32, CPU)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_streaming_vocoder import SPF, TRIM, _codes, _tiny_code2wav

from omni_ray.vocoder import ChunkSchedule, Code2WavCodec, StatefulStreamingDecoder, step_shapes
from omni_ray.vocoder.batching import BatchingStatefulCodec
from omni_ray.vocoder.code2wav_state import StatefulCode2Wav, split_state, stack_states


@pytest.fixture(scope="module")
def codec() -> Code2WavCodec:
    return Code2WavCodec(_tiny_code2wav())


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


def test_streams_at_different_positions_batch_into_one_call(codec: Code2WavCodec) -> None:
    stateful = StatefulCode2Wav(codec.module)
    a, b = _codes(40, seed=1), _codes(40, seed=2)
    # stream a has decoded 24 frames, stream b 8: then both take 8 more frames in one batched call
    _, state_a = stateful.step(a[None, :, :24], torch.tensor([0]), None)
    _, state_b = stateful.step(b[None, :, :8], torch.tensor([0]), None)
    batched, state = stateful.step(torch.stack([a[:, 24:32], b[:, 8:16]]), torch.tensor([24, 8]),
                                   stack_states([state_a, state_b]))
    alone_a, _ = stateful.step(a[None, :, 24:32], torch.tensor([24]), state_a)
    alone_b, _ = stateful.step(b[None, :, 8:16], torch.tensor([8]), state_b)
    torch.testing.assert_close(batched, torch.cat([alone_a, alone_b]), rtol=0, atol=1e-6)
    torch.testing.assert_close(batched[0], _one_shot(codec, a[:, :32])[24 * SPF - TRIM :], rtol=0, atol=1e-5)
    rows = split_state(state, 2)
    assert len(rows) == 2 and all(t.shape[0] == 1 for t in rows[0])


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
        last = decoder.finish()
        chunks += [last] if last is not None else []
        assert decoder.samples_emitted == lengths[index] * SPF - TRIM
        return torch.cat(chunks)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(4)))
    for index, streamed in enumerate(results):
        whole = _one_shot(codec, _codes(lengths[index], seed=10 + index))
        torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    assert worker.worker.batches < worker.worker.windows  # some steps of different streams ran together


def test_step_shapes_cover_the_schedule() -> None:
    assert step_shapes(ChunkSchedule((1, 2, 4), 8, 25)) == [(1, True), (2, False), (4, False), (8, False)]
    assert step_shapes(ChunkSchedule((2, 2), 6, 1)) == [(2, True), (2, False), (6, False)]
