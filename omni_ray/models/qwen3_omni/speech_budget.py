"""How many frames the Talker may make for a request: its frame budget, and the room its context leaves."""

from __future__ import annotations

from typing import Any

from omni_ray.config import TalkerSettings
from omni_ray.models.qwen3_omni.talker_inputs import talker_prefix_positions

ASSISTANT_POSITIONS = 9  # the Talker prompt's positions after the user turns (`assemble_talker_prompts`)
# The least speech worth admitting a request for, when its context leaves less room than its budget: 25 frames, 2 s
# at 12.5 frames a second, a few words. A Talker that would stop within them refuses the request as a client error.
MIN_SPEECH_FRAMES = 25


def frame_budget(settings: TalkerSettings, max_frames: int | None, max_text_tokens: int | None) -> int:
    """The most frames the Talker makes for a request (as `TalkerStage.speak` sets the sequence's limits): an explicit
    `max_frames` capped by the stage's, else `frame_budget_base` + `frames_per_text_token` per reply token, at most
    the stage's `max_frames` (`max_text_tokens` None: the stage's `max_frames`)."""
    cap = min(max_frames or settings.max_frames, settings.max_frames)
    if max_frames or settings.frames_per_text_token <= 0 or max_text_tokens is None:
        return cap
    return min(cap, max(1, settings.frame_budget_base + int(settings.frames_per_text_token * max_text_tokens)))


def talker_prompt_length(prompt_ids: list[int], config: Any) -> int:
    """Positions of the Talker's prompt for a Thinker prompt: its user-turn positions, then the assistant's nine. A
    prompt the Talker cannot read (the Thinker reports it) counts whole."""
    try:
        user_positions, _ = talker_prefix_positions(prompt_ids, config)
    except ValueError:
        return len(prompt_ids) + ASSISTANT_POSITIONS
    return int(user_positions.numel()) + ASSISTANT_POSITIONS


def context_room(settings: TalkerSettings, talker_prompt_len: int) -> int:
    """Frames the Talker's KV slot holds after its prompt: the prefill makes the first frame, each decode step one
    more position and one more frame (`TalkerRunner.launch` ends the request with `length` when the slot is full)."""
    return settings.max_seq_len - talker_prompt_len + 1
