"""No silent truncation: a spoken reply whose prompt leaves the Talker's context too little room is refused (400), and
one whose speech the context cuts short says so (`audio_finish_reason: length`). Prompts of about 4000 tokens bring
the Talker's 4096 positions near their end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omni_ray.errors import InvalidRequestError
from omni_ray.events import Finished
from omni_ray.models.qwen3_omni.speech_budget import context_room, talker_prompt_length


def _room(pipe: Any, messages: list[dict[str, Any]]) -> int:
    """Frames the Talker's context holds after this chat's prompt."""
    prompt = pipe.prompts.build(messages)
    return context_room(pipe.config.stages.talker.engine, talker_prompt_length(prompt.ids, pipe.model_config))


def _leaving(pipe: Any, frames: int) -> list[dict[str, Any]]:
    """A chat whose prompt leaves the Talker's context room for exactly `frames` frames."""
    words = 1000
    while True:  # each repetition adds the same few tokens: step towards the length wanted
        messages = [{"role": "user", "content": "Say " + "more " * words}]
        room = _room(pipe, messages)
        if room == frames:
            return messages
        words += (room - frames) // 2 or (1 if room > frames else -1)


def _finished(pipe: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Finished:
    async def run() -> Finished:
        finished = None
        async for event in pipe.generate(messages, **kwargs):
            if isinstance(event, Finished):
                finished = event
        assert finished is not None
        return finished

    return asyncio.run(asyncio.wait_for(run(), timeout=120))


def test_speech_cut_short_by_the_talkers_context_says_length(pipeline: Any) -> None:
    messages = _leaving(pipeline, 40)
    # 20 reply tokens budget 25 + 6 x 20 = 145 frames, more than the context holds; the Talker never stops by itself
    finished = _finished(pipeline, messages, max_tokens=20, ignore_eos=True)
    assert finished.finish_reason == "length" and finished.usage["completion_tokens"] == 20
    assert finished.audio_finish_reason == "length"
    assert finished.usage["audio_frames"] == 40  # every position the context had left


def test_a_prompt_that_leaves_too_little_room_for_speech_is_a_client_error(pipeline: Any) -> None:
    messages = _leaving(pipeline, 10)
    with pytest.raises(InvalidRequestError, match=r"of the Talker's 4096 positions, leaving room for 10 frames of "
                                                  r"speech; at least 25 are needed"):
        _finished(pipeline, messages, max_tokens=10)  # 10 tokens fit the Thinker's context; 85 frames do not
    # the same prompt as text only, or asking for no more speech than fits, is admitted
    assert _finished(pipeline, messages, max_tokens=2, audio=False).audio_finish_reason is None
    finished = _finished(pipeline, messages, max_tokens=2, max_audio_frames=10, ignore_eos=True)
    assert finished.usage["audio_frames"] == 10
    overflowing = _leaving(pipeline, -2)  # longer than the Talker's context, though the Thinker's takes it
    with pytest.raises(InvalidRequestError, match=r"leaving room for 0 frames"):
        _finished(pipeline, overflowing, max_tokens=2, max_audio_frames=1)
