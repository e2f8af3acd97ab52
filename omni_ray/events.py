"""What a reply streams to its caller: text deltas, audio chunks, then one Finished event."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    t: float


@dataclass
class AudioChunk:
    pcm: np.ndarray  # float32 mono at `sample_rate`
    sample_rate: int
    t: float


@dataclass
class Finished:
    finish_reason: str
    usage: dict[str, int]
    audio_finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    t: float = 0.0
    # when the reply reached each point (epoch s): submitted, streams_open, prefill_launched, first_token,
    # first_text_queued, first_text_sent, first_text_arrived, talker_first_text, first_frame_launched, first_frame,
    # first_audio, first_audio_received; then last_token, talker_text_end, text_read, last_frame, last_audio
    timing: dict[str, float] = field(default_factory=dict)
    codes: torch.Tensor | None = None  # [num_code_groups, frames] when asked for with return_codes
    text: str = ""


Event = TextDelta | AudioChunk | Finished
