"""The pairwise-collective relay on CPU (gloo; NCCL takes the same path between GPUs): framing, bitwise-exact
delivery, transport selection by placement, and a peer that dies, between real Ray actors."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import numpy as np
import pytest
import ray
import torch

from omni_ray.relay import LOCAL_ENDPOINTS, PlacementTransport, RelayEndpoint, RelayItem, RelayMessage, RelayPeer, RelaySender
from omni_ray.relay.auth import with_relay_env
from omni_ray.relay.collective import CollectiveReceiver, CollectiveTransport, flatten, pack, unpack
from omni_ray.relay.tcp import RelayServer


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "ids": torch.arange(11),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def test_pack_and_unpack_round_trip_bitwise() -> None:
    message = RelayMessage("p", [RelayItem("a", tensors=_tensors(), meta={"k": 1}, seq=3), RelayItem("b", kind="end", seq=0)])
    header, tensors, nbytes = pack(message)
    assert all(not item.tensors for item in header.items)  # the header carries no tensor data
    assert all(offset % 16 == 0 for offset, _ in tensors)
    rebuilt = unpack(header, flatten(tensors, nbytes, torch.device("cpu")))
    assert [(i.request_id, i.kind, i.seq, i.meta) for i in rebuilt.items] == [("a", "data", 3, {"k": 1}), ("b", "end", 0, {})]
    for name, tensor in _tensors().items():
        got = rebuilt.items[0].tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


def test_flatten_owns_its_buffer_and_fills_a_given_one() -> None:
    """One tensor still gets a buffer of its own (the sender may reuse the tensor), and `out` (a ring slot) receives
    the same bytes, padding included."""
    message = RelayMessage("p", [RelayItem("a", tensors=_tensors())])
    _, tensors, nbytes = pack(message)
    expected = flatten(tensors, nbytes, torch.device("cpu"))
    out = torch.full((nbytes,), 7, dtype=torch.uint8)
    assert flatten(tensors, nbytes, torch.device("cpu"), out=out) is out and torch.equal(out, expected)
    single = torch.arange(4, dtype=torch.int64)
    buffer = flatten([(0, single)], 32, torch.device("cpu"))
    assert buffer.data_ptr() != single.data_ptr() and torch.equal(buffer.view(torch.int64), single)


def test_placement_picks_collective_between_gpus_ipc_on_one_gpu_else_host() -> None:
    peer_gpu1 = RelayPeer("c", "tcp://127.0.0.1:1", "cuda:0", "GPU-1")
    peer_gpu0 = RelayPeer("d", "tcp://127.0.0.1:1", "cuda:0", "GPU-0")
    auto = PlacementTransport("cpu", "auto")
    assert auto.select(peer_gpu1) is auto.tcp and auto.needs_host_tensors(peer_gpu1, 1 << 30)  # a CPU producer
    auto.gpu_uuid = "GPU-0"  # as a producer on GPU-0 would see it
    assert auto.select(peer_gpu1) is auto.collective and not auto.needs_host_tensors(peer_gpu1, 0)
    assert auto.ipc is None and auto.select(peer_gpu0) is auto.tcp  # no CUDA here: no IPC transport, host path
    assert auto.select(RelayPeer("e", "tcp://127.0.0.1:1")) is auto.tcp  # a CPU consumer
    forced = PlacementTransport("cpu", "collective")
    assert forced.select(RelayPeer("e", "tcp://127.0.0.1:1")) is forced.collective
    host = PlacementTransport("cpu", "host")
    host.gpu_uuid = "GPU-0"
    assert host.select(peer_gpu1) is host.tcp
    ipc = PlacementTransport("cpu", "ipc")
    assert ipc.ipc is None and ipc.select(peer_gpu0) is ipc.tcp  # no CUDA here: no IPC transport
    ipc.gpu_uuid, ipc.ipc = "GPU-0", object()  # as a producer on GPU-0 would be set up
    assert ipc.select(peer_gpu0) is ipc.ipc and not ipc.needs_host_tensors(peer_gpu0, 1)  # one GPU: CUDA IPC
    assert ipc.select(peer_gpu1) is ipc.collective  # another GPU: NCCL, as auto
    assert ipc.select(RelayPeer("e", "tcp://127.0.0.1:1")) is ipc.tcp
    LOCAL_ENDPOINTS["here"] = RelayEndpoint()
    try:
        assert forced.select(RelayPeer("here", "tcp://127.0.0.1:1")) is forced.local  # same process wins
    finally:
        LOCAL_ENDPOINTS.pop("here")


async def _until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


def test_collective_relay_is_ordered_and_bitwise_exact_to_two_consumers() -> None:
    async def main() -> None:
        consumers = []
        for name in ("c1", "c2"):
            endpoint = RelayEndpoint()
            server = RelayServer(endpoint)
            receiver = CollectiveReceiver(endpoint, "cpu", timeout_s=5)
            consumers.append((RelayPeer(name, await server.start("127.0.0.1")), endpoint, server, receiver))
        failures: list[Any] = []
        transport = CollectiveTransport("cpu", timeout_s=5)
        sender = RelaySender("producer", transport, lambda ids, exc: failures.append((ids, exc)))
        got: dict[str, list[RelayItem]] = {"c1": [], "c2": []}
        sent: dict[str, list[dict[str, torch.Tensor]]] = {"c1": [], "c2": []}
        for peer, endpoint, _, _ in consumers:
            endpoint.claim("r-" + peer.replica_id, got[peer.replica_id].append)
        for step in range(5):
            for peer, _, _, _ in consumers:
                tensors = {k: v + step if v.dtype != torch.bool else v for k, v in _tensors().items()}
                sent[peer.replica_id].append(tensors)
                sender.send(peer, [RelayItem("r-" + peer.replica_id, tensors=tensors)])
        await _until(lambda: all(len(v) == 5 for v in got.values()), timeout=20)
        assert not failures
        for name in ("c1", "c2"):
            for item, tensors in zip(got[name], sent[name]):
                assert item.kind == "data"
                for key, tensor in tensors.items():
                    assert item.tensors[key].dtype == tensor.dtype and torch.equal(item.tensors[key], tensor)
        transport.close()
        for _, _, server, receiver in consumers:
            receiver.close()
            await server.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def relay_actors(ray_cluster: str) -> Any:
    import ray

    @ray.remote(num_cpus=0.1)
    class Consumer:
        """A relay receiver in its own process: records what arrives for its requests."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.got: list[tuple[str, str, list[float]]] = []

        async def peer(self) -> RelayPeer:
            self.endpoint = RelayEndpoint()
            self.server = RelayServer(self.endpoint)
            self.receiver = CollectiveReceiver(self.endpoint, "cpu", timeout_s=3)
            return RelayPeer(self.name, await self.server.start("127.0.0.1"))

        async def claim(self, request_id: str) -> None:
            self.endpoint.claim(request_id, lambda item: self.got.append(
                (item.request_id, item.kind, item.tensors["x"].tolist() if "x" in item.tensors else [])))

        async def received(self) -> list[tuple[str, str, list[float]]]:
            return self.got

    @ray.remote(num_cpus=0.1)
    class Producer:
        def __init__(self) -> None:
            self.failed: list[tuple[list[str], str]] = []

        async def start(self) -> None:
            self.sender = RelaySender("producer", PlacementTransport("cpu", "collective"),
                                      lambda ids, exc: self.failed.append((ids, str(exc))))

        async def send(self, peer: RelayPeer, request_id: str, value: float) -> None:
            self.sender.send(peer, [RelayItem(request_id, tensors={"x": torch.full((4,), value)})])

        async def failures(self) -> list[tuple[list[str], str]]:
            return self.failed

    return ray, Producer, Consumer


def test_a_dead_consumer_fails_only_its_requests_and_the_producer_keeps_serving(relay_actors: Any) -> None:
    ray, Producer, Consumer = relay_actors
    relay_env = with_relay_env({})  # the driver's relay secret: the actors' connections pass each other's handshake
    producer = Producer.options(**relay_env).remote()
    alive, doomed = Consumer.options(**relay_env).remote("alive"), Consumer.options(**relay_env).remote("doomed")
    ray.get(producer.start.remote())
    alive_peer, doomed_peer = ray.get([alive.peer.remote(), doomed.peer.remote()])
    ray.get([alive.claim.remote("a"), doomed.claim.remote("d")])
    for step in range(3):
        ray.get([producer.send.remote(alive_peer, "a", step), producer.send.remote(doomed_peer, "d", step)])
    deadline = time.monotonic() + 20
    while len(ray.get(doomed.received.remote())) < 3 or len(ray.get(alive.received.remote())) < 3:
        assert time.monotonic() < deadline, "the relay did not deliver"
        time.sleep(0.05)
    assert [x for _, _, x in ray.get(doomed.received.remote())] == [[float(s)] * 4 for s in range(3)]
    ray.kill(doomed)
    started = time.monotonic()
    ray.get(producer.send.remote(doomed_peer, "d", 9.0))
    for step in range(3, 6):
        ray.get(producer.send.remote(alive_peer, "a", step))
    while not ray.get(producer.failures.remote()) or len(ray.get(alive.received.remote())) < 6:
        assert time.monotonic() - started < 15, "no failure reported for the dead peer"
        time.sleep(0.05)
    failures = ray.get(producer.failures.remote())
    assert {rid for ids, _ in failures for rid in ids} == {"d"}  # only the dead peer's request failed
    # whichever layer saw it first (the host path's reset or refusal, the collective's send), the error names the peer
    assert all(message.startswith(f"relay peer {doomed_peer.replica_id} ") for _, message in failures), failures
    assert time.monotonic() - started < 15
    assert [x for _, _, x in ray.get(alive.received.remote())] == [[float(s)] * 4 for s in range(6)]
    ray.kill(producer)
    ray.kill(alive)


def test_pipeline_over_collective_relays_equals_the_host_path(pipeline: Any) -> None:
    """Every edge forced onto pairwise groups (gloo on CPU): the same tokens, all 16 code groups and audio as the
    session pipeline, whose stages relay over the host path."""
    from _reference import run_pipeline, wav_part

    from omni_ray.config import PipelineConfig
    from omni_ray.pipeline import Pipeline

    config = PipelineConfig.model_validate(
        {"stages": {name: {"relay": "collective"} for name in ("encoder", "thinker", "talker", "vocoder")}}
    )
    collective = Pipeline(config)
    try:
        messages = [{"role": "user", "content": [wav_part(seconds=1.0, sample_rate=16000, channels=1, seed=5),
                                                 {"type": "text", "text": "Describe this, please."}]}]
        host = asyncio.run(run_pipeline(pipeline, messages, max_tokens=12, max_frames=9))
        over_groups = asyncio.run(run_pipeline(collective, messages, max_tokens=12, max_frames=9))
        sender = ray.get(collective.actors["thinker"].relay_stats.remote())
    finally:
        collective.shutdown()
    assert over_groups.token_ids == host.token_ids
    assert torch.equal(over_groups.codes, host.codes)
    assert np.array_equal(over_groups.pcm, host.pcm)
    assert sender["collective_pairs"] == 1  # the Thinker really used a pairwise group to its Talker
