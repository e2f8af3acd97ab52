"""S2 Pro's stateful codec on the tiny checkpoint's codec: chunked streams equal the one-shot decode, streams in one
batch or interleaved keep apart, and a reopened slot starts clean."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint
from omni_ray.models.s2_pro.codec import S2ProCodec, load_codec
from omni_ray.models.s2_pro.codec_state import StatefulS2ProCodec
from omni_ray.vocoder.schedule import ChunkSchedule
from omni_ray.vocoder.streaming import StatefulStreamingDecoder

RAMP = (1, 2, 4, 8, 16)
FRAMES = 40  # the ramp and a partial chunk: several times the tiny post_module's window (8 frames)
ATOL = 1e-4


@pytest.fixture(scope="module")
def codec(tmp_path_factory: pytest.TempPathFactory) -> S2ProCodec:
    directory = write_tiny_checkpoint(Path(tmp_path_factory.mktemp("s2_pro_codec_state")))
    return load_codec(directory)


@pytest.fixture()
def stateful(codec: S2ProCodec) -> StatefulS2ProCodec:
    return StatefulS2ProCodec(codec, max_streams=4)


def random_codes(codec: S2ProCodec, frames: int, seed: int) -> torch.Tensor:
    """Codes [10, frames], some beyond their codebooks (the decode clamps them, as the one-shot does)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.config.semantic_codebook_size + 8, (codec.num_quantizers, frames),
                         generator=generator)


def chunk_sizes(frames: int) -> list[int]:
    sizes, left = [], frames
    for size in RAMP * (frames // sum(RAMP) + 1):
        if left <= 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    return sizes


def decode_in_chunks(stateful: StatefulS2ProCodec, slot: int, codes: torch.Tensor) -> torch.Tensor:
    pieces, position = [], 0
    for size in chunk_sizes(codes.shape[1]):
        pieces.append(stateful.step(codes[:, position : position + size], position, slot, position == 0))
        position += size
    return torch.cat(pieces)


def test_a_stream_in_ramp_chunks_is_the_one_shot_decode(codec: S2ProCodec, stateful: StatefulS2ProCodec) -> None:
    assert codec.config.quantizer_window < FRAMES
    codes = random_codes(codec, FRAMES, seed=0)
    slot = stateful.open_stream()
    streamed = decode_in_chunks(stateful, slot, codes)
    one_shot = codec.decode(codes)
    assert streamed.shape == one_shot.shape == (FRAMES * codec.samples_per_frame,)
    torch.testing.assert_close(streamed, one_shot, atol=ATOL, rtol=0)


def test_the_shared_streaming_decoder_over_it_emits_the_one_shot_decode(codec: S2ProCodec,
                                                                        stateful: StatefulS2ProCodec) -> None:
    codes = random_codes(codec, FRAMES - 3, seed=1)
    decoder = StatefulStreamingDecoder(stateful, ChunkSchedule(RAMP[:3], 8, 1))
    chunks = [chunk for index in range(codes.shape[1]) for chunk in decoder.push(codes[:, index : index + 1])]
    last = decoder.finish()
    streamed = torch.cat([*chunks, *([last] if last is not None else [])])
    torch.testing.assert_close(streamed, codec.decode(codes), atol=ATOL, rtol=0)
    assert stateful.states.in_use == 0  # finish() closed the stream


def test_interleaved_and_batched_streams_keep_apart(codec: S2ProCodec, stateful: StatefulS2ProCodec) -> None:
    frames = 3 * codec.config.quantizer_window
    first, second = random_codes(codec, frames, seed=2), random_codes(codec, frames, seed=3)
    slots = [stateful.open_stream(), stateful.open_stream()]
    outputs: list[list[torch.Tensor]] = [[], []]
    position = 0
    for size in chunk_sizes(frames):  # both streams' chunks as one batched call, then each alone, in turn
        window = slice(position, position + size)
        if size % 2:
            batch = torch.stack([first[:, window], second[:, window]])
            wav = stateful.step_batch(batch, torch.tensor([position] * 2), torch.tensor(slots), position == 0)
            outputs[0].append(wav[0])
            outputs[1].append(wav[1])
        else:
            for index, codes in enumerate((first, second)):
                outputs[index].append(stateful.step(codes[:, window], position, slots[index], position == 0))
        position += size
    for codes, pieces in zip((first, second), outputs):
        torch.testing.assert_close(torch.cat(pieces), codec.decode(codes), atol=ATOL, rtol=0)


def test_streams_at_different_positions_share_a_call(codec: S2ProCodec, stateful: StatefulS2ProCodec) -> None:
    early, late = random_codes(codec, 12, seed=4), random_codes(codec, 20, seed=5)
    slots = [stateful.open_stream(), stateful.open_stream()]
    head_early = stateful.step(early[:, :4], 0, slots[0], True)
    head_late = stateful.step(late[:, :12], 0, slots[1], True)
    tails = stateful.step_batch(torch.stack([early[:, 4:12], late[:, 12:20]]), torch.tensor([4, 12]),
                                torch.tensor(slots), False)
    torch.testing.assert_close(torch.cat([head_early, tails[0]]), codec.decode(early), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([head_late, tails[1]]), codec.decode(late), atol=ATOL, rtol=0)


def test_a_closed_and_reopened_slot_starts_clean(codec: S2ProCodec, stateful: StatefulS2ProCodec) -> None:
    slot = stateful.open_stream()
    decode_in_chunks(stateful, slot, random_codes(codec, FRAMES, seed=6))
    stateful.close_stream(slot)
    again = stateful.open_stream()
    codes = random_codes(codec, 15, seed=7)
    torch.testing.assert_close(decode_in_chunks(stateful, again, codes), codec.decode(codes), atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        stateful.close_stream(stateful.states.capacity)
