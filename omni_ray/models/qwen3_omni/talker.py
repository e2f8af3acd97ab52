"""Qwen3-Omni's Talker runner: the shared codec Talker with the prompt the Thinker's states make."""

from __future__ import annotations

from typing import Any

import torch

from omni_ray.engine.codec_sequence import (
    MTP_SAMPLING, FrameSampling, MtpSubStep, PendingFrames, TalkerSequence, TalkerStepOutput,
)
from omni_ray.engine.codec_talker import CodecTalkerRunner, CodecTalkerSpec
from omni_ray.engine.host_inputs import cat_on_device, stack_on_device, to_device
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.models.qwen3_omni.talker_inputs import assemble_talker_prompts, codec_prefix_ids
from omni_ray.models.qwen3_omni.talker_model import TalkerAssets

# the Talker's records, used with its runner
__all__ = ["MTP_SAMPLING", "FrameSampling", "MtpSubStep", "PendingFrames", "TalkerRunner", "TalkerSequence",
           "TalkerStepOutput", "talker_spec"]


def talker_spec(config: Any) -> CodecTalkerSpec:
    """The codec ids and code-predictor geometry of a Qwen3-Omni config."""
    tc = config.talker_config
    cp = tc.code_predictor_config
    return CodecTalkerSpec(
        num_groups=int(tc.num_code_groups), vocab=int(tc.text_config.vocab_size), eos=int(tc.codec_eos_token_id),
        bos=int(tc.codec_bos_id), predictor_layers=int(cp.num_hidden_layers),
        predictor_kv_heads=int(cp.num_key_value_heads),
        predictor_head_dim=int(getattr(cp, "head_dim", None) or cp.hidden_size // cp.num_attention_heads),
        predictor_vocab=int(cp.vocab_size),
    )


class TalkerRunner(CodecTalkerRunner):
    """Qwen3-Omni's Talker steps (`CodecTalkerRunner`): its prompt is the projected user turn of the Thinker's
    prompt, then nine assistant positions ending with the reply's first token."""

    def __init__(self, assets: TalkerAssets, config: Any, cache: SlotKVCache, max_batch: int, **options: Any) -> None:
        super().__init__(assets, talker_spec(config), cache, max_batch, **options)
        self.config = config
        self.assets: TalkerAssets = assets

    def _prompt_length(self, seq: TalkerSequence) -> int:
        assert seq.prefix is not None
        return int(seq.prefix["user_states"].shape[0]) + (9 if seq.text_embeds else 8)

    def _prompts(self, seqs: list[TalkerSequence], early: bool = False) -> list[torch.Tensor]:
        """Talker prefill embeddings [T_i, h] of each sequence from the Thinker's prefix states and first reply token;
        `early` (before that token): all but the last position. Each projection runs once over the whole batch (a
        prompt at a time took some 30 small ops per request, in the step that speaks a burst's first frames)."""
        prefixes = [seq.prefix for seq in seqs]
        assert all(prefix is not None for prefix in prefixes)
        m, a = self.model, self.assets
        dtype = a.tts_pad.dtype
        states = cat_on_device([p["user_states"] for p in prefixes], self.device).to(dtype)  # type: ignore[index]
        multimodal = cat_on_device([p["user_multimodal"] for p in prefixes], self.device)  # type: ignore[index]
        user = torch.where(multimodal[:, None], m.hidden_projection(states), m.text_projection(states))
        assistant = stack_on_device([p["assistant_prefix"] for p in prefixes], self.device)  # type: ignore[index]
        assistant = m.text_projection(assistant.to(dtype))
        codec_ids = torch.tensor([codec_prefix_ids(self.config, seq.speaker_id) for seq in seqs])
        codec = m.model.codec_embedding(to_device(codec_ids, self.device))
        if early:
            first = torch.zeros(len(seqs), a.tts_pad.shape[-1], dtype=dtype, device=self.device)
        else:
            first = m.text_projection(stack_on_device([seq.text_embeds[0] for seq in seqs], self.device).to(dtype))
        users = user.split([int(p["user_states"].shape[0]) for p in prefixes])  # type: ignore[index]
        prompts = assemble_talker_prompts(list(users), assistant, first, a.tts_bos, a.tts_pad, codec)
        return [prompt[:-1] for prompt in prompts] if early else prompts
