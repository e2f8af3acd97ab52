"""Qwen3-TTS's Talker runner: the shared codec Talker with prompts built from a speech request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_ray.engine.codec_sequence import TalkerSequence
from omni_ray.engine.codec_talker import CodecTalkerRunner
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_tts.prompt import TalkerPrompt, prompt_embeddings
from omni_ray.models.qwen3_tts.talker_model import TalkerAssets

# The package's defaults: the Talker's draw, and the code predictor's (no repetition penalty there).
DEFAULT_SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
DEFAULT_CODE_SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=1.0)
MIN_FRAMES = 2  # codec EOS is not sampled for the first two frames


def frame_cap(settings: Any, prompt: TalkerPrompt, max_frames: int | None) -> int:
    """A reply's frame cap: the request's (`max_frames`), else proportional to its text (`frame_budget_base` plus
    `frames_per_text_token` a token), within the stage's `max_frames`. It ends a reply that never samples codec EOS
    with `finish_reason` length."""
    cap = min(max_frames or settings.max_frames, settings.max_frames)
    if max_frames is None and settings.frames_per_text_token > 0:
        cap = min(cap, settings.frame_budget_base + int(settings.frames_per_text_token * prompt.text_tokens))
    return max(cap, 1)


@dataclass
class SpeechSequence(TalkerSequence):
    """A Talker sequence whose prompt came whole with the request."""

    prompt: TalkerPrompt | None = None


def speech_sequence(
    request_id: str, prompt: TalkerPrompt, talker: Any, max_frames: int, sampling: SamplingParams = DEFAULT_SAMPLING,
    code_sampling: SamplingParams = DEFAULT_CODE_SAMPLING, ignore_eos: bool = False,
) -> SpeechSequence:
    """The Talker sequence of a built prompt: its trailing text as text embeddings (`talker`: the `TalkerModel`), its
    text already whole."""
    seq = SpeechSequence(request_id, sampling, -1, max_frames, ignore_eos=ignore_eos, prompt=prompt,
                         text_offset=prompt.text_offset, code_sampling=code_sampling, min_frames=MIN_FRAMES)
    shared = prompt.shared_prefix()
    if shared is not None:
        seq.shared_prefix_key, seq.shared_prefix_len = shared
    if prompt.trailing_ids:
        table = talker.model.text_embedding.weight
        with torch.inference_mode():
            rows = table[torch.tensor(prompt.trailing_ids, device=table.device)]
        seq.text_embeds = list(rows.unbind(0))
    seq.thinker_done = True
    return seq


class TTSTalkerRunner(CodecTalkerRunner):
    """Qwen3-TTS's Talker steps (`CodecTalkerRunner`): each prompt is whole at admission."""

    first_text_in_prompt = False

    def __init__(self, assets: TalkerAssets, cache: SlotKVCache, max_batch: int, **options: Any) -> None:
        super().__init__(assets, assets.config.spec(DEFAULT_CODE_SAMPLING), cache, max_batch, **options)
        self.assets: TalkerAssets = assets

    def _prompt_length(self, seq: TalkerSequence) -> int:
        assert isinstance(seq, SpeechSequence) and seq.prompt is not None
        return len(seq.prompt)

    def _prompts(self, seqs: list[TalkerSequence], early: bool = False) -> list[torch.Tensor]:
        prompts = [seq.prompt for seq in seqs if isinstance(seq, SpeechSequence) and seq.prompt is not None]
        assert len(prompts) == len(seqs) and not early
        dtype = self.assets.tts_pad.dtype
        return [p.to(dtype) for p in prompt_embeddings(prompts, self.model, self.device)]
