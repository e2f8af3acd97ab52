"""A codec Talker's runner: batched backbone steps, then one frame pass (group 0 + the code predictor) per step."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omni_ray.config import DEFAULT_PERSISTENT_L2_KEEP_PERCENT
from omni_ray.engine.codec_frame import FramePass
from omni_ray.engine.codec_sequence import (
    MTP_SAMPLING, FrameSampling, MtpSubStep, PendingFrames, TalkerSequence, TalkerStepOutput,
)
from omni_ray.engine.cuda_graphs import GraphCache, bucket_pow2
from omni_ray.engine.fixed_shape import (
    PrefillTally,
    capture_prefills,
    decode_forward,
    decode_positions,
    dummy_decode_positions,
    last_positions,
    prefill_forward,
    run_decode,
    run_prefill,
    warmup_shapes,
    within_prefill_budget,
)
from omni_ray.engine.host_inputs import Download, stack_on_device, upload
from omni_ray.engine.kv_cache import SlotKVCache, SlotTable
from omni_ray.engine.prefix_cache import PrefixCache
from omni_ray.engine.profiling import host_range
from omni_ray.engine.sampler import FilterOrder, NoiseSource, SamplingParams, fused_sample, sample, top_k_cap
from omni_ray.engine.top_k_draw import KernelDraw
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.persistent_pass import KernelBuildError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecTalkerSpec:
    """What a codec Talker's runner needs to know of its model besides the modules: the codec's ids and the code
    predictor's cache geometry."""

    num_groups: int  # code groups per frame: group 0 from the backbone, the rest from the code predictor
    vocab: int  # the backbone's vocabulary; its top `control_codes` ids are never sampled, except EOS
    eos: int
    bos: int  # the codec input of a prompt's last position
    predictor_layers: int
    predictor_kv_heads: int
    predictor_head_dim: int
    predictor_vocab: int
    control_codes: int = 1024
    code_sampling: SamplingParams = MTP_SAMPLING  # what the code predictor samples with by default (graph warm-up)
    # the ids group 0 draws from (first, last), besides EOS, where that is not all but the top `control_codes`
    sampled_ids: tuple[int, int] | None = None


class TalkerParts(Protocol):
    """The modules a codec Talker's runner drives, by their checkpoint names: `model` (the backbone, a `DecoderStack`
    with a `codec_embedding`), `codec_head`, `text_projection` and `code_predictor` (`model`, a `DecoderStack` with one
    `codec_embedding` per group past 0, `lm_head` the same, and optionally `small_to_mtp_projection`, which maps the
    backbone's width onto the predictor's)."""

    model: Any
    codec_head: Any
    text_projection: Any
    code_predictor: Any


class TalkerTextRows(Protocol):
    """The model and the projected text rows a Talker's decode steps read past a reply's text."""

    model: Any
    tts_eos: torch.Tensor  # [h]
    tts_pad: torch.Tensor  # [h]


def talker_options(engine: Any) -> dict[str, Any]:
    """A Talker stage's `CodecTalkerRunner` options from its `EngineSettings`."""
    return {
        "cuda_graphs": engine.cuda_graphs, "max_prefill_tokens": engine.max_prefill_tokens,
        "compile_layers": engine.compile_layers, "sampling_kernel": engine.sampling_kernel,
        "code_predictor_kernels": engine.code_predictor_kernels, "moe_kernels": engine.moe_kernels,
        "prefill_graph_tokens": engine.prefill_graph_tokens, "moe_layer_kernels": engine.moe_layer_kernels,
        "persistent_code_predictor": engine.persistent_code_predictor,
        "persistent_code_predictor_max_rows": engine.persistent_code_predictor_max_rows,
        "persistent_code_predictor_l2_keep_percent": engine.persistent_code_predictor_l2_keep_percent,
        "persistent_code_predictor_draws": engine.persistent_code_predictor_draws,
        "moe_layer_folds": engine.moe_layer_folds, "split_large_prefills": engine.split_large_prefills,
        "prefix_cache_bytes": int(engine.prefix_cache_mb * 2**20),
    }


class CodecTalkerRunner(FramePass):
    """Batched Talker steps: prefill or decode the backbone, then one frame pass that samples group 0 and lets the
    code predictor complete groups 1..G-1. Every pass runs at bucketed fixed shapes, replayed from CUDA graphs on a
    GPU: the backbone decode per (rows, key range), the whole frame (group 0 + the completions) per row count.

    A family subclasses it with its prompts: `_prompts` (each new sequence's prefill embeddings) and
    `_prompt_length`. `first_text_in_prompt`: the prompt ends with the reply's first text token, so a sequence
    waits for it (and may prefill all but that position before: early prefill), and one whose text ended with none
    has nothing to speak. `streams_text`: each decode step adds the request's next text row to the frame's
    embedding (else a step reads the frame's embedding alone: the whole text was in the prompt). The frame pass and
    its hooks are `FramePass`'s."""

    first_text_in_prompt = True
    streams_text = True

    def __init__(
        self,
        assets: TalkerTextRows,
        spec: CodecTalkerSpec,
        cache: SlotKVCache,
        max_batch: int,
        cuda_graphs: bool = True,
        max_prefill_tokens: int = 8192,
        compile_layers: bool = False,
        sampling_kernel: bool = True,
        code_predictor_kernels: bool = True,
        moe_kernels: bool = True,
        prefill_graph_tokens: int | None = None,
        moe_layer_kernels: bool = True,
        persistent_code_predictor: bool = False,
        persistent_code_predictor_max_rows: int = 32,
        moe_layer_folds: bool = False,
        persistent_code_predictor_l2_keep_percent: int = DEFAULT_PERSISTENT_L2_KEEP_PERCENT,
        persistent_code_predictor_draws: bool = False,
        split_large_prefills: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.assets = assets
        self.model: TalkerParts = assets.model
        self.spec = spec
        self.cache = cache
        self.num_groups = spec.num_groups
        self.eos = spec.eos
        self.vocab = spec.vocab
        with torch.inference_mode():  # the codec input of a prompt's last position (early prefill decodes it)
            self.codec_bos = self._bos_embedding(spec.bos)
        self.device, self.dtype, self.width = self.codec_bos.device, self.codec_bos.dtype, self.codec_bos.shape[-1]
        self.banned = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
        if spec.sampled_ids is None:  # the top ids are control codes, never sampled as audio, except EOS
            self.banned[self.vocab - spec.control_codes :] = True
        else:
            self.banned[:] = True
            self.banned[spec.sampled_ids[0] : spec.sampled_ids[1] + 1] = False
        self.banned[self.eos] = False
        self.seen = torch.zeros(cache.rows, self.vocab, dtype=torch.bool, device=self.device)  # group-0 history
        # per slot, the embedding of its last frame: the codec input of its next decode step
        self.feedback = torch.zeros(cache.rows, self.width, dtype=self.dtype, device=self.device)
        # per slot, its last group-0 draws, where a repeat among them is redrawn (`repetition_aware`)
        self.recent = None if self.repetition_aware is None else self.repetition_aware.recent_tokens(cache.rows,
                                                                                                     self.device)
        side = (self.seen, self.feedback) + (() if self.recent is None else (self.recent,))
        self.slots: SlotTable[TalkerSequence] = SlotTable(cache, side)
        self.mtp_vocab = spec.predictor_vocab
        self.mtp_cache = SlotKVCache(
            spec.predictor_layers, bucket_pow2(max_batch), self.num_groups + 1, spec.predictor_kv_heads,
            spec.predictor_head_dim, self.dtype, self.device,
        )
        # the predictor's input projection, where its width is not the backbone's
        self.predictor_input = getattr(getattr(self.model, "code_predictor", None), "small_to_mtp_projection", None)
        if isinstance(self.predictor_input, torch.nn.Identity):
            self.predictor_input = None
        self.graphs = GraphCache(self.device, cuda_graphs)
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_graph_tokens = prefill_graph_tokens  # larger prefills run without a graph (`run_prefill`)
        self.split_large_prefills = split_large_prefills  # ... or as graph-sized parts
        # the keys and values of prompts' shared prefixes (a voice's), reused by later prompts that start with them
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        # Steps that made frames: the clock the vocoder ends its aligned chunks on. It starts again at a step where
        # no sequence holding a slot has spoken yet, so a request served alone is chunked, and its audio rounded,
        # the same way every time.
        self.frame_steps = 0
        self._mtp_plans: dict[int, list[MtpSubStep]] = {}
        self.early_prefills = 0  # sequences prefilled before their first reply token
        self.prefills = PrefillTally()  # early ones included: each is a batch of its own
        self._sample = sample
        if moe_kernels and self.device.type == "cuda":
            self.backbone.use_moe_kernels()
            if moe_layer_kernels:
                self.backbone.use_moe_layer_kernels(moe_layer_folds)
        default_order = self.filter_order is FilterOrder.TEMPERATURE_FIRST  # the kernels draw in it
        if compile_layers and self.device.type == "cuda":
            self.backbone.compile_layers()
            stack = self.predictor
            stack.compile_layers()  # compiled on first use: with the kernels, only steps past them (over 64 rows)
            if code_predictor_kernels:
                stack.use_small_batch_kernels()
                if persistent_code_predictor and self.predictor_input is None and default_order:
                    self._use_persistent_pass(stack, persistent_code_predictor_max_rows,
                                              persistent_code_predictor_l2_keep_percent,
                                              persistent_code_predictor_draws and sampling_kernel)
            # the frame's 16 draws: a Triton kernel each, or a few inductor kernels each
            self._sample = KernelDraw(fused_sample) if sampling_kernel and default_order else fused_sample
        if self.filter_order is not FilterOrder.TEMPERATURE_FIRST:
            self._sample = functools.partial(self._sample, order=self.filter_order)

    @property
    def backbone(self) -> Any:
        """The backbone's decoder stack."""
        return self.model.model

    def _bos_embedding(self, bos: int) -> torch.Tensor:
        """The codec input [h] of a prompt's last position, where its first decode step runs it (early prefill)."""
        table = self.model.model.codec_embedding
        return table(torch.tensor(bos, device=table.weight.device))

    def _use_persistent_pass(self, stack: Any, max_rows: int, l2_keep_percent: int, draws: bool) -> None:
        """The code predictor's passes of up to `max_rows` rows as one persistent kernel each (`draws`: drawing the
        codes in the same launch), or (logged) the Triton kernels where the kernel does not take the model or cannot
        be built here (no NVRTC, too few multiprocessors, another process's passes on this GPU)."""
        try:
            if not stack.use_persistent_pass(self.mtp_vocab, max_rows, l2_keep_percent, draws):
                log.warning("the persistent code-predictor pass does not take this model: Triton kernels it is")
        except KernelBuildError as exc:
            log.warning("the persistent code-predictor pass could not be built (%s): Triton kernels it is", exc)

    @torch.inference_mode()
    def warmup(self, max_batch: int) -> None:
        """Capture every decode and frame graph bucket, and short prefills, before serving. Writes only to free
        slots and the scratch slot. No-op without CUDA graphs."""
        if not self.graphs.enabled:
            return
        decode, prefill = warmup_shapes(self.cache, max_batch, self.max_prefill_tokens,
                                        graph_tokens=self.prefill_graph_tokens)
        dtype, width = self.dtype, self.width
        for rows, kv_len in decode:
            positions = dummy_decode_positions(rows, self.cache, self.device)
            embeds = torch.zeros(rows, 1, width, dtype=dtype, device=self.device)
            run_decode(self.graphs, self._decode_forward, kv_len, {"embeds": embeds, "positions": positions})
        mtp_cap = top_k_cap([self.spec.code_sampling])  # the released sampling: top-k 50 for group 0 and the MTP alike
        for rows in sorted({r for r, _ in decode}):
            host = upload(self._frame_host_inputs([], rows), self.device)
            inputs = self._frame_inputs(torch.zeros(0, width, dtype=dtype, device=self.device), rows, host)
            for mode in (FrameSampling(False), FrameSampling(True), FrameSampling(True, mtp_cap, mtp_cap)):
                self.graphs.run(("frame", rows, mode), lambda **x: self._frame_forward(mode=mode, **x), inputs)
        capture_prefills(self.graphs, self.cache, prefill, width, dtype, self._prefill_forward)

    def describe_failure(self) -> str | None:
        """What the persistent code-predictor pass said, if a launch of it stalled and trapped (the step failed)."""
        kernel = getattr(self.predictor, "persistent", None)
        return kernel.stall() if kernel is not None else None

    def admit(self, seq: TalkerSequence) -> None:
        self.slots.allocate(seq)
        seq.noise = NoiseSource(seq.sampling)
        seed = None if seq.sampling.seed is None else seq.sampling.seed + 1
        seq.mtp_noise = NoiseSource(seq.mtp_sampling.model_copy(update={"seed": seed}))
        self.seen[seq.slot] = False
        if self.recent is not None:
            self.recent[seq.slot] = 0

    def release(self, seq: TalkerSequence) -> None:
        self.slots.release(seq)

    def ready(self, seq: TalkerSequence) -> bool:
        """Can this sequence take a step now, or is it waiting on text? (An early sequence prefills before the first
        token; its prompt's last position then waits for it, as a decode step: `steps` is -1 until then. A prompt
        that does not take the first text is whole from the start; one that streams no text never waits.)"""
        if seq.num_cached == 0:
            if not self.first_text_in_prompt:
                return True
            return seq.prefix is not None and (bool(seq.text_embeds) or seq.thinker_done or seq.early)
        return not self.streams_text or seq.steps + 1 < len(seq.text_embeds) or seq.thinker_done

    def step(self, seqs: list[TalkerSequence]) -> list[TalkerStepOutput]:
        """One step, read back at once."""
        return self.collect(self.launch(seqs))

    @torch.inference_mode()
    def launch(self, seqs: list[TalkerSequence]) -> PendingFrames:
        """Queue one step's work on the device and return without waiting for it. Everything the next step needs
        from this one stays on the device (the codec feedback, the group-0 history), so the engine can launch the
        next step before it `collect`s this one: the host builds step N+1 while the GPU runs step N. Only a codec
        EOS is learnt late; a row stepped after its EOS is dropped when collected."""
        pending = PendingFrames()
        launched = time.time()
        for seq in seqs:
            if (self.first_text_in_prompt and (seq.num_cached == 0 or seq.steps < 0) and not seq.text_embeds
                    and seq.thinker_done):
                seq.finish_reason = "stop"  # the text ended before its first token: nothing to speak
                pending.outputs.append(TalkerStepOutput(seq.request_id, None, "stop"))
        new = within_prefill_budget(
            [s for s in seqs if s.num_cached == 0 and s.finish_reason is None], self._prompt_length, self.cache,
            self.max_prefill_tokens,
        )
        # Decided once: the relay may append the first token while this step runs.
        first_token = {s.request_id: bool(s.text_embeds) or not self.first_text_in_prompt for s in new}
        early = [s for s in new if not first_token[s.request_id]]  # all but the prompt's last position; no frame yet
        prefilling = [s for s in new if first_token[s.request_id]]
        decoding = [s for s in seqs if s.num_cached > 0 and s.finish_reason is None]
        stepping = prefilling + decoding
        if early:
            self._prefill(early, early=True)
        if not stepping:
            return pending
        # Every small input of the step (and the reply tokens' embeddings that came on the host path) goes to the
        # device before the first graph launch, in one non-blocking copy: the host then runs ahead of the GPU until
        # the frame's codes are read.
        with host_range("talker: step inputs"):
            host = self._frame_host_inputs(stepping, bucket_pow2(len(stepping)))
            kv_len, texts = 0, []
            if decoding:
                host["positions"], kv_len = decode_positions([(s.slot, s.num_cached) for s in decoding], self.cache)
                host["decode_rows"] = torch.tensor([s.slot for s in decoding], dtype=torch.long)
                if self.streams_text:
                    host["text_rows"], texts = self._trailing_texts(decoding)
                    if texts and all(t.device.type == "cpu" for t in texts):  # all relayed on the host path: one upload
                        host["texts"], texts = torch.stack(texts), []
            inputs = upload(host, self.device)
        hiddens = []
        if prefilling:
            hiddens.append(self._prefill(prefilling))
        if decoding:
            with host_range("talker: decode"):
                hiddens.append(self._decode(decoding, inputs, kv_len, texts))
        with host_range("talker: frames"):
            codes = self._frames(stepping, torch.cat(hiddens), inputs)
        if not any(seq.frames for seq in self.slots.sequences()):  # none has spoken yet: the clock starts again
            self.frame_steps = 0
        pending.codes, pending.step = Download(codes), self.frame_steps
        self.frame_steps += 1
        for seq in stepping:
            if seq.frames == 0:
                seq.first_frame_launched = launched
            if seq.text_read_launched is None and seq.thinker_done and seq.steps >= len(seq.text_embeds):
                seq.text_read_launched = launched  # this step's text input was tts_eos (`_trailing_texts`)
            seq.frames += 1
            pending.rows.append((seq, seq.frames))
            if seq.frames >= seq.frame_limit() or seq.num_cached + 1 > self.cache.max_len:
                seq.finish_reason = "length"
        return pending

    def collect(self, pending: PendingFrames) -> list[TalkerStepOutput]:
        """Wait for a launched step's codes and say what it made: each row's frame, or its end. A row is dropped
        when its request ended at an earlier frame (a codec EOS seen late) or was aborted since."""
        outputs = pending.outputs
        if pending.codes is None:
            return outputs
        for (seq, frame), codes in zip(pending.rows, pending.codes.result().tolist()):
            if frame > seq.frames or (seq.slot < 0 and seq.finish_reason is None):
                continue
            if codes[0] == self.eos:
                seq.frames, seq.finish_reason = frame - 1, "stop"
                outputs.append(TalkerStepOutput(seq.request_id, None, "stop"))
                continue
            limit = seq.frame_limit()
            if seq.finish_reason is None and frame >= limit:  # the Thinker's end came after this step's launch
                seq.finish_reason, seq.frames = "length", frame
                if frame > limit:  # past the limit: the previous frame was the last
                    seq.frames = frame - 1
                    outputs.append(TalkerStepOutput(seq.request_id, None, "length"))
                    continue
            last = seq.finish_reason is not None and frame == seq.frames
            outputs.append(TalkerStepOutput(seq.request_id, codes, seq.finish_reason if last else None, pending.step))
        return outputs

    def _prompt_length(self, seq: TalkerSequence) -> int:
        """The length of the prompt `_prompts` makes for this sequence (with its first text, where it takes one)."""
        raise NotImplementedError

    def _prompts(self, seqs: list[TalkerSequence], early: bool = False) -> list[torch.Tensor]:
        """Talker prefill embeddings [T_i, h] of each sequence; `early` (before its first text): all but the last
        position."""
        raise NotImplementedError

    def _prefill_forward(self, embeds: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": prefill_forward(self.backbone, self.cache, embeds, slots)[0]}

    def _prefill(self, seqs: list[TalkerSequence], early: bool = False) -> torch.Tensor:
        """All new sequences in one padded batch → each one's last hidden state [N, h]. `early`: all but their
        prompts' last position, which then runs as their first decode step (its codec input is BOS, its text the
        first reply token), whose frame is the first. A sequence whose shared prefix is in the prefix cache gets its
        keys and values copied in and prefills only the rest of its prompt; one whose prefix is not leaves it there."""
        self.prefills.add(len(seqs))
        with host_range("talker: prompts"):
            prompts = self._prompts(seqs, early)
        for prompt in prompts:
            self.cache.check_fits(prompt.shape[0] + (2 if early else 1))
        reused = self._reused_prefixes(seqs) if not early else {}
        fresh = [i for i in range(len(seqs)) if i not in reused]
        hidden: list[torch.Tensor | None] = [None] * len(seqs)
        if fresh:
            with host_range("talker: prefill"):
                out = run_prefill(self.graphs, self._prefill_forward, [prompts[i] for i in fresh],
                                  [seqs[i].slot for i in fresh], self.cache, self.prefill_graph_tokens,
                                  self.split_large_prefills)
            last = last_positions(out["hidden"], list(range(len(fresh))), [prompts[i].shape[0] for i in fresh])
            for row, i in enumerate(fresh):
                hidden[i] = last[row]
                seq = seqs[i]
                if self.prefix_cache is not None and seq.shared_prefix_key is not None and not early:
                    self.prefix_cache.save(seq.shared_prefix_key, self.cache, seq.slot, seq.shared_prefix_len)
        for i, start in reused.items():
            with host_range("talker: prefill past a cached prefix"):
                hidden[i] = self._prefill_from(seqs[i], prompts[i], start)
        for seq, prompt in zip(seqs, prompts):
            seq.num_cached = prompt.shape[0]
            if early:
                seq.steps = -1
                self.feedback[seq.slot] = self.codec_bos
                self.early_prefills += 1
        return torch.stack(hidden)  # type: ignore[arg-type]

    def _reused_prefixes(self, seqs: list[TalkerSequence]) -> dict[int, int]:
        """The sequences (by index) whose shared prefix the cache holds, each with its prefix written into its slot:
        where their prefill starts."""
        reused: dict[int, int] = {}
        if self.prefix_cache is None:
            return reused
        for i, seq in enumerate(seqs):
            if seq.shared_prefix_key is None or seq.shared_prefix_len <= 0:
                continue
            entry = self.prefix_cache.lookup(seq.shared_prefix_key, seq.shared_prefix_len)
            if entry is not None:
                self.prefix_cache.restore(entry, self.cache, seq.slot)
                reused[i] = entry.length
        return reused

    def _prefill_from(self, seq: TalkerSequence, prompt: torch.Tensor, start: int) -> torch.Tensor:
        """Prefill positions start.. of one prompt over the keys and values already in its slot → its last hidden
        state [h] (eager: a step's few prefix hits each run at their own length)."""
        embeds = prompt[start:][None]
        batch = AttentionBatch.build([seq.slot], [start], embeds.shape[1], self.device)
        positions = torch.arange(start, prompt.shape[0], device=self.device)[None]
        out, _ = self.backbone(embeds, positions, self.cache.layers, batch)
        return out[0, -1]

    def _trailing_texts(self, seqs: list[TalkerSequence]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Text input of each row's decode step `steps`: text embedding steps + text_offset (projected), then tts_eos
        once, then tts_pad (an early sequence's step -1, its prompt's last position: the first reply token). As the reply
        tokens' Thinker embeddings still to project (P of them) and, per row, where its input sits in those P
        projected rows followed by tts_eos and tts_pad: one gather on the device, whatever the batch."""
        texts: list[torch.Tensor] = []
        rows: list[int] = []
        for seq in seqs:
            index = seq.steps + seq.text_offset
            if index < len(seq.text_embeds):
                rows.append(len(texts))
                texts.append(seq.text_embeds[index])
            else:
                rows.append(-2 if index == len(seq.text_embeds) else -1)  # counted from the end: tts_eos, tts_pad
        return torch.tensor([r % (len(texts) + 2) for r in rows], dtype=torch.long), texts

    def _decode_forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv_len: int) -> dict[str, torch.Tensor]:
        return {"hidden": decode_forward(self.backbone, self.cache, embeds, positions, kv_len)}

    def _decode(
        self, seqs: list[TalkerSequence], inputs: dict[str, torch.Tensor], kv_len: int, texts: list[torch.Tensor],
    ) -> torch.Tensor:
        """Decode over the first slots of the cache (row r = slot r; `inputs`: the uploaded step inputs, with the slots
        of `seqs` as `decode_rows`, `positions` and `kv_len` from `decode_positions`, and `text_rows` and the reply
        tokens' embeddings from `_trailing_texts`: as `texts`, or uploaded as `inputs["texts"]` when all came on the
        host path; neither without `streams_text`); returns the hidden states of `seqs` in order."""
        positions, rows = inputs["positions"], inputs["decode_rows"]
        embeds = torch.zeros(positions.shape[0], 1, self.width, dtype=self.dtype, device=self.device)
        if self.streams_text:
            a = self.assets
            choices = [a.tts_eos[None], a.tts_pad[None]]
            # relayed on the host path or through CUDA IPC (by each message's size), so on the host or already here
            raw = inputs.get("texts") if not texts else stack_on_device(texts, self.device)
            if raw is not None:
                choices.insert(0, self.model.text_projection(raw.to(dtype=a.tts_pad.dtype)))
            embeds[rows, 0] = self.feedback[rows] + torch.cat(choices)[inputs["text_rows"]]
        else:
            embeds[rows, 0] = self.feedback[rows]
        out = run_decode(self.graphs, self._decode_forward, kv_len, {"embeds": embeds, "positions": positions})
        for s in seqs:
            s.num_cached += 1
            s.steps += 1
        return out["hidden"][rows]
