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

    # Logical CPUs: the pipeline's four actors and the Serve app's replicas each ask for a fraction.
    context = ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
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


# OMNI_RAY_TEST_PORT: another port, for test runs side by side on one machine
SERVE_PORT = int(os.environ.get("OMNI_RAY_TEST_PORT", "8000"))
INGRESS_REPLICAS = 2
# Small limits so that the 413 paths are cheap to exercise.
SERVE_LIMITS = {
    "max_request_bytes": 2 * 1024 * 1024, "max_audio_seconds": 20, "max_completion_tokens": 512, "max_prompt_tokens": 2000,
}


@pytest.fixture(scope="session")
def serve_url(ray_cluster: str) -> Iterator[str]:
    """The real service: Ray Serve, one deployment per stage plus the OpenAI ingress, on the tiny model."""
    import time

    import httpx
    from ray import serve

    from omni_ray.serve.app import app_from_serve_config, start_serve

    layout = Path(__file__).resolve().parent.parent / "deployments" / "tiny_cpu.yaml"  # the shipped default
    # two ingress replicas, as a service scaled for load runs: /metrics must count both replicas' requests
    overrides = {"limits": SERVE_LIMITS, "stage_options": {"ingress": {"num_replicas": INGRESS_REPLICAS}}}
    app, spec = app_from_serve_config(layout, overrides=overrides)
    start_serve(spec, {"host": "127.0.0.1", "port": SERVE_PORT})
    serve.run(app, name=spec["name"], route_prefix=spec["route_prefix"])
    url = f"http://127.0.0.1:{SERVE_PORT}"
    deadline = time.time() + 60
    while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
        assert time.time() < deadline, "service never became ready"
        time.sleep(0.2)
    yield url
    serve.shutdown()
