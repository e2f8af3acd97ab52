"""Stage streams over Serve's gRPC transport: items larger than gRPC's default 4 MiB message cap get through."""

from __future__ import annotations

import sys
from typing import Any, AsyncIterator

import numpy as np
import pytest
from ray import cloudpickle
from ray import serve

from omni_ray.serve.app import with_serve_env
from omni_ray.stages.client import ServeClient

ITEM_BYTES = 6 * 1024 * 1024  # past gRPC's default cap of 4 MiB
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas cannot import this test module


class Producer:
    """Streams batches of events as a stage does, each batch one large audio-like array."""

    async def chunks(self, count: int) -> AsyncIterator[list[dict[str, Any]]]:
        for i in range(count):
            yield [{"type": "audio", "pcm": np.full(ITEM_BYTES // 4, i, dtype=np.float32)}]


class Consumer:
    """Reads the producer's stream through `ServeClient`, as the ingress reads a stage's."""

    def __init__(self, producer: Any, grpc_streams: bool) -> None:
        self.client = ServeClient(producer, grpc_streams)

    async def sizes(self, count: int) -> list[int]:
        return [int(event["pcm"].nbytes) async for event in self.client.stream("chunks", count)]


@pytest.mark.parametrize("grpc_streams", [True, False])
def test_stream_items_past_grpcs_default_cap_reach_the_caller(serve_url: str, grpc_streams: bool) -> None:
    options = {"ray_actor_options": with_serve_env({"num_cpus": 0.05})}
    producer = serve.deployment(Producer).options(name="producer", **options).bind()
    app = serve.deployment(Consumer).options(name="consumer", **options).bind(producer, grpc_streams)
    handle = serve.run(app, name="grpc-streams", route_prefix=None)
    try:
        assert handle.sizes.remote(3).result(timeout_s=120) == [ITEM_BYTES] * 3
    finally:
        serve.delete("grpc-streams")
