"""What crosses the Thinker→Talker edge for Qwen3-Omni, and how the Talker's prompt is assembled from it."""

from __future__ import annotations

from typing import Any

import torch


def talker_prefix_positions(prompt_ids: list[int], config: Any) -> tuple[torch.Tensor, int]:
    """Prompt positions the Talker reads (every user-turn position, system and past assistant turns dropped)
    and the index of the final `<|im_start|>` that opens the assistant reply."""
    ids = torch.tensor(prompt_ids)
    positions = torch.arange(len(prompt_ids))
    im_start = torch.where(ids == config.im_start_token_id, positions, torch.full_like(positions, -1))
    previous_start = torch.cummax(im_start, dim=0).values.clamp_min(0)
    role = ids[(previous_start + 1).clamp_max(len(prompt_ids) - 1)]
    user_positions = positions[role == config.user_token_id]
    opens = ((ids[:-1] == config.im_start_token_id) & (ids[1:] == config.assistant_token_id)).nonzero().flatten()
    if opens.numel() == 0:
        raise ValueError("prompt has no assistant turn to answer")
    assistant_start = int(opens[-1])
    if assistant_start + 3 != len(prompt_ids):
        raise ValueError("prompt must end with '<|im_start|>assistant\\n'")
    return user_positions, assistant_start


def codec_prefix_ids(config: Any, speaker_id: int) -> list[int]:
    """Codec ids added to the last six assistant-prefix positions."""
    tc = config.talker_config
    return [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id, speaker_id, tc.codec_pad_id, tc.codec_bos_id]


def assemble_talker_prompts(
    user_parts: list[torch.Tensor],
    assistant_prefix: torch.Tensor,
    first_text: torch.Tensor,
    tts_bos: torch.Tensor,
    tts_pad: torch.Tensor,
    codec_prefix: torch.Tensor,
) -> list[torch.Tensor]:
    """Talker prefill embeddings of N prompts: each projected user turn, then 9 assistant positions where text
    ([im_start, assistant, \\n], 4×tts_pad, tts_bos, first reply token) is added to
    codec ([0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]).

    All inputs are already in Talker width: user_parts [U_i, h] each, assistant_prefix [N, 3, h], first_text [N, h],
    tts_* [h], codec_prefix [N, 6, h]. The 9 positions are made for all N at once."""
    count = first_text.shape[0]
    text = torch.cat(
        [assistant_prefix, tts_pad.expand(count, 4, -1), tts_bos.expand(count, 1, -1), first_text[:, None]], dim=1
    )
    codec = torch.cat([torch.zeros_like(assistant_prefix), codec_prefix], dim=1)
    return [torch.cat([user, tail]) for user, tail in zip(user_parts, text + codec)]
