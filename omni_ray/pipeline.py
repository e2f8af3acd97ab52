"""The Python API: launches the four stage actors on Ray and streams text + audio for chat requests."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np
import ray
import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.config import PipelineConfig, StageConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError, StageError
from omni_ray.models.qwen3_omni.checkpoint import ensure_default_checkpoint, make_tiny_checkpoint
from omni_ray.models.qwen3_omni.prompt import PromptBuilder
from omni_ray.models.qwen3_omni.stages import (
    EncoderStage,
    TalkerRequest,
    TalkerStage,
    ThinkerRequest,
    ThinkerStage,
    VocoderStage,
)

SAMPLE_RATE = 24000
# Talker defaults of the released model (transformers' generate()).
DEFAULT_TALKER_SAMPLING = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05)


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    t: float


@dataclass
class AudioChunk:
    pcm: np.ndarray  # float32 mono at `sample_rate`
    sample_rate: int
    t: float


@dataclass
class Finished:
    finish_reason: str
    usage: dict[str, int]
    audio_finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    t: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)  # submitted, first/last token, first audio (epoch s)
    codes: "torch.Tensor | None" = None  # [num_code_groups, frames] when asked for with return_codes


Event = TextDelta | AudioChunk | Finished


def resolve_checkpoint(config: PipelineConfig) -> Path:
    if config.model.path is not None:
        return Path(config.model.path)
    if config.model.tiny_seed == 0:
        return ensure_default_checkpoint()
    from omni_ray.models.qwen3_omni.checkpoint import default_checkpoint_dir

    path = default_checkpoint_dir().with_name(f"qwen3-omni-tiny-seed{config.model.tiny_seed}")
    return path if path.exists() else make_tiny_checkpoint(path, config.model.tiny_seed)


def _actor(cls: type, stage: StageConfig) -> Any:
    res = stage.resources
    return ray.remote(cls).options(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_concurrency=1000)


class Pipeline:
    """Owns one replica of each stage. `generate` yields TextDelta / AudioChunk events, then one Finished."""

    def __init__(self, config: PipelineConfig | None = None) -> None:
        self.config = config or PipelineConfig()
        self.checkpoint = str(resolve_checkpoint(self.config))
        self.model_config = Qwen3OmniMoeConfig.from_pretrained(self.checkpoint)
        self.prompts = PromptBuilder(
            self.checkpoint, self.model_config.thinker_config.audio_token_id, self.config.max_audio_seconds
        )
        self.tokenizer = self.prompts.tokenizer
        stages = self.config.stages
        ck = self.checkpoint
        self.encoder = _actor(EncoderStage, stages.encoder).remote(ck, stages.encoder.resources, "encoder-0")
        self.thinker = _actor(ThinkerStage, stages.thinker).remote(
            ck, stages.thinker.resources, stages.thinker.engine, "thinker-0"
        )
        self.talker = _actor(TalkerStage, stages.talker).remote(ck, stages.talker.resources, stages.talker.engine, "talker-0")
        self.vocoder = _actor(VocoderStage, stages.vocoder).remote(
            ck, stages.vocoder.resources, stages.vocoder.streaming, "vocoder-0"
        )
        infos = ray.get([a.describe.remote() for a in (self.encoder, self.thinker, self.talker, self.vocoder)])
        self.peers = {info["stage"]: info["peer"] for info in infos}
        self.stop_ids = [self.model_config.im_end_token_id, self.tokenizer.convert_tokens_to_ids("<|endoftext|>")]

    def shutdown(self) -> None:
        for actor in (self.encoder, self.thinker, self.talker, self.vocoder):
            ray.kill(actor)

    async def stats(self) -> dict[str, Any]:
        names = ("thinker", "talker", "vocoder")
        values = await asyncio.gather(*(getattr(self, n).stats.remote() for n in names))
        return dict(zip(names, values))

    async def generate(
        self,
        messages: list[dict[str, Any]],
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int = 256,
        audio: bool = True,
        speaker: str | None = None,
        talker_sampling: SamplingParams | None = None,
        max_audio_frames: int | None = None,
        stop_token_ids: list[int] | None = None,
        request_id: str | None = None,
        return_codes: bool = False,
    ) -> AsyncIterator[Event]:
        timing = {"submitted": time.time()}
        prompt = self.prompts.build(messages)
        speaker = self._check_request(len(prompt.ids), max_tokens, audio, speaker, max_audio_frames)
        rid = request_id or uuid.uuid4().hex
        sampling = sampling or SamplingParams()
        thinker_req = ThinkerRequest(
            rid, prompt.ids, sampling, max_tokens, stop_token_ids or self.stop_ids,
            expects_audio=bool(prompt.clips), talker=self.peers["talker"] if audio else None,
        )
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        streams = {"thinker": self.thinker.generate.options(num_returns="streaming").remote(thinker_req)}
        if audio:
            talker_req = TalkerRequest(
                rid, talker_sampling or DEFAULT_TALKER_SAMPLING, speaker,
                self.peers["vocoder"], max_audio_frames,
            )
            streams["talker"] = self.talker.speak.options(num_returns="streaming").remote(talker_req)
            streams["vocoder"] = self.vocoder.decode.options(num_returns="streaming").remote(rid, return_codes)
        encode = self.encoder.encode.remote(rid, prompt.clips, self.peers["thinker"]) if prompt.clips else None
        tasks = [asyncio.ensure_future(self._pump(name, gen, events)) for name, gen in streams.items()]
        done: dict[str, dict[str, Any]] = {}
        token_ids: list[int] = []
        emitted_text = ""
        try:
            while len(done) < len(streams):
                name, event = await events.get()
                if event["type"] == "error":
                    raise StageError(f"{name}: {event['message']}")
                if event["type"] == "final":
                    done[name] = event
                    continue
                if event["type"] == "token":
                    timing.setdefault("first_token", event["t"])
                    timing["last_token"] = event["t"]
                    token_ids.append(event["token"])
                    text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
                    if len(text) > len(emitted_text) and not text.endswith("\ufffd"):
                        delta, emitted_text = text[len(emitted_text) :], text
                        yield TextDelta(delta, [event["token"]], event["t"])
                elif event["type"] == "audio":
                    timing.setdefault("first_audio", event["t"])
                    yield AudioChunk(event["pcm"], event["sample_rate"], event["t"])
            if encode is not None:
                await encode
            thinker_final = done["thinker"]
            usage = {"prompt_tokens": len(prompt.ids), "completion_tokens": len(token_ids)}
            if "talker" in done:
                usage["audio_frames"] = int(done["talker"].get("frames", 0))
            yield Finished(
                thinker_final["finish_reason"], usage,
                done["talker"]["finish_reason"] if "talker" in done else None, token_ids, time.time(),
                timing, done.get("vocoder", {}).get("codes"),
            )
        finally:
            for task in tasks:
                task.cancel()
            if len(done) < len(streams):
                await self._abort(rid, streams)

    def _check_request(
        self, prompt_len: int, max_tokens: int, audio: bool, speaker: str | None, max_audio_frames: int | None
    ) -> str:
        """Client errors are caught here, before any stage sees the request."""
        if max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1")
        limit = self.config.stages.thinker.engine.max_seq_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context of {limit} tokens"
            )
        voice = (speaker or self.config.default_speaker).lower()
        if audio and voice not in self.model_config.talker_config.speaker_id:
            known = ", ".join(sorted(self.model_config.talker_config.speaker_id))
            raise InvalidRequestError(f"unknown voice '{speaker}'; available: {known}")
        if max_audio_frames is not None and max_audio_frames < 1:
            raise InvalidRequestError("max_audio_frames must be at least 1")
        return voice

    async def _abort(self, rid: str, streams: dict[str, Any]) -> None:
        for gen in streams.values():
            ray.cancel(gen)
        await asyncio.gather(self.thinker.abort.remote(rid), self.talker.abort.remote(rid), return_exceptions=True)

    @staticmethod
    async def _pump(name: str, gen: Any, events: asyncio.Queue[tuple[str, Any]]) -> None:
        try:
            async for ref in gen:
                events.put_nowait((name, await ref))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a stage raised: surface it as that stream's error
            events.put_nowait((name, {"type": "error", "message": str(exc)}))
