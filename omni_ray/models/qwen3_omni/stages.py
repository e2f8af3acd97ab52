"""Qwen3-Omni's four stage replicas (encoder, Thinker, Talker+MTP, vocoder) wired on the shared stage plumbing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
import torch

from omni_ray.audio import AudioFeatureExtractor
from omni_ray.config import ModelSource, StageConfig, TalkerStageConfig, ThinkerStageConfig, VocoderStageConfig
from omni_ray.engine.codec_talker import talker_options
from omni_ray.engine.loop import EngineLoop
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import CapacityError
from omni_ray.layers import small_batch
from omni_ray.models.qwen3_omni.codecs import encode_audio_features, load_audio_encoder, load_code2wav
from omni_ray.models.qwen3_omni.model_files import resolve_model
from omni_ray.models.qwen3_omni.speech_budget import frame_budget
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, ThinkerStepOutput, load_thinker
from omni_ray.relay import RelayItem, RelayPeer
from omni_ray.stages.admission import refusal_event, refuse_if_queue_too_long
from omni_ray.stages.base import FINAL_TYPES, StageBase
from omni_ray.stages.codec_stages import (
    DTYPES, CodecTalkerStage, StreamingVocoderStage, engine_stats, slot_kv_cache,
)
from omni_ray.vocoder.code2wav import Code2WavCodec


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
        self.startup_done(stage.resources)

    async def encode(self, request_id: str, clips: list[np.ndarray], thinker: RelayPeer) -> int:
        """Encodes every clip of a request and relays one tensor [tokens, hidden]; returns the token count."""
        try:
            embeds = await self.run_off_loop(self._encode, clips)
        except Exception as exc:
            self.send_end(thinker, request_id, kind="error", message=f"audio encoding failed: {exc}")
            raise
        self.sender.send(thinker, [RelayItem(request_id, tensors={"audio_embeds": embeds.float().cpu()})])
        self.sender.forget(request_id)  # one item per request: no sequence state to keep
        return int(embeds.shape[0])

    def load_stats(self) -> dict[str, Any]:
        return {**super().load_stats(), "streams": self.off_loop, "load": self.off_loop}

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
            cache = slot_kv_cache(config.thinker_config.text_config, engine, res)
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
        return engine_stats(self, self.engine)


class TalkerStage(CodecTalkerStage):
    """Continuous-batching Talker + MTP. Admits a request on the Thinker's first relay chunk; frames go to the vocoder."""

    def __init__(self, model: ModelSource, stage: TalkerStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        self.config = files.config
        res, engine = stage.resources, stage.engine
        with self.startup_phase("load"):
            assets = load_talker(files.weights, self.config, res.device, DTYPES[res.dtype], engine.early_prefill)
        self.assets = assets
        self.start_engines(engine, res, self.config.talker_config.text_config,
                           lambda cache, rows: TalkerRunner(assets, self.config, cache, rows, **talker_options(engine)))
        self.startup_done(stage.resources)

    async def speak(self, request: TalkerRequest) -> AsyncIterator[list[dict[str, Any]]]:
        rid = request.request_id
        speaker_id = self.config.talker_config.speaker_id.get(request.speaker.lower())
        if speaker_id is None:
            raise ValueError(f"unknown voice '{request.speaker}'")
        refused = self.refuse_or_open(rid)
        if refused is not None:
            yield [refused]
            return
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
        budget = frame_budget(self.settings, request.max_frames, request.max_text_tokens)
        async for batch in self.serve_sequence(seq, budget, lambda item: self._on_thinker_item(seq, item)):
            yield batch

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


class VocoderStage(StreamingVocoderStage):
    """Streaming Code2Wav: decodes on the chunk schedule as frames arrive and streams 24 kHz float PCM."""

    def __init__(self, model: ModelSource, stage: VocoderStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res, streaming = stage.resources, stage.streaming
        with self.startup_phase("load"):
            module = load_code2wav(files.weights, files.config, res.device, DTYPES[res.dtype])
        self.start_codec(Code2WavCodec(module, cuda_graphs=streaming.cuda_graphs,
                                       max_streams=streaming.max_streams if streaming.stateful else 0), stage)
        self.startup_done(stage.resources)


STAGE_CLASSES: dict[str, type] = {"encoder": EncoderStage, "thinker": ThinkerStage, "talker": TalkerStage,
                                  "vocoder": VocoderStage}
