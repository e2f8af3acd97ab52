"""Qwen3-TTS's three stage replicas (reference encoding, Talker + code predictor, 12 Hz codec decoder) on the shared
stage plumbing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from omni_ray.config import ModelSource, StageConfig, TalkerStageConfig, VocoderStageConfig
from omni_ray.engine.codec_talker import talker_options
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_tts.codec_decoder import CodecDecoderConfig, load_codec_decoder, make_codec
from omni_ray.models.qwen3_tts.model_files import resolve_model
from omni_ray.models.qwen3_tts.prompt import TalkerPrompt
from omni_ray.models.qwen3_tts.reference_encoder import ReferenceEncoder
from omni_ray.models.qwen3_tts.talker import TTSTalkerRunner, frame_cap, speech_sequence
from omni_ray.models.qwen3_tts.talker_model import load_talker
from omni_ray.stages.base import StageBase
from omni_ray.stages.codec_stages import DTYPES, CodecTalkerStage, StreamingVocoderStage


@dataclass
class SpeechTalkerRequest:
    """One reply for the Talker: its built prompt, sampling and frame cap."""

    request_id: str
    prompt: TalkerPrompt
    sampling: SamplingParams
    code_sampling: SamplingParams
    max_frames: int | None = None
    ignore_eos: bool = False


class ReferenceStage(StageBase):
    """Reference audio → the speaker encoder's x-vector and the speech tokenizer's codes (Base models only)."""

    stage_name = "reference"

    def __init__(self, model: ModelSource, stage: StageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res = stage.resources
        self.encoder: ReferenceEncoder | None = None
        if files.config.variant == "base":  # the other variants have no speaker encoder: this replica idles
            with self.startup_phase("load"):
                self.encoder = (
                    ReferenceEncoder.from_checkpoint(files.weights, res.device, DTYPES[res.dtype]) if files.weights
                    else ReferenceEncoder.random(files.config.speaker_encoder, files.speech_tokenizer, res.device,
                                                 DTYPES[res.dtype]))
        self.startup_done(stage.resources)

    async def encode(self, audio: np.ndarray, sample_rate: int, x_vector_only: bool) -> dict[str, Any]:
        """{x_vector: [d] float32, codes: [T, G] int64 or None, seconds} on the host. Unusable audio raises
        `ReferenceAudioError` (a client error)."""
        if self.encoder is None:
            raise RuntimeError("this model has no speaker encoder: only Base models clone voices")
        encoded = await self.run_off_loop(self.encoder.encode, audio, sample_rate, x_vector_only)
        codes = None if encoded.codes is None else encoded.codes.cpu()
        return {"x_vector": encoded.x_vector.float().cpu(), "codes": codes, "seconds": encoded.seconds}

    def load_stats(self) -> dict[str, Any]:
        return {**super().load_stats(), "streams": self.off_loop, "load": self.off_loop}


class TalkerStage(CodecTalkerStage):
    """Continuous-batching Talker + code predictor; each request's prompt is whole on arrival, its frames go to the
    vocoder replica the caller names."""

    def __init__(self, model: ModelSource, stage: TalkerStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res, engine = stage.resources, stage.engine
        with self.startup_phase("load"):
            assets = load_talker(files.weights, files.config, res.device, DTYPES[res.dtype])
        self.assets = assets
        self.start_engines(engine, res, files.config.talker,
                           lambda cache, rows: TTSTalkerRunner(assets, cache, rows, **talker_options(engine)))
        self.startup_done(stage.resources)

    async def speak(self, request: SpeechTalkerRequest) -> AsyncIterator[list[dict[str, Any]]]:
        refused = self.refuse_or_open(request.request_id)
        if refused is not None:
            yield [refused]
            return
        cap = frame_cap(self.settings, request.prompt, request.max_frames)
        seq = speech_sequence(request.request_id, request.prompt, self.assets.model, cap, request.sampling,
                              request.code_sampling, request.ignore_eos)
        async for batch in self.serve_sequence(seq, cap):
            yield batch


class VocoderStage(StreamingVocoderStage):
    """The 12 Hz speech tokenizer's decoder, streaming: decodes on the chunk schedule as frames arrive."""

    def __init__(self, model: ModelSource, stage: VocoderStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res, streaming = stage.resources, stage.streaming
        with self.startup_phase("load"):
            decoder_config = None if files.weights else CodecDecoderConfig.from_dict(files.speech_tokenizer["decoder_config"])
            module = load_codec_decoder(files.weights, res.device, DTYPES[res.dtype], decoder_config)
        self.start_codec(make_codec(module, cuda_graphs=streaming.cuda_graphs,
                                    max_streams=streaming.max_streams if streaming.stateful else 0), stage,
                         references=files.config.variant == "base")
        self.startup_done(stage.resources)


STAGE_CLASSES: dict[str, type] = {"reference": ReferenceStage, "talker": TalkerStage, "vocoder": VocoderStage}
