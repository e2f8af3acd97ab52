"""Session fixtures: one tiny checkpoint, one Ray cluster, one pipeline and one transformers reference per run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default, generated on first use into a per-session cache dir (as a user's first run does)."""
    os.environ["OMNI_RAY_CACHE"] = str(tmp_path_factory.mktemp("omni-ray-cache"))
    from omni_ray.models.qwen3_omni.checkpoint import ensure_default_checkpoint

    return ensure_default_checkpoint()


@pytest.fixture(scope="session")
def ray_cluster(tiny_checkpoint: Path) -> Iterator[str]:
    import ray

    context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield context.address_info["address"]
    ray.shutdown()


@pytest.fixture(scope="session")
def pipeline(ray_cluster: str) -> Iterator[Any]:
    from omni_ray.pipeline import Pipeline

    pipe = Pipeline()  # no config: the embedded tiny default
    yield pipe
    pipe.shutdown()


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Path) -> Any:
    """transformers' own Qwen3-Omni on the same checkpoint: the parity reference."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
