"""The Python API: launches one Ray actor per stage and streams text + audio replies through them."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import ray

from omni_ray.config import PipelineConfig, StageConfig
from omni_ray.events import AudioChunk, Event, Finished, TextDelta
from omni_ray.models.qwen3_omni.model_files import resolve_model
from omni_ray.models.qwen3_omni.orchestrator import Orchestrator
from omni_ray.models.qwen3_omni.prompt import PromptBuilder
from omni_ray.models.qwen3_omni.stages import EncoderStage, TalkerStage, ThinkerStage, VocoderStage
from omni_ray.relay.auth import with_relay_env
from omni_ray.stages.client import ActorClient

__all__ = ["AudioChunk", "Event", "Finished", "Pipeline", "TextDelta"]

STAGE_CLASSES = {"encoder": EncoderStage, "thinker": ThinkerStage, "talker": TalkerStage, "vocoder": VocoderStage}


def _actor(cls: type, stage: StageConfig) -> Any:
    """The stage's actor class, with this process's relay secret (the caller's relay links need it too)."""
    options = with_relay_env(stage.resources.actor_options(), stage.relay_listen_host)
    return ray.remote(cls).options(**options, max_concurrency=1000)


class Pipeline:
    """One actor per stage. `generate` (chat) and `speak` (text to speech) yield TextDelta / AudioChunk
    events, then one Finished."""

    def __init__(self, config: PipelineConfig | None = None) -> None:
        self.config = config or PipelineConfig()
        files = resolve_model(self.config.model)
        self.checkpoint = str(files.tokenizer_dir)  # tokenizer, processor configs (and weights, unless random)
        self.model_config = files.config
        self.prompts = PromptBuilder(
            str(files.tokenizer_dir), self.model_config.thinker_config.audio_token_id, self.config.max_audio_seconds
        )
        self.tokenizer = self.prompts.tokenizer
        stages = self.config.stages
        self.actors = {
            name: _actor(cls, getattr(stages, name)).remote(self.config.model, getattr(stages, name), f"{name}-0")
            for name, cls in STAGE_CLASSES.items()
        }
        ray.get([actor.describe.remote() for actor in self.actors.values()])  # wait until every stage is loaded
        clients = {name: ActorClient(actor) for name, actor in self.actors.items()}
        self.orchestrator = Orchestrator(clients, self.prompts, self.config, self.model_config)

    def shutdown(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)

    async def stats(self) -> dict[str, Any]:
        names = ("thinker", "talker", "vocoder")
        values = await asyncio.gather(*(self.actors[n].stats.remote() for n in names))
        return dict(zip(names, values))

    def generate(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Event]:
        """See Orchestrator.generate for the arguments."""
        return self.orchestrator.generate(messages, **kwargs)

    def speak(self, text: str, **kwargs: Any) -> AsyncIterator[Event]:
        """See Orchestrator.speak for the arguments."""
        return self.orchestrator.speak(text, **kwargs)
