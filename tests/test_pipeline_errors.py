"""Bad requests fail alone with a clear client error; abandoned requests are freed in every stage."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from _reference import GREEDY, GREEDY_TALKER, run_pipeline, wav_part
from omni_ray.errors import InvalidRequestError
from omni_ray.engine.sampler import SamplingParams
from omni_ray.pipeline import AudioChunk

HELLO = [{"role": "user", "content": "Hello!"}]

BAD_REQUESTS: list[tuple[str, list[dict[str, Any]], dict[str, Any], str]] = [
    ("bad base64", [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}}]}], {}, "base64"),
    ("not audio", [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "aGVsbG8gd29ybGQ=", "format": "wav"}}]}], {}, "decode"),
    ("unknown part", [{"role": "user", "content": [{"type": "video_url", "video_url": "x"}]}], {}, "part type"),
    ("unknown role", [{"role": "robot", "content": "hi"}], {}, "role"),
    ("no messages", [], {}, "empty"),
    ("unknown voice", HELLO, {"speaker": "nobody"}, "voice"),
    ("zero max_tokens", HELLO, {"max_tokens": 0}, "max_tokens"),
    ("context overflow", HELLO, {"max_tokens": 100_000}, "exceeds"),
    ("zero frames", HELLO, {"max_audio_frames": 0}, "max_audio_frames"),
]


@pytest.mark.parametrize("name,messages,kwargs,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_a_client_error_and_the_pipeline_keeps_serving(
    pipeline: Any, name: str, messages: list[dict[str, Any]], kwargs: dict[str, Any], needle: str
) -> None:
    async def consume() -> None:
        async for _ in pipeline.generate(messages, **kwargs):
            pass

    with pytest.raises(InvalidRequestError, match=needle):
        asyncio.run(consume())
    reply = asyncio.run(run_pipeline(pipeline, HELLO, max_tokens=4, max_frames=3))
    assert len(reply.token_ids) >= 1 and reply.codes.shape[1] >= 1


def test_abandoned_request_is_freed_in_every_stage_within_a_second(pipeline: Any) -> None:
    async def abandon() -> float:
        stream = pipeline.generate(
            [{"role": "user", "content": [wav_part(1.0, 16000, 1, seed=2), {"type": "text", "text": "Go on."}]}],
            sampling=GREEDY, talker_sampling=GREEDY_TALKER, max_tokens=2000, max_audio_frames=2000,
        )
        async for event in stream:
            if isinstance(event, AudioChunk):
                break
        await stream.aclose()  # what a disconnecting client does
        closed = time.monotonic()
        while True:
            stats = await pipeline.stats()
            busy = [
                stats["thinker"]["running"], stats["thinker"]["streams"], stats["talker"]["running"],
                stats["talker"]["streams"], stats["vocoder"]["streams"],
            ]
            if not any(busy):
                return time.monotonic() - closed
            assert time.monotonic() - closed < 1.0, f"still busy after 1 s: {stats}"
            await asyncio.sleep(0.02)

    elapsed = asyncio.run(abandon())
    print(f"\nall stages idle {elapsed * 1000:.0f} ms after the client left")
    reply = asyncio.run(run_pipeline(pipeline, HELLO, max_tokens=4, max_frames=3))
    assert reply.codes.shape[1] >= 1


def test_many_concurrent_requests_all_finish(pipeline: Any) -> None:
    """Rounds of overlapping requests, finishing at different steps: every stream ends (no lost end-of-stream
    relay item when a request's final event races its relay messages)."""

    async def one(index: int) -> int:
        chunks = 0
        async for event in pipeline.generate(
            [{"role": "user", "content": f"Request {index}, please talk."}],
            sampling=SamplingParams(temperature=0.8, seed=index), max_tokens=6 + index % 7 * 3,
            max_audio_frames=6 + index % 5 * 3,
        ):
            chunks += isinstance(event, AudioChunk)
        return chunks

    async def rounds() -> None:
        for r in range(8):
            done = await asyncio.wait_for(asyncio.gather(*(one(r * 10 + i) for i in range(6))), timeout=60)
            assert all(chunks > 0 for chunks in done)

    asyncio.run(rounds())
