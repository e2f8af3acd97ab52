"""Qwen3-Omni Thinker: the MoE text backbone and its runner (prefill/decode steps, Talker-bound states)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import RequestSampler, SamplingParams
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.models.qwen3_omni.talker_inputs import talker_prefix_positions
from omni_ray.weights import fuse_expert_weights, load_module, random_module, read_tensors


class ThinkerLM(nn.Module):
    """Token embedding + MoE decoder stack + LM head, with checkpoint key names (`model.*`, `lm_head`)."""

    def __init__(self, text_config: Any) -> None:
        super().__init__()
        self.model = DecoderStack(DecoderSpec.from_hf(text_config))
        self.model.embed_tokens = nn.Embedding(text_config.vocab_size, text_config.hidden_size)
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)


def load_thinker(checkpoint: Path | None, config: Any, device: str, dtype: torch.dtype) -> ThinkerLM:
    """Reads only `thinker.model.*` (minus the encoders) and `thinker.lm_head.*`; random weights when no checkpoint."""
    if checkpoint is None:
        return random_module(lambda: ThinkerLM(config.thinker_config.text_config), device, dtype)  # type: ignore[return-value]
    model = ThinkerLM(config.thinker_config.text_config)
    tensors = read_tensors(checkpoint, "thinker.", only=("model.", "lm_head."))
    load_module(model, fuse_expert_weights(tensors))
    return model.to(device=device, dtype=dtype).eval()


@dataclass
class ThinkerSequence:
    """One request inside the Thinker engine."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    audio_embeds: torch.Tensor | None = None  # [num_audio_tokens, hidden] for the <|audio_pad|> positions
    for_talker: bool = False
    forced_ids: list[int] | None = None  # teacher-forced reply: these tokens are emitted instead of sampled
    ignore_eos: bool = False  # benchmark mode: stop tokens do not end the reply, only max_tokens does
    slot: int = -1
    num_cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sampler: RequestSampler | None = None


@dataclass
class ThinkerStepOutput:
    """What one step produced for one request: the new token and, if it speaks, what the Talker consumes."""

    request_id: str
    token: int
    finish_reason: str | None
    # prefill: Talker prefix states (layer-0 embeddings at text positions, accept-layer hidden at audio positions)
    talker_prefix: dict[str, torch.Tensor] | None = None
    # decode: layer-0 embedding of the step's input token (the previously generated token)
    talker_embed: torch.Tensor | None = None


class ThinkerRunner:
    """Runs Thinker steps for a batch of sequences: prefill new ones, batched decode for the rest."""

    def __init__(self, model: ThinkerLM, config: Any, cache: SlotKVCache) -> None:
        self.model = model
        self.config = config
        self.cache = cache
        self.device = next(model.parameters()).device
        self.accept_layer = int(config.talker_config.accept_hidden_layer)
        self.audio_token_id = int(config.thinker_config.audio_token_id)
        self.multimodal_ids = torch.tensor(
            [config.thinker_config.audio_token_id, config.thinker_config.image_token_id, config.thinker_config.video_token_id]
        )

    def admit(self, seq: ThinkerSequence) -> None:
        self.cache.check_fits(len(seq.prompt_ids) + seq.max_tokens)
        seq.slot = self.cache.allocate()
        seq.sampler = RequestSampler(seq.sampling)

    def release(self, seq: ThinkerSequence) -> None:
        if seq.slot >= 0:
            self.cache.release(seq.slot)
            seq.slot = -1

    @torch.inference_mode()
    def step(self, seqs: list[ThinkerSequence]) -> list[ThinkerStepOutput]:
        # Partition first: a sequence prefilled in this step must not also decode in it.
        prefilling = [s for s in seqs if s.num_cached == 0]
        forced = [s for s in seqs if s.num_cached > 0 and s.forced_ids]
        decoding = [s for s in seqs if s.num_cached > 0 and not s.forced_ids]
        outputs = [self._prefill(s) for s in prefilling]
        outputs.extend(self._advance_forced(s) for s in forced)
        if decoding:
            outputs.extend(self._decode(decoding))
        return outputs

    def _advance_forced(self, seq: ThinkerSequence) -> ThinkerStepOutput:
        """Teacher forcing: the reply is given, so what the Talker reads is the given tokens' layer-0
        embeddings. No forward pass is needed for them (the Talker reads no hidden state at text positions)."""
        embed = self.model.embed(torch.tensor([seq.output_ids[-1]], device=self.device))[0]
        seq.num_cached += 1
        token = self._accept(seq, None)
        return ThinkerStepOutput(seq.request_id, token, seq.finish_reason, talker_embed=embed.float().cpu())

    def _prefill(self, seq: ThinkerSequence) -> ThinkerStepOutput:
        ids = torch.tensor([seq.prompt_ids], device=self.device)
        embeds = self.model.embed(ids)
        if seq.audio_embeds is not None:
            audio_mask = ids[0] == self.audio_token_id
            if int(audio_mask.sum()) != seq.audio_embeds.shape[0]:
                raise ValueError("audio embeddings do not match the number of audio placeholder tokens")
            embeds[0, audio_mask] = seq.audio_embeds.to(embeds.device, embeds.dtype)
        length = ids.shape[1]
        mm_mask = torch.isin(ids[0], self.multimodal_ids.to(ids.device))
        logits: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        if not seq.forced_ids or bool(mm_mask.any()):  # a forced text-only reply needs no forward pass
            batch = AttentionBatch.build([seq.slot], [0], length, self.device)
            positions = torch.arange(length, device=self.device)[None]
            capture = (self.accept_layer,) if seq.for_talker else ()
            hidden, captured = self.model.model(embeds, positions, self.cache.layers, batch, capture)
            logits = self.model.lm_head(hidden[0, -1])
        seq.num_cached = length
        token = self._accept(seq, logits)
        prefix = None
        if seq.for_talker:
            positions_for_talker, assistant_start = talker_prefix_positions(seq.prompt_ids, self.config)
            states = embeds[0]
            if self.accept_layer in captured:
                states = torch.where(mm_mask[:, None], captured[self.accept_layer][0], embeds[0])
            prefix = {
                "user_states": states[positions_for_talker].float().cpu(),
                "user_multimodal": mm_mask[positions_for_talker].cpu(),
                "assistant_prefix": embeds[0, assistant_start : assistant_start + 3].float().cpu(),
            }
        return ThinkerStepOutput(seq.request_id, token, seq.finish_reason, talker_prefix=prefix)

    def _decode(self, seqs: list[ThinkerSequence]) -> list[ThinkerStepOutput]:
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=self.device)
        starts = [s.num_cached for s in seqs]
        batch = AttentionBatch.build([s.slot for s in seqs], starts, 1, self.device)
        positions = torch.tensor(starts, device=self.device)[:, None]
        embeds = self.model.embed(ids)
        hidden, _ = self.model.model(embeds, positions, self.cache.layers, batch)
        logits = self.model.lm_head(hidden[:, -1])
        outputs = []
        for i, seq in enumerate(seqs):
            seq.num_cached += 1
            token = self._accept(seq, logits[i])
            talker_embed = embeds[i, 0].float().cpu() if seq.for_talker else None
            outputs.append(ThinkerStepOutput(seq.request_id, token, seq.finish_reason, talker_embed=talker_embed))
        return outputs

    def _accept(self, seq: ThinkerSequence, logits: torch.Tensor | None) -> int:
        """Sample (or take the forced) next token and update the finish state."""
        if seq.forced_ids:
            token = seq.forced_ids[len(seq.output_ids)]
            seq.output_ids.append(token)
            if len(seq.output_ids) == len(seq.forced_ids):
                seq.finish_reason = "stop"
            return token
        assert seq.sampler is not None and logits is not None
        history = None
        if seq.sampling.repetition_penalty != 1.0:
            history = torch.tensor(seq.prompt_ids + seq.output_ids, device=logits.device)
        token = seq.sampler.pick(logits, history)
        seq.output_ids.append(token)
        if token in seq.stop_ids and not seq.ignore_eos:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        return token
