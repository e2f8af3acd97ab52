"""A codec Talker's per-request state and step records: a sequence, a frame's sampling mode, a launched step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_ray.engine.host_inputs import Download
from omni_ray.engine.sampler import GREEDY, NoiseSource, SamplingParams, needs_filter, top_k_cap
from omni_ray.layers.attention import AttentionBatch

# The code predictor samples with these when the Talker samples and the request names nothing else (Qwen3-Omni's
# fixed choice in transformers).
MTP_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


@dataclass(frozen=True)
class FrameSampling:
    """Which top-k/top-p filtering a frame's rows need: none (all greedy, or no top-k/top-p), over `*_top_k_cap`
    candidates (every sampled row uses top-k), or a sort of the whole vocabulary. One frame graph per mode."""

    filtered: bool
    group0_top_k_cap: int | None = None
    mtp_top_k_cap: int | None = None

    @classmethod
    def of(cls, group0: list[SamplingParams], mtp: list[SamplingParams]) -> "FrameSampling":
        if not needs_filter(group0 + mtp):
            return cls(False)
        return cls(True, top_k_cap(group0), top_k_cap(mtp))


@dataclass
class MtpSubStep:
    """What one MTP sub-step reads besides its tokens, the same in every frame: where its tokens go in the per-frame
    cache, and their rotary tables."""

    batch: AttentionBatch
    cos: torch.Tensor  # [rows, T, head_dim]
    sin: torch.Tensor


@dataclass
class TalkerSequence:
    """One request inside a codec Talker engine. Its text comes with it or incrementally (from a Thinker): each decode
    step reads the next text embedding past the `text_offset` the prompt took, then the end-of-text embedding once,
    then padding."""

    request_id: str
    sampling: SamplingParams
    speaker_id: int
    max_frames: int
    frames_per_text_token: float = 0.0  # 0 disables the text-proportional limit
    frame_budget_base: int = 0
    ignore_eos: bool = False  # benchmark mode: codec EOS is never sampled; the frame cap ends the reply
    early: bool = False  # the prefix came with the request: prefill all but the last position before the first token
    text_offset: int = 1  # how many of `text_embeds` the prompt holds: decode step s reads text_embeds[s + text_offset]
    code_sampling: SamplingParams | None = None  # the code predictor's draws; None: greedy or MTP_SAMPLING as the Talker's
    min_frames: int = 0  # codec EOS is not sampled for this many first frames
    # the prompt's leading positions that other requests share (a voice's), by a key naming their content: their keys
    # and values are kept in the runner's prefix cache and reused
    shared_prefix_key: str | None = None
    shared_prefix_len: int = 0
    # filled with the request, or by the relay as a Thinker streams
    prefix: dict[str, torch.Tensor] | None = None
    text_embeds: list[torch.Tensor] = field(default_factory=list)  # text embeddings, before the text projection
    thinker_done: bool = False
    # engine state
    slot: int = -1
    num_cached: int = 0
    steps: int = 0  # decode steps done
    frames: int = 0
    finish_reason: str | None = None
    noise: NoiseSource | None = None  # group-0 draws
    mtp_noise: NoiseSource | None = None  # code-predictor draws
    # where the first frame's time goes (epoch s): the first reply token's arrival, the launch of the step making it
    first_text_received: float | None = None
    first_frame_launched: float | None = None
    # how the message with the reply's first items came from the Thinker: queued, sent, arrived (`RelayMessage`)
    first_text_relay: tuple[float, float, float] | None = None
    # where the rest goes (epoch s): the Thinker's end reached the Talker; the launch of the first step whose text
    # input lies past the reply's tokens (tts_eos), which ends the frames the Thinker paces
    text_end_received: float | None = None
    text_read_launched: float | None = None

    @property
    def mtp_sampling(self) -> SamplingParams:
        if self.code_sampling is not None:
            return self.code_sampling
        return GREEDY if self.sampling.greedy else MTP_SAMPLING

    def hear(self, outputs: list[Any], done: bool = True) -> None:
        """Take a Thinker runner's step outputs in process (`ThinkerStepOutput`: the prefix states, each reply
        token's embedding), as tests and benchmarks drive the two runners (the stages take them from the relay);
        `done`: the Thinker's reply has ended."""
        for out in outputs:
            if out.talker_prefix is not None:
                self.prefix = out.talker_prefix
            if out.talker_embed is not None:
                self.add_text(out.talker_embed)
        if done:
            self.end_text()

    def end_text(self) -> None:
        """The Thinker's reply has ended: no more text comes (when is kept)."""
        if not self.thinker_done:
            self.thinker_done, self.text_end_received = True, time.time()

    def add_text(self, embed: torch.Tensor) -> None:
        """The next reply token's Thinker embedding arrived (the first one's arrival time is kept)."""
        if self.first_text_received is None:
            self.first_text_received = time.time()
        self.text_embeds.append(embed)

    def frame_limit(self) -> int:
        if self.frames_per_text_token <= 0 or not self.thinker_done:
            return self.max_frames
        proportional = self.frame_budget_base + int(self.frames_per_text_token * len(self.text_embeds))
        return min(self.max_frames, max(1, proportional))


@dataclass
class TalkerStepOutput:
    request_id: str
    codes: list[int] | None  # one frame, all groups; None when the step ended the request without a frame
    finish_reason: str | None
    step: int = -1  # its runner's frame step count when it was made: the clock the vocoder aligns its chunks on


@dataclass
class PendingFrames:
    """A launched Talker step: its rows (sequence, the frame number it makes) and their codes on the way to the
    host; `outputs` are the ends decided without the device."""

    rows: list[tuple[TalkerSequence, int]] = field(default_factory=list)
    codes: Download | None = None
    outputs: list[TalkerStepOutput] = field(default_factory=list)
    step: int = -1  # the runner's frame step count at this step
