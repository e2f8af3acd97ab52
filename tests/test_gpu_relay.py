"""Two GPUs: the pipeline with the Thinker on one GPU and the Talker + vocoder on the other relays over NCCL and
gives the same tokens and codes as the CPU pipeline. Skipped without two CUDA devices."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_thinker_and_talker_on_two_gpus_relay_over_nccl_and_match(pipeline: Any) -> None:
    import ray
    from _reference import run_pipeline

    from omni_ray.config import PipelineConfig
    from omni_ray.pipeline import Pipeline

    cuda = {"device": "cuda", "dtype": "float32"}
    config = PipelineConfig.model_validate({"stages": {
        "encoder": {"resources": {"num_cpus": 0.2, "num_gpus": 0.1, **cuda}},
        "thinker": {"resources": {"num_cpus": 0.2, "num_gpus": 0.9, **cuda}},  # with the encoder: all of one GPU
        "talker": {"resources": {"num_cpus": 0.2, "num_gpus": 0.5, **cuda}},
        "vocoder": {"resources": {"num_cpus": 0.2, "num_gpus": 0.5, **cuda}},
    }})
    split = Pipeline(config)
    try:
        peers = ray.get([split.actors[name].describe.remote() for name in ("thinker", "talker")])
        assert peers[0]["peer"].gpu_uuid != peers[1]["peer"].gpu_uuid  # really two GPUs
        messages = [{"role": "user", "content": "Say something about the sea."}]
        on_cpu = asyncio.run(run_pipeline(pipeline, messages, max_tokens=32, max_frames=24))
        on_gpus = asyncio.run(run_pipeline(split, messages, max_tokens=32, max_frames=24))
        thinker_relay = ray.get(split.actors["thinker"].relay_stats.remote())
        talker_relay = ray.get(split.actors["talker"].relay_stats.remote())
    finally:
        split.shutdown()
    assert thinker_relay["collective_pairs"] == 1  # Thinker → Talker went over a pairwise NCCL group
    assert talker_relay["collective_pairs"] == 0  # Talker → vocoder share a GPU: host path
    assert on_gpus.token_ids == on_cpu.token_ids
    assert torch.equal(on_gpus.codes, on_cpu.codes)


def test_talker_replicas_on_the_second_gpu_scale_1_2_1_under_load_over_nccl(serve_url: str) -> None:
    """Serve on two GPUs: the Thinker holds GPU0, Talker replicas share GPU1. Under streaming load the Talker goes
    1 → 2 → 1 replicas; the Thinker opens an NCCL pair to the new replica and drops it when it leaves, and no
    request fails."""
    from _scaling import scale_talker_up_and_down

    cuda = {"device": "cuda", "dtype": "float32", "num_cpus": 0.2}
    pipeline = {"stages": {
        "encoder": {"resources": {**cuda, "num_gpus": 0.1}},
        "thinker": {"resources": {**cuda, "num_gpus": 1.0}, "relay": "auto"},  # all of one GPU
        "talker": {"resources": {**cuda, "num_gpus": 0.4}},  # two replicas fit beside the encoder and vocoder
        "vocoder": {"resources": {**cuda, "num_gpus": 0.1}},
    }}
    completed = scale_talker_up_and_down(serve_url, "scaling-gpu", "/scaling-gpu", pipeline, collective=True)
    print(f"\n{completed} requests completed across the scale-up and scale-down on two GPUs, none failed")
