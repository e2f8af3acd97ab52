"""A codec Talker's frame pass: group 0 drawn from the backbone's hidden state, the code predictor's groups after it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from omni_ray.engine.codebook_pass import codebook_pass
from omni_ray.engine.codec_sequence import FrameSampling, MtpSubStep, TalkerSequence
from omni_ray.engine.cuda_graphs import GraphCache, bucket_pow2
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import (
    CounterNoise, FilterOrder, RepetitionAwareSampling, SamplingBatch, draw_keys, mark_seen,
)
from omni_ray.layers.attention import AttentionBatch

if TYPE_CHECKING:
    from omni_ray.engine.codec_talker import CodecTalkerSpec


class FramePass:
    """The frame half of `CodecTalkerRunner`: per row, group 0 from the backbone's hidden state (repetition penalty
    over the row's group-0 history, `banned` ids never drawn), then one codebook pass per further group with a
    per-frame cache, and the frame's embedding that the row's next backbone step reads (`feedback`).

    What differs between families are hooks, with Qwen's layout as their defaults: `_group0_logits` (the codec
    head), `_predictor_start` (the predictor's first two inputs, the codes a frame holds before the predictor's, the
    feedback summed so far), `_predictor_weights` (group k's head and input table: one per group, or views of one),
    `_frame_feedback` (the next backbone input from the frame's codes) and the class attributes `filter_order` and
    `repetition_aware` (how group 0 and the codes are drawn)."""

    filter_order = FilterOrder.TEMPERATURE_FIRST
    repetition_aware: RepetitionAwareSampling | None = None

    model: Any
    spec: CodecTalkerSpec
    cache: SlotKVCache
    graphs: GraphCache
    device: torch.device
    dtype: torch.dtype
    num_groups: int
    mtp_vocab: int
    mtp_cache: SlotKVCache
    banned: torch.Tensor
    seen: torch.Tensor
    feedback: torch.Tensor
    recent: torch.Tensor | None
    predictor_input: Any
    _mtp_plans: dict[int, list[MtpSubStep]]
    _sample: Callable[..., torch.Tensor]

    @property
    def predictor(self) -> Any:
        """The code predictor's decoder stack."""
        return self.model.code_predictor.model

    def _group0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's normed hidden states [B, h] → group-0 logits [B, vocab]."""
        return self.model.codec_head(hidden)

    def _predictor_start(
        self, hidden: torch.Tensor, group0: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """The predictor's inputs at positions 0-1 [B, 2, w] (the backbone's hidden state, group 0's embedding), the
        frame's codes before the predictor's, and the feedback summed so far (None: `_frame_feedback` makes it)."""
        group0_embedding = self.model.model.codec_embedding(group0)
        return torch.stack([hidden, group0_embedding], dim=1), [group0], group0_embedding

    def _predictor_weights(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codebook pass k's head [V, w] (its logits) and table [V, h] (its code's embedding: the next pass's input,
        and what the feedback adds)."""
        cp = self.model.code_predictor
        return cp.lm_head[k].weight, cp.model.codec_embedding[k].weight

    def _frame_feedback(self, codes: torch.Tensor, summed: torch.Tensor | None) -> torch.Tensor:
        """A frame's codes [B, C] and the feedback summed by its passes → the rows' next backbone input [B, h]."""
        assert summed is not None
        return summed

    def _frames(self, seqs: list[TalkerSequence], hidden: torch.Tensor, host: dict[str, torch.Tensor]) -> torch.Tensor:
        """One frame per row, on the device: codes [B, C], and each row's frame embedding (which its next decode step
        reads) put into `feedback` at its slot. The codes are the graph's buffer, which the next replay overwrites:
        read them (a copy queued on this stream) before launching another frame. `host`:
        `_frame_host_inputs(seqs, rows)`, uploaded."""
        count, rows = len(seqs), bucket_pow2(len(seqs))
        inputs = self._frame_inputs(hidden, rows, host)
        mode = FrameSampling.of([s.sampling for s in seqs], [s.mtp_sampling for s in seqs])
        out = self.graphs.run(("frame", rows, mode), lambda **x: self._frame_forward(mode=mode, **x), inputs)
        # outside the graph: capture must not change what it reads
        mark_seen(self.seen, inputs["slots"], out["codes"][:, 0])
        if self.repetition_aware is not None and self.recent is not None:
            self.repetition_aware.remember(self.recent, inputs["slots"], out["codes"][:, 0], host["recent_records"])
        self.feedback[inputs["slots"][:count]] = out["feedback"][:count]
        return out["codes"][:count]

    def _frame_host_inputs(self, seqs: list[TalkerSequence], rows: int) -> dict[str, torch.Tensor]:
        """What the frame graph reads that the host decides, for `seqs` padded to `rows` (padding rows: scratch
        slot, greedy), as host tensors: slots, EOS allowed or not, noise keys (each row's draw count advances) and
        sampling tables; with repetition-aware sampling, which rows' group 0 enters their window (all but a reply's
        first frame, as fish-speech keeps it)."""
        count = len(seqs)
        host = {
            "slots": torch.tensor([s.slot for s in seqs] + [self.cache.scratch_slot] * (rows - count), dtype=torch.long),
            "no_eos": torch.tensor([s.ignore_eos or s.frames < s.min_frames for s in seqs] + [False] * (rows - count),
                                   dtype=torch.bool),
            "noise_keys": draw_keys([s.noise for s in seqs], rows),  # type: ignore[misc]
            "mtp_noise_keys": draw_keys([s.mtp_noise for s in seqs], rows),  # type: ignore[misc]
            "group0_sampling": SamplingBatch.table([s.sampling for s in seqs], rows),
            "mtp_sampling": SamplingBatch.table([s.mtp_sampling for s in seqs], rows),
        }
        if self.repetition_aware is not None:
            host["recent_records"] = torch.tensor([s.frames > 0 for s in seqs] + [False] * (rows - count),
                                                  dtype=torch.bool)
        return host

    def _frame_inputs(self, hidden: torch.Tensor, rows: int, host: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The frame graph's inputs: `hidden` padded to `rows`, the banned-token rows, and the uploaded host inputs."""
        padded = torch.zeros(rows, hidden.shape[-1], dtype=hidden.dtype, device=self.device)
        padded[: hidden.shape[0]] = hidden
        banned = self.banned.expand(rows, -1).clone()
        banned[:, self.spec.eos] |= host["no_eos"]
        names = ("slots", "noise_keys", "mtp_noise_keys", "group0_sampling", "mtp_sampling")
        return {"hidden": padded, "banned": banned, **{name: host[name] for name in names}}

    def _frame_forward(
        self, hidden: torch.Tensor, slots: torch.Tensor, banned: torch.Tensor, noise_keys: torch.Tensor,
        mtp_noise_keys: torch.Tensor, group0_sampling: torch.Tensor, mtp_sampling: torch.Tensor, mode: FrameSampling,
    ) -> dict[str, torch.Tensor]:
        """Group-0 logits → group 0 (repetition penalty over the row's group-0 history; a repeat redrawn where the
        family samples repetition-aware) → the MTP loop (graph-capturable). `mode` says which filtering the batch's
        rows need (a graph per mode); the noise is made here, from keys."""
        logits = self._group0_logits(hidden)
        params, noise, seen = SamplingBatch.from_table(group0_sampling), CounterNoise(noise_keys), self.seen[slots]
        group0 = self._sample(logits, params, noise, seen, banned, mode.filtered, mode.group0_top_k_cap)
        if self.repetition_aware is not None and self.recent is not None:
            group0 = self.repetition_aware.redraw(group0, logits, params, noise, self.recent[slots], self._sample, seen,
                                                  banned, mode.group0_top_k_cap)
        codes, feedback = self._complete_frames(hidden, group0, SamplingBatch.from_table(mtp_sampling), mtp_noise_keys, mode)
        return {"codes": codes, "feedback": feedback}

    def _complete_frames(
        self, hidden: torch.Tensor, group0: torch.Tensor, params: SamplingBatch, noise_keys: torch.Tensor,
        mode: FrameSampling,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The code predictor's loop: groups 1..G-1 for every row, with a per-frame cache (row i in MTP slot i), one
        codebook pass per group (its inputs mapped onto the predictor's width first, where `predictor_input` says).
        Returns the frame's codes [B, C] (`_predictor_start`'s, then the predictor's) and the rows' next backbone input
        [B, h] (`_frame_feedback`; Qwen's: `TalkerModel.frame_embedding` of the codes, summed in the same order)."""
        embeds, codes, feedback = self._predictor_start(hidden, group0)
        for k, sub in enumerate(self._mtp_plan(hidden.shape[0])):
            if self.predictor_input is not None:
                embeds = self.predictor_input(embeds)
            head, table = self._predictor_weights(k)
            code, embeds, feedback = codebook_pass(
                self.predictor, embeds, self.mtp_cache.layers, sub.batch, sub.cos, sub.sin, head, table, feedback,
                params, noise_keys, k * self.mtp_vocab, mode.filtered, mode.mtp_top_k_cap, draw=self._sample,
            )
            codes.append(code)
        stacked = torch.stack(codes, dim=1)
        return stacked, self._frame_feedback(stacked, feedback)

    def _mtp_plan(self, rows: int) -> list[MtpSubStep]:
        """The MTP's sub-steps for `rows` rows: the first reads [talker hidden, group-0 embedding] at positions 0-1,
        sub-step k >= 1 one code embedding at position k + 1. Every sub-step reads the per-frame cache's whole key
        range, its mask hiding the positions not yet written, so that all of them share shapes (compiled layers need
        no graph per key length). Built on first use (a graph's eager warm-up run) and kept, so
        replays read them instead of recomputing masks and rotary tables in every frame."""
        plan = self._mtp_plans.get(rows)
        if plan is None:
            stack = self.predictor
            slots = torch.arange(rows, device=self.device)
            plan, start, length = [], 0, 2
            for _ in range(self.num_groups - 1):
                batch = AttentionBatch.from_tensors(slots, torch.full_like(slots, start), length, self.mtp_cache.max_len,
                                                    rows_are_slots=True)
                batch.grouped_mask(stack.spec.num_heads // stack.spec.num_kv_heads)
                positions = (start + torch.arange(length, device=self.device))[None].expand(rows, -1)
                cos, sin = stack.rotary(positions, self.dtype)
                plan.append(MtpSubStep(batch, cos, sin))
                start, length = start + length, 1
            self._mtp_plans[rows] = plan
        return plan
