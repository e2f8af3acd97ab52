"""The Python API: launches one Ray actor per stage of a model family and streams its replies through them."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import ray

from omni_ray.config import PipelineConfig, StageConfig
from omni_ray.events import AudioChunk, Event, Finished, TextDelta
from omni_ray.models import load_family
from omni_ray.relay.auth import with_relay_env
from omni_ray.stages.client import ActorClient

__all__ = ["AudioChunk", "Event", "Finished", "Pipeline", "TextDelta"]


def _actor(cls: type, stage: StageConfig) -> Any:
    """The stage's actor class, with this process's relay secret (the caller's relay links need it too)."""
    options = with_relay_env(stage.resources.actor_options(), stage.relay_listen_host)
    return ray.remote(cls).options(**options, max_concurrency=1000)


class Pipeline:
    """One actor per stage of the configured family (`model.family`). Qwen3-Omni: `generate` (chat) and `speak` (text
    to speech through the Thinker); Qwen3-TTS: `speak`. Each yields TextDelta / AudioChunk events, then one
    Finished."""

    def __init__(self, config: PipelineConfig | None = None) -> None:
        self.config = config or PipelineConfig()
        family = load_family(self.config.model.family)
        family.resolve_model(self.config.model)  # the tiny default is made here once, not by every stage at once
        stages = self.config.stages
        self.actors = {
            name: _actor(cls, getattr(stages, name)).remote(self.config.model, getattr(stages, name), f"{name}-0")
            for name, cls in family.stage_classes.items()
        }
        ray.get([actor.describe.remote() for actor in self.actors.values()])  # wait until every stage is loaded
        clients = {name: ActorClient(actor) for name, actor in self.actors.items()}
        self.orchestrator = family.make_orchestrator(clients, self.config)
        self.tokenizer = self.orchestrator.tokenizer
        self.model_config = self.orchestrator.model_config
        self.prompts = getattr(self.orchestrator, "prompts", None)  # Qwen3-Omni's chat prompts
        self.checkpoint = getattr(self.orchestrator, "checkpoint", "")

    def shutdown(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)

    async def stats(self) -> dict[str, Any]:
        names = [name for name in ("thinker", "talker", "vocoder") if name in self.actors]
        values = await asyncio.gather(*(self.actors[n].stats.remote() for n in names))
        return dict(zip(names, values))

    def generate(self, messages: list[dict[str, Any]], **kwargs: Any) -> AsyncIterator[Event]:
        """A chat reply (Qwen3-Omni; see its Orchestrator.generate for the arguments)."""
        if not hasattr(self.orchestrator, "generate"):
            raise TypeError(f"{self.config.model.family} speaks text; it does not chat: use speak")
        return self.orchestrator.generate(messages, **kwargs)

    def speak(self, text: str, **kwargs: Any) -> AsyncIterator[Event]:
        """Speech for `text` (see the family orchestrator's speak for the arguments)."""
        return self.orchestrator.speak(text, **kwargs)
