"""Qwen3-Omni's four stage replicas (encoder, Thinker, Talker+MTP, vocoder) wired on the shared stage plumbing."""

from __future__ import annotations

import asyncio
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
import torch

from omni_ray.audio import AudioFeatureExtractor
from omni_ray.config import (
    EngineSettings,
    ModelSource,
    StageConfig,
    StageResources,
    TalkerStageConfig,
    ThinkerStageConfig,
    VocoderStageConfig,
)
from omni_ray.engine.codec_talker import talker_options
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.lanes import EngineLanes
from omni_ray.engine.loop import EngineLoop, lower_gil_switch_interval
from omni_ray.engine.sampler import SamplingParams
from omni_ray.layers import small_batch
from omni_ray.models.qwen3_omni.model_files import resolve_model
from omni_ray.models.qwen3_omni.speech_budget import frame_budget
from omni_ray.models.qwen3_omni.codecs import encode_audio_features, load_audio_encoder, load_code2wav
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence, TalkerStepOutput
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, ThinkerStepOutput, load_thinker
from omni_ray.relay import RelayItem, RelayPeer
from omni_ray.errors import CapacityError
from omni_ray.stages.admission import refusal_event, refuse_if_queue_too_long
from omni_ray.stages.base import FINAL_TYPES, StageBase
from omni_ray.vocoder import ChunkSchedule, StatefulStreamingDecoder, StreamingDecoder, decode_window_lengths, step_shapes
from omni_ray.vocoder.batching import BatchingCodec, BatchingStatefulCodec
from omni_ray.vocoder.code2wav import Code2WavCodec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ThinkerRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: list[int]
    expects_audio: bool = False
    speaks: bool = False  # a Talker replica will be named (relay) to receive the Talker-bound states
    forced_ids: list[int] | None = None  # teacher-forced reply (speech): emitted instead of sampled
    ignore_eos: bool = False


@dataclass
class TalkerRequest:
    request_id: str
    sampling: SamplingParams
    speaker: str
    max_frames: int | None = None
    ignore_eos: bool = False
    prompt_ids: list[int] | None = None  # a text-only prompt's ids: the Talker can prefill before the first token
    max_text_tokens: int | None = None  # the reply's token cap: sizes the frame budget that admission counts



def _engine_stats(stage: StageBase, engine: EngineLoop[Any, Any] | EngineLanes[Any, Any]) -> dict[str, Any]:
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


# the points of the first reply token's way from the Thinker to the Talker that its relay message stamps
RELAY_POINTS = ("first_text_queued", "first_text_sent", "first_text_arrived")


def _relay_timing(times: tuple[float, float, float] | None) -> dict[str, float | None]:
    """A `RelayMessage`'s queued / sent / arrived times as timing points (None where a transport stamped none)."""
    return {} if times is None else {point: t or None for point, t in zip(RELAY_POINTS, times)}


def _kv_cache(cfg: Any, settings: EngineSettings, res: StageResources) -> SlotKVCache:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return SlotKVCache(
        cfg.num_hidden_layers, settings.max_batch, settings.max_seq_len, cfg.num_key_value_heads, head_dim,
        DTYPES[res.dtype], res.device,
    )


class EncoderStage(StageBase):
    """Input audio (16 kHz mono) → 128-bin features → AuT embeddings, relayed to the Thinker replica."""

    stage_name = "encoder"

    def __init__(self, model: ModelSource, stage: StageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        config = files.config
        res = stage.resources
        self.features = AudioFeatureExtractor(str(files.tokenizer_dir))
        with self.startup_phase("load"):
            self.encoder = load_audio_encoder(files.weights, config, res.device, DTYPES[res.dtype])
        self._encoding = 0
        self.startup_done(stage.resources)

    async def encode(self, request_id: str, clips: list[np.ndarray], thinker: RelayPeer) -> int:
        """Encodes every clip of a request and relays one tensor [tokens, hidden]; returns the token count."""
        self._encoding += 1
        try:
            embeds = await asyncio.to_thread(self._encode, clips)
        except Exception as exc:
            self.send_end(thinker, request_id, kind="error", message=f"audio encoding failed: {exc}")
            self.failed += 1
            raise
        finally:
            self._encoding -= 1
        self.completed += 1
        self.sender.send(thinker, [RelayItem(request_id, tensors={"audio_embeds": embeds.float().cpu()})])
        self.sender.forget(request_id)  # one item per request: no sequence state to keep
        return int(embeds.shape[0])

    def load_stats(self) -> dict[str, Any]:
        return {**super().load_stats(), "streams": self._encoding, "load": self._encoding}

    def _encode(self, clips: list[np.ndarray]) -> torch.Tensor:
        return encode_audio_features(self.encoder, [self.features(clip)[0] for clip in clips])


class ThinkerStage(StageBase):
    """Continuous-batching Thinker. Streams tokens to its caller and Talker-bound states to the Talker replica."""

    stage_name = "thinker"

    def __init__(self, model: ModelSource, stage: ThinkerStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        config = files.config
        res, engine = stage.resources, stage.engine
        with self.startup_phase("load"):
            thinker = load_thinker(files.weights, config, res.device, DTYPES[res.dtype])
            cache = _kv_cache(config.thinker_config.text_config, engine, res)
        with self.startup_phase("warmup"):
            small_batch.set_weights_evict_first(engine.weights_evict_first)
            runner = ThinkerRunner(thinker, config, cache, engine.cuda_graphs, engine.max_prefill_tokens,
                                   engine.compile_layers, engine.moe_kernels, engine.prefill_graph_tokens,
                                   moe_layer_kernels=engine.moe_layer_kernels,
                                   early_first_tokens=engine.early_first_tokens,
                                   moe_layer_folds=engine.moe_layer_folds,
                                   split_large_prefills=engine.split_large_prefills)
            runner.warmup(engine.max_batch)
        self.engine = EngineLoop(runner, self._on_outputs, self._on_failure, engine.max_batch, "thinker",
                                 launch_ahead=engine.launches_ahead(res.device),
                                 gil_switch_interval_s=engine.gil_switch_interval_ms / 1000,
                                 admission=engine.admission_window(), stall_timeout_s=engine.stall_timeout_s,
                                 work_of=lambda seq: seq.max_tokens)
        self.max_queue_wait_s = engine.max_queue_wait_s
        self.refused = 0  # requests refused by expected queue wait
        self.engine.start()
        self.startup_done(stage.resources)

    async def generate(self, request: ThinkerRequest) -> AsyncIterator[list[dict[str, Any]]]:
        rid = request.request_id
        try:  # before the ready event: the caller hears it at once
            refuse_if_queue_too_long(self, self.engine, self.max_queue_wait_s)
        except CapacityError as refused:
            yield [refusal_event(refused)]
            return
        self.open_stream(rid)
        if request.speaks:
            self.expect_consumer(rid)  # the Talker is opened after this replica starts
        finished = False
        try:
            yield [await self.ready_event()]
            audio = await self._await_audio(rid) if request.expects_audio else None
            self.engine.add(
                ThinkerSequence(
                    rid, list(request.prompt_ids), request.sampling, request.max_tokens, frozenset(request.stop_ids),
                    audio_embeds=audio, for_talker=request.speaks, forced_ids=request.forced_ids,
                    ignore_eos=request.ignore_eos,
                )
            )
            async for batch in self.stream(rid):
                finished = batch[-1]["type"] in FINAL_TYPES
                yield batch
        finally:
            self.endpoint.release(rid)
            if not finished:
                self.engine.abort(rid)
                self.send_to_consumer(rid, "error", message="aborted")
            self.forget_consumer(rid, finished)

    async def _await_audio(self, rid: str) -> torch.Tensor:
        arrived: asyncio.Future[RelayItem] = asyncio.get_running_loop().create_future()
        self.endpoint.claim(rid, lambda item: arrived.done() or arrived.set_result(item))
        item = await arrived
        if item.kind != "data":
            raise RuntimeError(item.meta.get("message", "audio encoder failed"))
        return item.tensors["audio_embeds"]

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _on_failure(self, request_id: str, error: Exception) -> None:
        self.fail(request_id, str(error))
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(
                lambda: self.send_to_consumer(request_id, "error", message=str(error))
            )

    def _on_outputs(self, outputs: list[ThinkerStepOutput]) -> None:
        # Relay first: once the final event is out, the request's stream may close and forget its Talker.
        self.relay_to_consumers([item for out in outputs for item in self._talker_items(out)])
        events: list[tuple[str, dict[str, Any]]] = []
        for out in outputs:
            token = {"type": "token", "token": out.token}
            if out.prefill_launched is not None:  # a reply's first token
                token["prefill_launched"] = out.prefill_launched
            events.append((out.request_id, token))
            if out.finish_reason is not None:
                events.append((out.request_id, {"type": "final", "finish_reason": out.finish_reason}))
        self.emit_all(events)

    def _talker_items(self, out: ThinkerStepOutput) -> list[RelayItem]:
        """What the Talker consumes from this step: prefill states, the new token's embedding, the end."""
        if not self.has_consumer(out.request_id):
            return []
        items = []
        if out.talker_prefix is not None:
            items.append(RelayItem(out.request_id, tensors=out.talker_prefix))
        if out.talker_embed is not None:
            items.append(RelayItem(out.request_id, tensors={"text_embed": out.talker_embed}))
        if out.finish_reason is not None:
            items.append(RelayItem(out.request_id, kind="end"))
        return items

    def load_stats(self) -> dict[str, Any]:
        return _engine_stats(self, self.engine)


class TalkerStage(StageBase):
    """Continuous-batching Talker + MTP. Admits a request on the Thinker's first relay chunk; frames go to the vocoder."""

    stage_name = "talker"

    def __init__(self, model: ModelSource, stage: TalkerStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        self.config = files.config
        res, engine = stage.resources, stage.engine
        self.settings = engine
        with self.startup_phase("load"):
            assets = load_talker(files.weights, self.config, res.device, DTYPES[res.dtype], engine.early_prefill)
        self.assets = assets
        per_lane = -(-engine.max_batch // engine.lanes)
        lane_settings = engine.model_copy(update={"max_batch": per_lane})
        small_batch.set_weights_evict_first(engine.weights_evict_first)
        loops = []
        for lane in range(engine.lanes):  # one lane: the plain engine loop, on the default stream
            stream = torch.cuda.Stream(self.device) if engine.lanes > 1 and self.device.type == "cuda" else None
            if stream is not None:  # this lane reads the Thinker's relayed tensors on its own stream
                self.endpoint.reader_streams.append(stream)
            cache = _kv_cache(self.config.talker_config.text_config, lane_settings, res)
            runner = TalkerRunner(assets, self.config, cache, per_lane, **talker_options(engine))
            with torch.cuda.stream(stream) if stream is not None else nullcontext(), self.startup_phase("warmup"):
                runner.warmup(per_lane)
            name = "talker" if engine.lanes == 1 else f"talker{lane}"
            loops.append(EngineLoop(runner, self._on_outputs, self._on_failure, per_lane, name, stream,
                                    engine.launches_ahead(res.device), engine.gil_switch_interval_ms / 1000,
                                    engine.admission_window(), engine.stall_timeout_s,
                                    lambda seq: self._budgets.get(seq.request_id, seq.max_frames)))
        self._budgets: dict[str, int] = {}  # each request's frame budget, the work admission counts
        self.refused = 0  # requests refused by expected queue wait
        self.engine = EngineLanes(loops)
        self.engine.start()
        self._sequences: dict[str, TalkerSequence] = {}
        self._frame_times: dict[str, list[float]] = {}  # when each request's first and latest frames were made (epoch s)
        self.startup_done(stage.resources)

    async def speak(self, request: TalkerRequest) -> AsyncIterator[list[dict[str, Any]]]:
        rid = request.request_id
        speaker_id = self.config.talker_config.speaker_id.get(request.speaker.lower())
        if speaker_id is None:
            raise ValueError(f"unknown voice '{request.speaker}'")
        try:
            refuse_if_queue_too_long(self, self.engine, self.settings.max_queue_wait_s)
        except CapacityError as refused:
            yield [refusal_event(refused)]
            return
        self.open_stream(rid)
        self.expect_consumer(rid)  # the caller names this request's vocoder replica once its stream is open too
        cap = min(request.max_frames or self.settings.max_frames, self.settings.max_frames)
        seq = TalkerSequence(
            rid, request.sampling, int(speaker_id), cap,
            frames_per_text_token=0.0 if request.max_frames else self.settings.frames_per_text_token,
            frame_budget_base=self.settings.frame_budget_base, ignore_eos=request.ignore_eos,
        )
        if request.prompt_ids is not None and self.assets.thinker_embeddings is not None:
            try:  # early prefill: the prefix the Thinker would relay, made here from the ids
                seq.prefix, seq.early = self.assets.prompt_prefix(request.prompt_ids, self.config), True
            except ValueError:  # not a prompt the Talker can read: the Thinker reports it
                pass
        self._sequences[rid] = seq
        self._budgets[rid] = frame_budget(self.settings, request.max_frames, request.max_text_tokens)
        self.endpoint.claim(rid, lambda item: self._on_thinker_item(seq, item))
        self.engine.add(seq)
        finished = False
        try:
            yield [await self.ready_event()]
            async for batch in self.stream(rid):
                finished = batch[-1]["type"] in FINAL_TYPES
                yield batch
        finally:
            self.endpoint.release(rid)
            self._sequences.pop(rid, None)
            self._budgets.pop(rid, None)
            self._frame_times.pop(rid, None)
            if not finished or seq.finish_reason is None:
                self.engine.abort(rid)
                self.send_to_consumer(rid, "error", message="aborted")
            self.forget_consumer(rid, finished)

    def _on_thinker_item(self, seq: TalkerSequence, item: RelayItem) -> None:
        if seq.first_text_relay is None and "relay_times" in item.meta:
            seq.first_text_relay = item.meta["relay_times"]
        if item.kind == "error":
            self.engine.abort(seq.request_id)
            self.fail(seq.request_id, f"thinker: {item.meta.get('message', 'failed')}")
            return
        if "user_states" in item.tensors:
            seq.prefix = item.tensors
        if "text_embed" in item.tensors:
            seq.add_text(item.tensors["text_embed"])
        if item.kind == "end":
            seq.end_text()
        self.engine.notify()

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

    def _vocoder_items(self, out: TalkerStepOutput) -> list[RelayItem]:
        """The step's frame (all code groups) and, when the request ended, the end marker."""
        if not self.has_consumer(out.request_id):
            return []
        items = []
        if out.codes is not None:
            items.append(RelayItem(out.request_id, tensors={"codes": torch.tensor(out.codes)[:, None]},
                                   meta={"clock": out.step}))
        if out.finish_reason is not None:
            items.append(RelayItem(out.request_id, kind="end", meta={"finish_reason": out.finish_reason}))
        return items

    def load_stats(self) -> dict[str, Any]:
        stats = _engine_stats(self, self.engine)
        stats["early_prefills"] = sum(runner.early_prefills for runner in self.engine.runners)
        return stats


class VocoderStage(StageBase):
    """Streaming Code2Wav: decodes on the chunk schedule as frames arrive and streams 24 kHz float PCM."""

    stage_name = "vocoder"

    def __init__(self, model: ModelSource, stage: VocoderStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        config = files.config
        res, streaming = stage.resources, stage.streaming
        with self.startup_phase("load"):
            module = load_code2wav(files.weights, config, res.device, DTYPES[res.dtype])
        if streaming.cudnn_autotune and self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # before the first decode: warm-up times each shape once
        self.schedule = ChunkSchedule(tuple(streaming.chunk_ramp), streaming.steady_chunk, streaming.left_context,
                                      streaming.aligned_chunks)
        codec = Code2WavCodec(module, cuda_graphs=streaming.cuda_graphs,
                              max_streams=streaming.max_streams if streaming.stateful else 0)
        self.graphs = codec.graphs
        if codec.stream is not None:  # relayed codes may be read on the vocoder's own stream
            self.endpoint.reader_streams.append(codec.stream)
        self.codec: BatchingCodec | BatchingStatefulCodec
        with self.startup_phase("warmup"):  # the graphs of every decode shape the chunk schedule makes
            if streaming.stateful:
                codec.warmup([], min(streaming.max_batch, 32), step_shapes(self.schedule))
                self.codec = BatchingStatefulCodec(codec, streaming.max_batch, streaming.batch_gather_ms / 1000)
            else:
                codec.warmup(decode_window_lengths(self.schedule), min(streaming.max_batch, 32))
                self.codec = BatchingCodec(codec, streaming.max_batch, streaming.batch_gather_ms / 1000)
        # the decode thread lets the GIL go at each graph replay and wait for the device, as an engine thread does
        lower_gil_switch_interval(streaming.gil_switch_interval_ms / 1000)
        self.startup_done(stage.resources)

    def load_stats(self) -> dict[str, Any]:
        """Plus the decode thread's cumulative work: over an interval, Δdecode_busy_s / seconds is how busy the
        vocoder kept its GPU share, Δdecode_frames / seconds its frame rate (left context included), and
        Δdecode_windows / Δdecode_calls the streams' chunks batched per decode call."""
        worker = self.codec.worker
        return {**super().load_stats(), "decode_busy_s": worker.busy_s, "decode_frames": worker.frames,
                "decode_calls": worker.batches, "decode_windows": worker.windows,
                "graph_pool_kept_blocks": len(self.graphs.kept_in_pool)}

    async def decode(self, request_id: str, return_codes: bool = False) -> AsyncIterator[list[dict[str, Any]]]:
        """Streams audio events, then a final event (with every frame's codes when `return_codes`). The caller tells
        the request's Talker replica to send its frames here (this stream's ready event names this replica)."""
        self.open_stream(request_id)
        received: list[torch.Tensor] = []
        inbox: asyncio.Queue[RelayItem] = asyncio.Queue()
        self.endpoint.claim(request_id, inbox.put_nowait)
        decoder: StreamingDecoder | StatefulStreamingDecoder | None = None
        submit = self.codec.worker.submit_nowait  # the streams' calls of one Talker step batch together
        try:
            decoder = (StatefulStreamingDecoder(self.codec, self.schedule) if isinstance(self.codec, BatchingStatefulCodec)
                       else StreamingDecoder(self.codec, self.schedule))
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

