"""The pipeline YAML schema: shipped layouts validate, mistakes are rejected with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from omni_ray.config import PipelineConfig

DEPLOYMENTS = Path(__file__).resolve().parent.parent / "deployments"


@pytest.mark.parametrize("path", sorted(DEPLOYMENTS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_layouts_validate(path: Path) -> None:
    config = PipelineConfig.from_yaml(path)
    assert config.stages.vocoder.streaming.chunk_ramp[0] == 1


def test_tiny_cpu_layout_is_the_default() -> None:
    assert PipelineConfig.from_yaml(DEPLOYMENTS / "qwen3_omni_tiny_cpu.yaml") == PipelineConfig()


@pytest.mark.parametrize(
    "data",
    [
        {"stages": {"thinker": {"engine": {"max_batch": 0}}}},
        {"stages": {"talker": {"resources": {"device": "cuda:0", "num_gpus": 0}}}},
        {"stages": {"vocoder": {"streaming": {"steady_chunk": 0}}}},
        {"stages": {"encoder": {"resources": {"dtype": "int8"}}}},
        {"stagez": {}},
        {"model": {"family": "unknown"}},
    ],
)
def test_invalid_layouts_are_rejected(data: dict) -> None:
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate(data)
