"""The stages every speech family shares: a codec Talker's engine replica and the streaming vocoder replica."""

from __future__ import annotations

import asyncio
import time
from contextlib import nullcontext
from typing import Any, AsyncIterator, Callable

import torch

from omni_ray.config import EngineSettings, StageResources, TalkerSettings, VocoderStageConfig
from omni_ray.engine.codec_sequence import TalkerSequence, TalkerStepOutput
from omni_ray.engine.codec_talker import CodecTalkerRunner
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.lanes import EngineLanes
from omni_ray.engine.loop import EngineLoop, lower_gil_switch_interval
from omni_ray.errors import CapacityError
from omni_ray.layers import small_batch
from omni_ray.relay import RelayItem
from omni_ray.stages.admission import refusal_event, refuse_if_queue_too_long
from omni_ray.stages.base import FINAL_TYPES, StageBase
from omni_ray.vocoder import ChunkSchedule, StatefulStreamingDecoder, StreamingDecoder, decode_window_lengths, step_shapes
from omni_ray.vocoder.batching import BatchingCodec, BatchingStatefulCodec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the points of the first text's way to the Talker that its relay message stamps
RELAY_POINTS = ("first_text_queued", "first_text_sent", "first_text_arrived")


def engine_stats(stage: StageBase, engine: EngineLoop[Any, Any] | EngineLanes[Any, Any]) -> dict[str, Any]:
    """An engine stage's load report: the stage's, the engine's and the relay endpoint's figures, KV slots used."""
    stats = {**StageBase.load_stats(stage), **engine.stats(), **stage.endpoint.stats()}
    runners = engine.runners if isinstance(engine, EngineLanes) else [engine.runner]
    stats["kv_used"] = sum(runner.cache.used_slots for runner in runners)
    stats["kv_total"] = sum(runner.cache.num_slots for runner in runners)
    stats["prefill_batches"] = sum(runner.prefills.batches for runner in runners)
    stats["prefilled_sequences"] = sum(runner.prefills.sequences for runner in runners)
    stats["graph_pool_kept_blocks"] = sum(len(runner.graphs.kept_in_pool) for runner in runners)
    stats["load"] = stats["running"] + stats["waiting"]
    stats["refused"] = stage.refused  # type: ignore[attr-defined]
    return stats


def slot_kv_cache(cfg: Any, settings: EngineSettings, res: StageResources) -> SlotKVCache:
    """The KV slots of a decoder whose config (attributes or a dict) gives layers, KV heads and head width."""
    get = cfg.get if isinstance(cfg, dict) else lambda key, default=None: getattr(cfg, key, default)
    head_dim = get("head_dim", None) or get("hidden_size") // get("num_attention_heads")
    return SlotKVCache(
        get("num_hidden_layers"), settings.max_batch, settings.max_seq_len, get("num_key_value_heads"), head_dim,
        DTYPES[res.dtype], res.device,
    )


def _relay_timing(times: tuple[float, float, float] | None) -> dict[str, float | None]:
    """A `RelayMessage`'s queued / sent / arrived times as timing points (None where a transport stamped none)."""
    return {} if times is None else {point: t or None for point, t in zip(RELAY_POINTS, times)}


class CodecTalkerStage(StageBase):
    """A continuous-batching codec Talker replica: engine lanes stepping a family's `CodecTalkerRunner`; each frame
    goes to the request's vocoder replica. A family's stage builds its runners (`start_engines`) and turns its
    requests into sequences (`serve_sequence`)."""

    stage_name = "talker"

    def start_engines(self, settings: TalkerSettings, res: StageResources, kv_config: Any,
                      make_runner: Callable[[SlotKVCache, int], CodecTalkerRunner]) -> None:
        """One engine loop per lane, each with its own KV slots and runner (`make_runner(cache, max_batch)`),
        warmed up, then started."""
        self.settings = settings
        per_lane = -(-settings.max_batch // settings.lanes)
        lane_settings = settings.model_copy(update={"max_batch": per_lane})
        small_batch.set_weights_evict_first(settings.weights_evict_first)
        loops = []
        for lane in range(settings.lanes):  # one lane: the plain engine loop, on the default stream
            stream = torch.cuda.Stream(self.device) if settings.lanes > 1 and self.device.type == "cuda" else None
            if stream is not None:  # this lane reads relayed tensors on its own stream
                self.endpoint.reader_streams.append(stream)
            runner = make_runner(slot_kv_cache(kv_config, lane_settings, res), per_lane)
            with torch.cuda.stream(stream) if stream is not None else nullcontext(), self.startup_phase("warmup"):
                runner.warmup(per_lane)
            name = "talker" if settings.lanes == 1 else f"talker{lane}"
            loops.append(EngineLoop(runner, self._on_outputs, self._on_failure, per_lane, name, stream,
                                    settings.launches_ahead(res.device), settings.gil_switch_interval_ms / 1000,
                                    settings.admission_window(), settings.stall_timeout_s,
                                    lambda seq: self._budgets.get(seq.request_id, seq.max_frames)))
        self._budgets: dict[str, int] = {}  # each request's frame budget, the work admission counts
        self.refused = 0  # requests refused by expected queue wait
        self.engine = EngineLanes(loops)
        self.engine.start()
        self._sequences: dict[str, TalkerSequence] = {}
        self._frame_times: dict[str, list[float]] = {}  # when each request's first and latest frames were made (epoch s)

    def refuse_or_open(self, request_id: str) -> dict[str, Any] | None:
        """The refusal event when the expected queue wait is too long; else opens the request's stream (its
        vocoder replica is named once that stream is open too) and returns None."""
        try:
            refuse_if_queue_too_long(self, self.engine, self.settings.max_queue_wait_s)
        except CapacityError as refused:
            return refusal_event(refused)
        self.open_stream(request_id)
        self.expect_consumer(request_id)
        return None

    async def serve_sequence(self, seq: TalkerSequence, budget: int,
                             on_item: Callable[[RelayItem], None] | None = None) -> AsyncIterator[list[dict[str, Any]]]:
        """Admit an opened request's sequence (`budget`: the frames admission counts; `on_item`: what its relayed
        inputs do) and stream its events until it ends; an unfinished one is aborted."""
        rid = seq.request_id
        self._sequences[rid] = seq
        self._budgets[rid] = budget
        if on_item is not None:
            self.endpoint.claim(rid, on_item)
        self.engine.add(seq)
        finished = False
        try:
            yield [await self.ready_event()]
            async for batch in self.stream(rid):
                finished = batch[-1]["type"] in FINAL_TYPES
                yield batch
        finally:
            if on_item is not None:
                self.endpoint.release(rid)
            self._sequences.pop(rid, None)
            self._budgets.pop(rid, None)
            self._frame_times.pop(rid, None)
            if not finished or seq.finish_reason is None:
                self.engine.abort(rid)
                self.send_to_consumer(rid, "error", message="aborted")
            self.forget_consumer(rid, finished)

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _on_failure(self, request_id: str, error: Exception) -> None:
        self.fail(request_id, str(error))

    def _on_outputs(self, outputs: list[TalkerStepOutput]) -> None:
        now = time.time()  # before the frames leave: the vocoder's audio of them is made after it
        # Relay first: once the final event is out, the request's stream may close and forget its vocoder.
        self.relay_to_consumers([item for out in outputs for item in self._vocoder_items(out)])
        for out in outputs:
            if out.codes is not None:
                self._frame_times.setdefault(out.request_id, [now, now])[1] = now
            if out.finish_reason is not None:
                seq = self._sequences.get(out.request_id)
                first, last = self._frame_times.pop(out.request_id, (None, None))
                timing = {"first_frame": first, "last_frame": last}
                if seq is not None:
                    timing.update(talker_first_text=seq.first_text_received,
                                  first_frame_launched=seq.first_frame_launched, **_relay_timing(seq.first_text_relay),
                                  talker_text_end=seq.text_end_received, text_read=seq.text_read_launched)
                self.emit(out.request_id, {"type": "final", "finish_reason": out.finish_reason,
                                           "frames": seq.frames if seq is not None else 0, "timing": timing})

    def frame_for_vocoder(self, codes: list[int]) -> list[int]:
        """What of a step's frame the codec decodes: all its code groups (a family whose frame leads with a token the
        codec does not take drops it)."""
        return codes

    def _vocoder_items(self, out: TalkerStepOutput) -> list[RelayItem]:
        """The step's frame (`frame_for_vocoder`) and, when the request ended, the end marker."""
        if not self.has_consumer(out.request_id):
            return []
        items = []
        if out.codes is not None:
            frame = self.frame_for_vocoder(out.codes)
            items.append(RelayItem(out.request_id, tensors={"codes": torch.tensor(frame)[:, None]},
                                   meta={"clock": out.step}))
        if out.finish_reason is not None:
            items.append(RelayItem(out.request_id, kind="end", meta={"finish_reason": out.finish_reason}))
        return items

    def load_stats(self) -> dict[str, Any]:
        stats = engine_stats(self, self.engine)
        stats["early_prefills"] = sum(runner.early_prefills for runner in self.engine.runners)
        caches = [runner.prefix_cache for runner in self.engine.runners if runner.prefix_cache is not None]
        stats["prefix_cache_hits"] = sum(cache.hits for cache in caches)  # prompts prefilled from a cached prefix
        return stats


class StreamingVocoderStage(StageBase):
    """A streaming codec replica: decodes on the chunk schedule as frames arrive and streams float PCM. A family's
    stage hands `start_codec` its codec adapter (Code2Wav's, the 12 Hz tokenizer's decoder)."""

    stage_name = "vocoder"

    def start_codec(self, codec: Any, stage: VocoderStageConfig, references: bool = False) -> None:
        """Warm up every decode shape the chunk schedule makes (`references`: and those of streams that start with a
        cloned voice's reference codes), then batch the streams' decode calls."""
        streaming = stage.streaming
        if streaming.cudnn_autotune and self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # before the first decode: warm-up times each shape once
        self.schedule = ChunkSchedule(tuple(streaming.chunk_ramp), streaming.steady_chunk, streaming.left_context,
                                      streaming.aligned_chunks)
        self.graphs = codec.graphs
        if codec.stream is not None:  # relayed codes may be read on the vocoder's own stream
            self.endpoint.reader_streams.append(codec.stream)
        self.codec: BatchingCodec | BatchingStatefulCodec
        with self.startup_phase("warmup"):  # the graphs of every decode shape the chunk schedule makes
            if streaming.stateful:
                codec.warmup([], min(streaming.max_batch, 32), step_shapes(self.schedule, reference=references))
                primed_bytes = int(streaming.reference_cache_mb * 2**20) if references else 0
                self.codec = BatchingStatefulCodec(codec, streaming.max_batch, streaming.batch_gather_ms / 1000,
                                                   primed_bytes)
            else:
                codec.warmup(decode_window_lengths(self.schedule), min(streaming.max_batch, 32))
                self.codec = BatchingCodec(codec, streaming.max_batch, streaming.batch_gather_ms / 1000)
        # the decode thread lets the GIL go at each graph replay and wait for the device, as an engine thread does
        lower_gil_switch_interval(streaming.gil_switch_interval_ms / 1000)

    def load_stats(self) -> dict[str, Any]:
        """Plus the decode thread's cumulative work: over an interval, Δdecode_busy_s / seconds is how busy the
        vocoder kept its GPU share, Δdecode_frames / seconds its frame rate (left context included), and
        Δdecode_windows / Δdecode_calls the streams' chunks batched per decode call; with cloned voices, the primed
        states' hits, misses and bytes."""
        worker = self.codec.worker
        primed = getattr(self.codec, "primed_states", None)
        return {**super().load_stats(), "decode_busy_s": worker.busy_s, "decode_frames": worker.frames,
                "decode_calls": worker.batches, "decode_windows": worker.windows,
                "graph_pool_kept_blocks": len(self.graphs.kept_in_pool), **(primed.stats() if primed else {})}

    def open_decoder(self, context: torch.Tensor | None = None) -> StreamingDecoder | StatefulStreamingDecoder:
        """A stream's decoder; `context`: codes [G, T] decoded ahead of the stream's frames, whose audio is not
        streamed (a cloned voice's reference: the stream is then a decode of [reference + frames] from the first
        frame on)."""
        if isinstance(self.codec, BatchingStatefulCodec):
            return StatefulStreamingDecoder(self.codec, self.schedule, reference_codes=context)
        return StreamingDecoder(self.codec, self.schedule, reference_codes=context)

    async def decode(self, request_id: str, return_codes: bool = False,
                     context: torch.Tensor | None = None) -> AsyncIterator[list[dict[str, Any]]]:
        """Streams audio events, then a final event (with every frame's codes when `return_codes`). The caller tells
        the request's Talker replica to send its frames here (this stream's ready event names this replica).
        `context`: see `open_decoder`."""
        self.open_stream(request_id)
        received: list[torch.Tensor] = []
        inbox: asyncio.Queue[RelayItem] = asyncio.Queue()
        self.endpoint.claim(request_id, inbox.put_nowait)
        decoder: StreamingDecoder | StatefulStreamingDecoder | None = None
        submit = self.codec.worker.submit_nowait  # the streams' calls of one Talker step batch together
        try:
            decoder = self.open_decoder(context)
            yield [await self.ready_event()]
            while True:
                item = await inbox.get()
                if item.kind == "error":
                    yield [{"type": "error", "message": f"talker: {item.meta.get('message', 'failed')}"}]
                    return
                if item.tensors and return_codes:
                    received.append(item.tensors["codes"])
                chunks = []
                if item.tensors:  # with the Talker's step count: the clock aligned chunks end on
                    chunks = await decoder.push_async(item.tensors["codes"], item.meta.get("clock"), submit)
                if item.kind == "end":
                    last = await decoder.finish_async(submit)
                    chunks = [*chunks, *([last] if last is not None else [])]
                audio = [{"type": "audio", "pcm": chunk.float().cpu().numpy(), "sample_rate": self.codec.sample_rate,
                          "t": time.time()} for chunk in chunks]
                if item.kind != "end":
                    if audio:
                        yield audio
                    continue
                self.completed += 1
                yield [*audio, {
                    "type": "final",
                    "finish_reason": item.meta.get("finish_reason", "stop"),
                    "samples": decoder.samples_emitted,
                    "frames": decoder.frames_received,
                    # on the host: each message came on the host path or through CUDA IPC, by its size
                    "codes": torch.cat([codes.cpu() for codes in received], dim=1) if received else None,
                    "t": time.time(),
                }]
                return
        finally:
            if isinstance(decoder, StatefulStreamingDecoder):
                decoder.close()  # an aborted stream frees its state slot (waits for a step in flight)
            self.endpoint.release(request_id)
            self._streams.pop(request_id, None)
