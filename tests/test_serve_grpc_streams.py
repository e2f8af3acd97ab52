"""Serve's gRPC transport, between stage replicas and from the ingress to the HTTP proxy: items and reply bodies
larger than gRPC's default 4 MiB message cap get through."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import numpy as np
import pytest
from ray import cloudpickle
from ray import serve
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from omni_ray.serve.app import PROXY_ENV, with_serve_env
from omni_ray.stages.client import ServeClient
from _scaling import wait_for_route

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


class LargeReplies:
    """An HTTP deployment whose reply bodies are past gRPC's default cap: one message (`/`) or streamed (`/stream`),
    as the ingress answers a long non-streamed reply and a lagging stream's batch of audio."""

    async def __call__(self, request: Request) -> Response:
        if request.url.path.endswith("/ready"):
            return Response(b"ok")
        if request.url.path.endswith("/stream"):
            async def chunks() -> AsyncIterator[bytes]:
                for i in range(2):
                    yield bytes([i]) * ITEM_BYTES
            return StreamingResponse(chunks())
        return Response(b"x" * ITEM_BYTES)


def _proxy_environments() -> list[dict[str, str]]:
    """The environment of every Serve HTTP proxy process on this machine."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(b"ray::ProxyActor"):
                pairs = (cmdline.parent / "environ").read_bytes().decode(errors="replace").split("\0")
                found.append(dict(pair.split("=", 1) for pair in pairs if "=" in pair))
        except OSError:  # a process that ended meanwhile
            continue
    return found


def test_the_http_proxy_reads_replies_over_grpc_and_passes_bodies_past_its_default_cap(serve_url: str) -> None:
    """The layout's controller options reach Serve's proxy process (gRPC to the ingress, omni-ray's cap); a 6 MiB
    reply body, whole and streamed, then reaches the client (over gRPC without the cap it is a 500)."""
    proxies = _proxy_environments()
    assert proxies, "no Serve HTTP proxy process found"
    for environment in proxies:
        assert {key: environment.get(key) for key in PROXY_ENV} == PROXY_ENV
    options = {"ray_actor_options": with_serve_env({"num_cpus": 0.05})}
    serve.run(serve.deployment(LargeReplies).options(name="large", **options).bind(), name="large-replies",
              route_prefix="/large-replies")
    try:
        wait_for_route(serve_url, "/large-replies", probe="/ready")
        whole = httpx.get(f"{serve_url}/large-replies", timeout=120)
        assert whole.status_code == 200 and whole.content == b"x" * ITEM_BYTES
        streamed = httpx.get(f"{serve_url}/large-replies/stream", timeout=120)
        assert streamed.status_code == 200 and streamed.content == b"\0" * ITEM_BYTES + b"\1" * ITEM_BYTES
    finally:
        serve.delete("large-replies")
