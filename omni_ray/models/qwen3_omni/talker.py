"""Qwen3-Omni Talker: MoE codec backbone + MTP code predictor, and the runner that makes one 16-code frame per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import RequestSampler, SamplingParams, sample_batch
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.basic import ResizeMLP
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.models.qwen3_omni.talker_inputs import assemble_talker_prompt, codec_prefix_ids
from omni_ray.weights import fuse_expert_weights, load_module, random_module, read_rows, read_tensors

# The code predictor samples with these when the Talker samples (transformers' fixed choice).
MTP_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


class CodePredictor(nn.Module):
    """Dense decoder that completes code groups 1..G-1 of a frame from [talker hidden, group-0 embedding]."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.model = DecoderStack(DecoderSpec.from_hf(cfg))
        self.model.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(cfg.num_code_groups - 1)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )


class TalkerModel(nn.Module):
    """Codec embedding + MoE decoder + codec head, the Thinker→Talker projections and the code predictor."""

    def __init__(self, talker_config: Any) -> None:
        super().__init__()
        text = talker_config.text_config
        self.model = DecoderStack(DecoderSpec.from_hf(text, always_moe=True))
        self.model.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = ResizeMLP(talker_config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(talker_config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.code_predictor = CodePredictor(talker_config.code_predictor_config)

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G] → sum of every group's embedding [B, h] (the next step's codec input)."""
        total = self.model.codec_embedding(codes[:, 0])
        for g, table in enumerate(self.code_predictor.model.codec_embedding):
            total = total + table(codes[:, g + 1])
        return total


@dataclass
class TalkerAssets:
    """The Talker model plus the three Thinker embedding rows it needs (tts_bos, tts_eos, tts_pad)."""

    model: TalkerModel
    tts_bos: torch.Tensor
    tts_eos: torch.Tensor
    tts_pad: torch.Tensor


def load_talker(checkpoint: Path | None, config: Any, device: str, dtype: torch.dtype) -> TalkerAssets:
    """Reads `talker.*` plus three rows of the Thinker's token embedding; random weights when no checkpoint."""
    if checkpoint is None:
        model: TalkerModel = random_module(lambda: TalkerModel(config.talker_config), device, dtype)  # type: ignore[assignment]
        rows = torch.randn(3, config.talker_config.thinker_hidden_size, device=device, dtype=dtype) * 0.02
    else:
        model = TalkerModel(config.talker_config)
        load_module(model, fuse_expert_weights(read_tensors(checkpoint, "talker.")))
        model = model.to(device=device, dtype=dtype).eval()
        rows = read_rows(
            checkpoint,
            "thinker.model.embed_tokens.weight",
            [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id],
        ).to(device=device, dtype=dtype)
    with torch.inference_mode():
        bos, eos, pad = model.text_projection(rows)
    return TalkerAssets(model, bos, eos, pad)


@dataclass
class TalkerSequence:
    """One request inside the Talker engine, fed incrementally by the Thinker."""

    request_id: str
    sampling: SamplingParams
    speaker_id: int
    max_frames: int
    frames_per_text_token: float = 0.0  # 0 disables the text-proportional limit
    frame_budget_base: int = 0
    ignore_eos: bool = False  # benchmark mode: codec EOS is never sampled; the frame cap ends the reply
    # filled by the relay as the Thinker streams
    prefix: dict[str, torch.Tensor] | None = None
    text_embeds: list[torch.Tensor] = field(default_factory=list)  # Thinker layer-0 embeddings of reply tokens
    thinker_done: bool = False
    # engine state
    slot: int = -1
    num_cached: int = 0
    steps: int = 0  # decode steps done
    group0_history: list[int] = field(default_factory=list)
    frames: int = 0
    feedback: torch.Tensor | None = None  # summed codec embedding of the last frame
    last_hidden: torch.Tensor | None = None
    finish_reason: str | None = None
    sampler: RequestSampler | None = None
    mtp_sampler: RequestSampler | None = None

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


class TalkerRunner:
    """Batched Talker steps: prefill or decode → sample group 0 → MTP completes the frame in the same step."""

    def __init__(self, assets: TalkerAssets, config: Any, cache: SlotKVCache, max_batch: int) -> None:
        self.assets = assets
        self.model = assets.model
        self.config = config
        self.cache = cache
        self.device = self.assets.tts_pad.device
        tc = config.talker_config
        self.num_groups = int(tc.num_code_groups)
        self.eos = int(tc.codec_eos_token_id)
        vocab = int(tc.text_config.vocab_size)
        self.suppress = torch.tensor([i for i in range(vocab - 1024, vocab) if i != self.eos], device=self.device)
        cp = tc.code_predictor_config
        self.mtp_cache = SlotKVCache(
            cp.num_hidden_layers, max_batch, self.num_groups + 1, cp.num_key_value_heads,
            getattr(cp, "head_dim", None) or cp.hidden_size // cp.num_attention_heads,
            self.assets.tts_pad.dtype, self.device,
        )

    def admit(self, seq: TalkerSequence) -> None:
        seq.slot = self.cache.allocate()
        seq.sampler = RequestSampler(seq.sampling)
        mtp = SamplingParams(temperature=0.0) if seq.sampling.greedy else MTP_SAMPLING
        seed = None if seq.sampling.seed is None else seq.sampling.seed + 1
        seq.mtp_sampler = RequestSampler(mtp.model_copy(update={"seed": seed}))

    def release(self, seq: TalkerSequence) -> None:
        if seq.slot >= 0:
            self.cache.release(seq.slot)
            seq.slot = -1

    def ready(self, seq: TalkerSequence) -> bool:
        """Can this sequence take a step now, or is it waiting on Thinker text?"""
        if seq.num_cached == 0:
            return seq.prefix is not None and (bool(seq.text_embeds) or seq.thinker_done)
        return seq.steps + 1 < len(seq.text_embeds) or seq.thinker_done

    @torch.inference_mode()
    def step(self, seqs: list[TalkerSequence]) -> list[TalkerStepOutput]:
        outputs: list[TalkerStepOutput] = []
        stepping: list[TalkerSequence] = []
        hiddens: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for seq in seqs:
            if seq.num_cached == 0:
                if not seq.text_embeds:  # the Thinker finished after one token: nothing to speak
                    seq.finish_reason = "stop"
                    outputs.append(TalkerStepOutput(seq.request_id, None, "stop"))
                    continue
                h = self._prefill(seq)
                stepping.append(seq)
                hiddens.append(h)
        decoding = [s for s in seqs if s.num_cached > 0 and s not in stepping and s.finish_reason is None]
        if decoding:
            hiddens.extend(self._decode(decoding))
            stepping.extend(decoding)
        if not stepping:
            return outputs
        hidden = torch.stack(hiddens)
        logits = self.model.codec_head(hidden)
        no_eos = [i for i, s in enumerate(stepping) if s.ignore_eos]
        if no_eos:
            logits[no_eos, self.eos] = float("-inf")
        histories = [torch.tensor(s.group0_history, dtype=torch.long) for s in stepping]
        group0 = sample_batch(logits, [s.sampler for s in stepping], histories, self.suppress)  # type: ignore[misc]
        for seq, token in zip(stepping, group0):
            seq.group0_history.append(token)
        speaking = [i for i, t in enumerate(group0) if t != self.eos]
        codes = self._complete_frames(hidden[speaking], [group0[i] for i in speaking], [stepping[i] for i in speaking])
        frames = dict(zip((stepping[i].request_id for i in speaking), codes.tolist()))
        if speaking:
            feedback = self.model.frame_embedding(codes)
        for seq in stepping:
            if seq.request_id not in frames:
                seq.finish_reason = "stop"
                outputs.append(TalkerStepOutput(seq.request_id, None, "stop"))
                continue
            index = list(frames).index(seq.request_id)
            seq.feedback = feedback[index]
            seq.frames += 1
            if seq.frames >= seq.frame_limit():
                seq.finish_reason = "length"
            elif seq.num_cached + 1 > self.cache.max_len:
                seq.finish_reason = "length"
            outputs.append(TalkerStepOutput(seq.request_id, frames[seq.request_id], seq.finish_reason))
        return outputs

    def _prefill(self, seq: TalkerSequence) -> torch.Tensor:
        assert seq.prefix is not None
        m, a = self.model, self.assets
        dtype = a.tts_pad.dtype
        states = seq.prefix["user_states"].to(self.device, dtype)
        mm = seq.prefix["user_multimodal"].to(self.device)
        user = torch.where(mm[:, None], m.hidden_projection(states), m.text_projection(states))
        assistant = m.text_projection(seq.prefix["assistant_prefix"].to(self.device, dtype))
        first = m.text_projection(seq.text_embeds[0].to(self.device, dtype))
        codec = m.model.codec_embedding(torch.tensor(codec_prefix_ids(self.config, seq.speaker_id), device=self.device))
        prompt = assemble_talker_prompt(user, assistant, first, a.tts_bos, a.tts_pad, codec)
        length = prompt.shape[0]
        self.cache.check_fits(length + 1)
        batch = AttentionBatch.build([seq.slot], [0], length, self.device)
        positions = torch.arange(length, device=self.device)[None]
        hidden, _ = m.model(prompt[None], positions, self.cache.layers, batch)
        seq.num_cached = length
        return hidden[0, -1]

    def _trailing_text(self, seq: TalkerSequence) -> torch.Tensor:
        """Text input for decode step `seq.steps`: reply token steps+2, then tts_eos once, then tts_pad."""
        index = seq.steps + 1
        if index < len(seq.text_embeds):
            return self.model.text_projection(seq.text_embeds[index].to(self.device, self.assets.tts_pad.dtype))
        return self.assets.tts_eos if index == len(seq.text_embeds) else self.assets.tts_pad

    def _decode(self, seqs: list[TalkerSequence]) -> list[torch.Tensor]:
        embeds = torch.stack([s.feedback + self._trailing_text(s) for s in seqs])[:, None]  # type: ignore[operator]
        starts = [s.num_cached for s in seqs]
        batch = AttentionBatch.build([s.slot for s in seqs], starts, 1, self.device)
        positions = torch.tensor(starts, device=self.device)[:, None]
        hidden, _ = self.model.model(embeds, positions, self.cache.layers, batch)
        for s in seqs:
            s.num_cached += 1
            s.steps += 1
        return list(hidden[:, 0])

    def _complete_frames(self, hidden: torch.Tensor, group0: list[int], seqs: list[TalkerSequence]) -> torch.Tensor:
        """The MTP loop: groups 1..G-1 for every row, with a per-frame static cache. Returns codes [B, G]."""
        rows = len(seqs)
        if rows == 0:
            return torch.empty(0, self.num_groups, dtype=torch.long, device=self.device)
        cp = self.model.code_predictor
        g0 = torch.tensor(group0, device=self.device)
        embeds = torch.stack([hidden, self.model.model.codec_embedding(g0)], dim=1)  # [B, 2, h]
        slots = list(range(rows))
        codes = [g0]
        samplers = [s.mtp_sampler for s in seqs]
        start, length = 0, 2
        for k in range(self.num_groups - 1):
            batch = AttentionBatch.build(slots, [start] * rows, length, self.device)
            positions = (start + torch.arange(length, device=self.device))[None].expand(rows, -1)
            out, _ = cp.model(embeds, positions, self.mtp_cache.layers, batch)
            picked = sample_batch(cp.lm_head[k](out[:, -1]), samplers, [None] * rows)  # type: ignore[arg-type]
            code = torch.tensor(picked, device=self.device)
            codes.append(code)
            if k + 1 < self.num_groups - 1:
                embeds = cp.model.codec_embedding[k](code)[:, None]
                start, length = start + length, 1
        return torch.stack(codes, dim=1)
