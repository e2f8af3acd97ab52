"""Model families; each folder holds only its own architecture and wiring, and names its stages and request path here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Family:
    """What the Python API and the Serve app need of a family: its stage classes by name, in the order a request
    passes them, its orchestrator over stage clients (`make_orchestrator(clients, pipeline_config)`), and where a
    model source's files are (`resolve_model(source)`, which makes the tiny default on first use: called once before
    the stages start, so that they do not all make it at once)."""

    stage_classes: dict[str, type]
    make_orchestrator: Callable[[dict[str, Any], Any], Any]
    resolve_model: Callable[[Any], Any]


def load_family(name: str) -> Family:
    """The family `name` (`ModelSource.family`): its `stages.STAGE_CLASSES`, `orchestrator.make_orchestrator` and
    `model_files.resolve_model`."""
    stages = importlib.import_module(f"omni_ray.models.{name}.stages")
    orchestrator = importlib.import_module(f"omni_ray.models.{name}.orchestrator")
    files = importlib.import_module(f"omni_ray.models.{name}.model_files")
    return Family(dict(stages.STAGE_CLASSES), orchestrator.make_orchestrator, files.resolve_model)
