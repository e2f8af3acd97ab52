"""Qwen3-Omni Thinker: the MoE text backbone and its runner (prefill/decode steps, Talker-bound states)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from omni_ray.engine.cuda_graphs import GraphCache, all_buckets, bucket_pow2
from omni_ray.engine.fixed_shape import (
    PrefillTally,
    capture_prefills,
    decode_forward,
    decode_positions,
    last_positions,
    prefill_forward,
    run_prefill,
    warmup_shapes,
    within_prefill_budget,
)
from omni_ray.engine.host_inputs import Download, StepDone, to_device, upload
from omni_ray.engine.kv_cache import SlotKVCache, SlotTable
from omni_ray.engine.sampler import (
    GREEDY, DrawMode, NoiseSource, SamplingBatch, SamplingParams, draw_keys, mark_seen, sample_in_mode,
)
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
    num_made: int = 0  # tokens drawn, including those of a launched step not yet collected
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    noise: NoiseSource | None = None
    prefill_launched: float | None = None  # when the step that prefilled it was launched (epoch s)


@dataclass
class ThinkerStepOutput:
    """What one step produced for one request: the new token and, if it speaks, what the Talker consumes."""

    request_id: str
    token: int
    finish_reason: str | None
    # prefill: Talker prefix states (layer-0 embeddings at text positions, accept-layer hidden at audio positions)
    talker_prefix: dict[str, torch.Tensor] | None = None
    # layer-0 embedding of the step's new token, unless it ends the reply (the Talker reads reply tokens 0..N-2)
    talker_embed: torch.Tensor | None = None
    prefill_launched: float | None = None  # on a reply's first token: when the step that prefilled it was launched


# The draw inside the decode graph: noise for the rows that sample, the argmax for greedy rows (`sample` takes it
# for rows of temperature 0 in any mode), so one graph per decode bucket serves both of the API's usual modes.
DECODE_DRAW = DrawMode(sampled=True)


@dataclass
class DrawnRows:
    """One draw's tokens [n] and their layer-0 embeddings [n, h] on the device, and each drawn sequence's row in them."""

    tokens: torch.Tensor
    embeds: torch.Tensor
    rows: list[int]

    @staticmethod
    def joined(parts: list["DrawnRows"]) -> "DrawnRows":
        """The parts' rows one after the other (a step that prefills and decodes draws twice)."""
        if len(parts) == 1:
            return parts[0]
        offsets = [0]
        for part in parts[:-1]:
            offsets.append(offsets[-1] + part.tokens.shape[0])
        return DrawnRows(torch.cat([p.tokens for p in parts]), torch.cat([p.embeds for p in parts]),
                         [offset + row for offset, part in zip(offsets, parts) for row in part.rows])


@dataclass
class PendingTokens:
    """A launched Thinker step: its sampled rows (sequence, the token count it reaches, its row in `tokens`), their
    tokens on the way to the host and, for Talker-bound requests, their layer-0 embeddings on the device; `prefixes`
    are the prefilled requests' Talker prefix states, `outputs` the teacher-forced ones, known at launch."""

    rows: list[tuple[ThinkerSequence, int, int]] = field(default_factory=list)
    done: StepDone | None = None  # after the step's last work
    tokens: Download | None = None
    embeds: torch.Tensor | None = None
    prefixes: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    outputs: list[ThinkerStepOutput] = field(default_factory=list)
    early: "PendingTokens | None" = None  # the step's prefill part, done on the device before this (decode) part


class ThinkerRunner:
    """Runs Thinker steps for a batch of sequences: prefill new ones, batched decode for the rest, each followed by a
    batched draw of its rows. Prefill and decode run at bucketed fixed shapes (padding rows use the cache's scratch
    slot), replayed from CUDA graphs on a GPU; a decode step draws inside its own graph (one launch per step) unless
    some row needs a penalty or filtering, which draw in a graph of their own."""

    def __init__(
        self, model: ThinkerLM, config: Any, cache: SlotKVCache, cuda_graphs: bool = True, max_prefill_tokens: int = 8192,
        compile_layers: bool = False, moe_kernels: bool = True, prefill_graph_tokens: int | None = None,
        moe_layer_kernels: bool = True, early_first_tokens: bool = True, moe_layer_folds: bool = False,
        split_large_prefills: bool = False,
    ) -> None:
        self.model = model
        self.config = config
        self.cache = cache
        self.device = next(model.parameters()).device
        self.accept_layer = int(config.talker_config.accept_hidden_layer)
        self.audio_token_id = int(config.thinker_config.audio_token_id)
        self.multimodal_ids = torch.tensor(
            [config.thinker_config.audio_token_id, config.thinker_config.image_token_id, config.thinker_config.video_token_id]
        )
        self.graphs = GraphCache(self.device, cuda_graphs)
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_graph_tokens = prefill_graph_tokens  # larger prefills run without a graph (`run_prefill`)
        self.split_large_prefills = split_large_prefills  # ... or as graph-sized parts
        self.prefills = PrefillTally()
        # a step that prefills while others decode: the prefill's first tokens are read back before the decode runs
        self.early_first_tokens = early_first_tokens
        if moe_kernels and self.device.type == "cuda":
            model.model.use_moe_kernels()
            if moe_layer_kernels:
                model.model.use_moe_layer_kernels(moe_layer_folds)
        if compile_layers and self.device.type == "cuda":
            model.model.compile_layers()
        # tokens each slot has seen (prompt + reply), for the repetition penalty
        self.seen = torch.zeros(cache.rows, model.lm_head.out_features, dtype=torch.bool, device=self.device)
        self.next_ids = torch.zeros(cache.rows, dtype=torch.long, device=self.device)  # each slot's last draw
        self.slots: SlotTable[ThinkerSequence] = SlotTable(cache, (self.seen, self.next_ids))

    @torch.inference_mode()
    def warmup(self, max_batch: int) -> None:
        """Capture the decode graphs of every batch and key-range bucket, and short prefills, before serving (so no
        request waits on a capture). Writes only to free slots and the scratch slot. No-op without CUDA graphs."""
        if not self.graphs.enabled:
            return
        decode, prefill = warmup_shapes(self.cache, max_batch, self.max_prefill_tokens,
                                        graph_tokens=self.prefill_graph_tokens)
        for rows, kv_len in decode:
            self._prepare_decode(rows, kv_len)
        capture_prefills(self.graphs, self.cache, prefill, self.model.lm_head.in_features,
                         self.model.lm_head.weight.dtype, self._prefill_forward)
        for rows in all_buckets(max_batch):  # prefills' draws: greedy, and temperature alone (the API's default)
            for mode in (DrawMode(False), DrawMode(True)):
                self._prepare_draw(rows, mode)

    def admit(self, seq: ThinkerSequence) -> None:
        self.cache.check_fits(len(seq.prompt_ids) + seq.max_tokens)
        self.slots.allocate(seq)
        seq.noise = NoiseSource(seq.sampling)
        self.seen[seq.slot] = False
        prompt = to_device(torch.tensor(seq.prompt_ids), self.device)
        mark_seen(self.seen, torch.full_like(prompt, seq.slot), prompt)

    def release(self, seq: ThinkerSequence) -> None:
        self.slots.release(seq)

    def step(self, seqs: list[ThinkerSequence]) -> list[ThinkerStepOutput]:
        """One step, read back at once."""
        return self.collect(self.launch(seqs))

    @torch.inference_mode()
    def launch(self, seqs: list[ThinkerSequence]) -> PendingTokens:
        """Queue one step on the device without waiting for it: prefill new sequences, decode the rest, a batched
        draw for the sampled rows of each. Each draw stays on the device as its sequence's next input, so the engine can
        launch the next step before it `collect`s this one. A stop token is learnt late; a row stepped after it is
        dropped when collected. Teacher-forced replies need no device work: their outputs are ready at once.
        With `early_first_tokens`, a step that prefills while others decode reads its first tokens back as soon as
        the prefill is done (`collect_early`), not after the decode queued behind it."""
        # Partition first: a sequence prefilled in this step must not also decode in it.
        prefilling = within_prefill_budget(
            [s for s in seqs if s.num_cached == 0], lambda s: len(s.prompt_ids), self.cache, self.max_prefill_tokens
        )
        launched = time.time()
        for seq in prefilling:
            seq.prefill_launched = launched
        forced = [s for s in seqs if s.num_cached > 0 and s.forced_ids]
        decoding = [s for s in seqs if s.num_cached > 0 and not s.forced_ids]
        pending = PendingTokens()
        parts: list[DrawnRows] = []
        sampled = [s for s in prefilling if not s.forced_ids]
        if prefilling:
            prefill_logits, pending.prefixes = self._prefill(prefilling)
            if sampled:
                parts.append(self._draw(sampled, prefill_logits))
            for seq in prefilling:  # a forced reply's first token is known
                if seq.forced_ids:
                    pending.outputs.append(self._forced_output(seq, pending.prefixes.get(seq.request_id)))
        pending.outputs += [self._forced_output(seq) for seq in forced]
        self._attach_talker_embeds(pending.outputs, {s.request_id for s in seqs if s.for_talker})
        if parts and decoding and self.early_first_tokens:  # the first tokens' reads go ahead of the decode
            self._queue_reads(pending, sampled, parts)
            pending = PendingTokens(early=pending)
            sampled, parts = [], []
        sampled += decoding
        if decoding:
            parts.append(self._decode(decoding, keep_embeds=any(s.for_talker for s in decoding)))
        self._queue_reads(pending, sampled, parts)
        return pending

    def _queue_reads(self, pending: PendingTokens, sampled: list[ThinkerSequence], parts: list[DrawnRows]) -> None:
        """Queue the download of the rows `parts` drew for `sampled` (in order), then `pending.done`."""
        if parts:
            drawn = DrawnRows.joined(parts)
            if any(s.for_talker for s in sampled):
                pending.embeds = drawn.embeds
            pending.tokens = Download(drawn.tokens)  # queued before any later graph can write the draw's buffers
            for seq, row in zip(sampled, drawn.rows):
                seq.num_made += 1
                pending.rows.append((seq, seq.num_made, row))
                if seq.num_made >= seq.max_tokens:
                    seq.finish_reason = "length"
        pending.done = StepDone(self.device)  # queued last: once it is reached, every tensor this step relays is made

    def collect_early(self, pending: PendingTokens) -> list[ThinkerStepOutput]:
        """The outputs of a launched step's prefill part, once the device is done with that part (none when the
        step was not split); `collect` then returns the rest."""
        early, pending.early = pending.early, None
        return self.collect(early) if early is not None else []

    def collect(self, pending: PendingTokens) -> list[ThinkerStepOutput]:
        """Wait for a launched step's tokens and say what it made (its prefill part's first, unless `collect_early`
        read them already). A row is dropped when its request stopped at an earlier token (a stop token seen late)
        or was aborted since."""
        if pending.early is not None:
            return self.collect_early(pending) + self.collect(pending)
        if pending.done is not None:  # the relay reads this step's tensors as they are: they must be complete
            pending.done.wait()
        outputs = pending.outputs
        if pending.tokens is None:
            return outputs
        tokens = pending.tokens.result().tolist()
        for seq, made, row in pending.rows:
            token = tokens[row]
            if seq.finish_reason == "stop" or (seq.slot < 0 and seq.finish_reason is None):
                continue
            seq.output_ids.append(token)
            if token in seq.stop_ids and not seq.ignore_eos:
                seq.finish_reason = "stop"
            last = seq.finish_reason == "stop" or made >= seq.max_tokens
            out = ThinkerStepOutput(seq.request_id, token, seq.finish_reason if last else None,
                                    talker_prefix=pending.prefixes.get(seq.request_id),
                                    prefill_launched=_on_first_token(seq))
            if seq.for_talker and not last and pending.embeds is not None:
                out.talker_embed = pending.embeds[row]  # the Talker reads reply tokens 0..N-2
            outputs.append(out)
        return outputs

    def _forced_output(
        self, seq: ThinkerSequence, talker_prefix: dict[str, torch.Tensor] | None = None
    ) -> ThinkerStepOutput:
        """Teacher forcing: the reply is given, so what the Talker reads is the given tokens' layer-0 embeddings. No
        forward pass is needed for them (the Talker reads no hidden state at text positions)."""
        token = seq.forced_ids[len(seq.output_ids)]  # type: ignore[index]
        seq.output_ids.append(token)
        if len(seq.output_ids) == len(seq.forced_ids):  # type: ignore[arg-type]
            seq.finish_reason = "stop"
        return ThinkerStepOutput(seq.request_id, token, seq.finish_reason, talker_prefix=talker_prefix,
                                 prefill_launched=_on_first_token(seq))

    def _attach_talker_embeds(self, outputs: list[ThinkerStepOutput], speaking: set[str]) -> None:
        """Forced tokens' layer-0 embeddings for the Talker, relayed with the step that made them. A reply's last
        token is not spoken."""
        new = [out for out in outputs if out.request_id in speaking and out.finish_reason is None]
        if not new:
            return
        ids = to_device(torch.tensor([out.token for out in new], dtype=torch.long), self.device)
        for out, embed in zip(new, self.model.embed(ids)):
            out.talker_embed = embed

    def _prefill_forward(self, embeds: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, captured = prefill_forward(self.model.model, self.cache, embeds, slots, (self.accept_layer,))
        return {"hidden": hidden, "accept": captured[self.accept_layer]}

    def _prefill(self, seqs: list[ThinkerSequence]) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
        """Prefill every sequence that needs a forward pass in one padded batch. Returns the last-position logits of
        the sampled (non-forced) sequences, in order, and each Talker-bound sequence's prefix states."""
        self.prefills.add(len(seqs))
        mm_masks = [torch.isin(torch.tensor(s.prompt_ids), self.multimodal_ids) for s in seqs]
        places = {i: talker_prefix_positions(s.prompt_ids, self.config) for i, s in enumerate(seqs) if s.for_talker}
        # Every host-built input of the batch in one upload (one copy, not a few per sequence).
        host = {"ids": torch.tensor([token for s in seqs for token in s.prompt_ids], dtype=torch.long)}
        for i, (positions, _) in places.items():
            host[f"mm_mask/{i}"], host[f"positions/{i}"] = mm_masks[i], positions
        inputs = upload(host, self.device)
        embeds_by_seq = list(self.model.embed(inputs["ids"]).split([len(s.prompt_ids) for s in seqs]))
        for seq, embeds in zip(seqs, embeds_by_seq):
            self._splice_audio(seq, embeds)
        # a forced text-only reply needs no forward pass
        running = [i for i, s in enumerate(seqs) if not s.forced_ids or bool(mm_masks[i].any())]
        out: dict[str, torch.Tensor] = {}
        if running:
            out = run_prefill(self.graphs, self._prefill_forward, [embeds_by_seq[i] for i in running],
                              [seqs[i].slot for i in running], self.cache, self.prefill_graph_tokens,
                              self.split_large_prefills)
        row_of = {i: row for row, i in enumerate(running)}
        sampled = [i for i, s in enumerate(seqs) if not s.forced_ids]
        logits = torch.empty(0, self.model.lm_head.out_features, dtype=self.model.lm_head.weight.dtype, device=self.device)
        if sampled:
            last = last_positions(out["hidden"], [row_of[i] for i in sampled], [len(seqs[i].prompt_ids) for i in sampled])
            logits = self.model.lm_head(last)
        prefixes = {}
        for i, seq in enumerate(seqs):
            seq.num_cached = len(seq.prompt_ids)
            if seq.for_talker:
                accept = out["accept"][row_of[i], : seq.num_cached] if i in row_of else None
                mm_mask, positions = inputs[f"mm_mask/{i}"], inputs[f"positions/{i}"]
                prefixes[seq.request_id] = self._talker_prefix(embeds_by_seq[i], mm_mask, positions, places[i][1], accept)
        return logits, prefixes

    def _splice_audio(self, seq: ThinkerSequence, embeds: torch.Tensor) -> None:
        """Audio embeddings into a prompt's embeddings [T, H], at its audio placeholders."""
        if seq.audio_embeds is None:
            return
        places = [i for i, token in enumerate(seq.prompt_ids) if token == self.audio_token_id]
        if len(places) != seq.audio_embeds.shape[0]:
            raise ValueError("audio embeddings do not match the number of audio placeholder tokens")
        audio = to_device(seq.audio_embeds, self.device).to(embeds.dtype)
        embeds[to_device(torch.tensor(places, dtype=torch.long), self.device)] = audio

    @staticmethod
    def _talker_prefix(
        embeds: torch.Tensor, mm_mask: torch.Tensor, positions: torch.Tensor, assistant_start: int,
        accept: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Layer-0 embeddings at the user turn's text `positions`, accept-layer hidden states at its multimodal ones
        (`mm_mask`, over the prompt); all on the device, in the model's dtype (the Talker reads them in its own: bf16
        on a GPU, so relaying them as fp32 would double the prefill's relay for nothing), none a view of the batch's
        buffers."""
        states = embeds if accept is None else torch.where(mm_mask[:, None], accept, embeds)
        return {
            "user_states": states[positions],
            "user_multimodal": mm_mask[positions],
            "assistant_prefix": embeds[assistant_start : assistant_start + 3].clone(),
        }

    def _decode_function(self, kv_len: int) -> Callable[..., dict[str, torch.Tensor]]:
        def decode_and_draw(longs: torch.Tensor, table: torch.Tensor) -> dict[str, torch.Tensor]:
            """A decode step over rows 0..R-1 and its draw (graph-capturable). longs [R, 4]: each row's position, the
            slot its draw writes (the scratch slot for rows whose token is not drawn here) and its noise keys."""
            positions, slots = longs[:, 0], longs[:, 1]
            ids = self.next_ids[: positions.shape[0]]  # each slot's last draw
            hidden = decode_forward(self.model.model, self.cache, self.model.embed(ids[:, None]), positions, kv_len)
            logits = self.model.lm_head(hidden)
            drawn = self._draw_function(DECODE_DRAW)(logits, slots, table, longs[:, 2:].contiguous())
            return {"logits": logits, **drawn}

        return decode_and_draw

    def _prepare_decode(self, rows: int, kv_len: int) -> None:
        """Capture the decode graph of (rows, key range) from dummy rows: each writes its slot's last cache position,
        which a sequence overwrites before reading it, and draws into the scratch slot."""
        if not self.graphs.enabled or ("decode", rows, kv_len) in self.graphs:
            return
        longs = torch.zeros(rows, 4, dtype=torch.long)
        longs[:, 0], longs[:, 1] = self.cache.max_len - 1, self.cache.scratch_slot
        example = {"longs": longs, "table": SamplingBatch.table([], rows)}  # host inputs: uploaded without a wait
        self.graphs.prepare(("decode", rows, kv_len), self._decode_function(kv_len), example)

    def _decode(self, seqs: list[ThinkerSequence], keep_embeds: bool) -> DrawnRows:
        """Decode over the first slots of the cache (row r = slot r) and draw each sequence's next token, in one graph
        when its draw mode is `DECODE_DRAW`'s (sampling with temperature, or greedy); a penalized or filtered batch
        draws from the graph's logits in a graph of its own. `keep_embeds`: the embeddings outlive the step's graphs."""
        positions, kv_len = decode_positions([(s.slot, s.num_cached) for s in seqs], self.cache)
        rows = positions.shape[0]
        params = [s.sampling for s in seqs]
        in_graph = DrawMode.of(params) in (DrawMode(sampled=False), DECODE_DRAW)
        slot_of_row = torch.full((rows,), self.cache.scratch_slot, dtype=torch.long)
        keys = torch.zeros(rows, 2, dtype=torch.long)
        row_params = [GREEDY] * rows
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
        if in_graph:
            slot_of_row[slots] = slots
            keys[slots] = draw_keys([s.noise for s in seqs])  # type: ignore[misc]
            for seq in seqs:
                row_params[seq.slot] = seq.sampling
        host = {"longs": torch.cat([positions[:, None], slot_of_row[:, None], keys], 1),
                "table": SamplingBatch.table(row_params)}
        self._prepare_decode(rows, kv_len)
        out = self.graphs.run(("decode", rows, kv_len), self._decode_function(kv_len), host)
        for seq in seqs:
            seq.num_cached += 1
        if in_graph:
            embeds = out["embeds"].clone() if keep_embeds else out["embeds"]
            return DrawnRows(out["tokens"], embeds, [s.slot for s in seqs])
        logits = out["logits"][to_device(slots, self.device)]
        return self._draw(seqs, logits)

    def _draw(self, seqs: list[ThinkerSequence], logits: torch.Tensor) -> DrawnRows:
        """One batched draw for `seqs` from their logits [n, V] (row i: seqs[i]), on the device with no host sync,
        replayed from a CUDA graph per (row bucket, draw mode). Returns the tokens and their layer-0 embeddings (what
        the Talker reads), copied out of the graph's buffers; each slot's history and next decode input are updated."""
        count, rows = len(seqs), bucket_pow2(len(seqs))
        params = [s.sampling for s in seqs]
        host = {"slots": torch.tensor([s.slot for s in seqs] + [self.cache.scratch_slot] * (rows - count)),
                "table": SamplingBatch.table(params, rows), "keys": draw_keys([s.noise for s in seqs], rows)}  # type: ignore[misc]
        if rows > count:  # padding rows: greedy, in the scratch slot
            logits = torch.cat([logits, logits.new_zeros(rows - count, logits.shape[1])])
        mode = DrawMode.of(params)
        self._prepare_draw(rows, mode)
        out = self.graphs.run(("draw", rows, mode), self._draw_function(mode), {"logits": logits, **host})
        return DrawnRows(out["tokens"][:count].clone(), out["embeds"][:count].clone(), list(range(count)))

    def _draw_function(self, mode: DrawMode) -> Callable[..., dict[str, torch.Tensor]]:
        def draw(logits: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, keys: torch.Tensor) -> dict[str, torch.Tensor]:
            """The draw (graph-capturable): tokens, the slots' histories and next inputs, the tokens' embeddings."""
            tokens = sample_in_mode(logits, table, keys, mode, self.seen[slots] if mode.penalized else None)
            mark_seen(self.seen, slots, tokens)
            self.next_ids[slots] = tokens
            return {"tokens": tokens, "embeds": self.model.embed(tokens)}

        return draw

    def _prepare_draw(self, rows: int, mode: DrawMode) -> None:
        """Capture the draw graph of (rows, mode) from scratch-slot rows: the draw writes the rows' histories, which
        a penalized draw reads, so a capture on a step's own rows would draw their tokens twice."""
        if not self.graphs.enabled or ("draw", rows, mode) in self.graphs:
            return
        scratch = torch.full((rows,), self.cache.scratch_slot, dtype=torch.long, device=self.device)
        example = {"logits": torch.zeros(rows, self.model.lm_head.out_features, dtype=self.model.lm_head.weight.dtype,
                                         device=self.device),
                   "slots": scratch, "table": SamplingBatch.table([], rows),
                   "keys": torch.zeros(rows, 2, dtype=torch.long, device=self.device)}
        self.graphs.prepare(("draw", rows, mode), self._draw_function(mode), example)


def _on_first_token(seq: ThinkerSequence) -> float | None:
    """When the sequence's prefill step was launched, on the output that carries its first token (else None)."""
    return seq.prefill_launched if len(seq.output_ids) == 1 else None
