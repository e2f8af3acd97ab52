"""One GPU, two processes: the CUDA IPC relay delivers every step's tensors bitwise and in order, on the consumer's
device (in `auto` mode, small steps on the host path in between, still in order), and the 1-GPU pipeline with every edge
on CUDA IPC gives the CPU pipeline's tokens and codes. A buffer a receiver hands over is not refilled while a consumer's
queued read of it waits. Skipped without CUDA."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest
import torch
from ray import cloudpickle

from omni_ray.relay import PlacementTransport, RelayEndpoint, RelayItem, RelayPeer, RelaySender
from omni_ray.relay.collective import CollectiveReceiver
from omni_ray.relay.ipc import IpcReceiver
from omni_ray.relay.auth import with_relay_env
from omni_ray.relay.tcp import RelayServer
from omni_ray.relay.transports import gpu_uuid

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors below: Ray workers can't import tests/


RING_BYTES = 1 << 20  # small, so that 20 steps wrap it several times; step 7 is too big for it (its own buffer)
IPC_FROM_BYTES = 256 << 10  # in `auto` mode: steps 0, 3, 6, ... (400 KB) and 7 through CUDA IPC, the rest (150 KB) not


def _rows(step: int) -> int:
    return 300 if step == 7 else 100 if step % 3 == 0 else 37


def _payload(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(step)
    return {"hidden": torch.randn(_rows(step), 2048, device="cuda", generator=g).to(torch.bfloat16),
            "ids": torch.arange(step, step + 11, device="cuda"), "flag": torch.tensor([step % 2 == 0], device="cuda")}


@pytest.mark.parametrize("mode", ["ipc", "auto"])
def test_ipc_relay_between_two_processes_on_one_gpu_is_ordered_and_bitwise(ray_cluster: str, mode: str) -> None:
    """Through a ring that wraps, and a buffer of its own for a message too big for the ring; in `auto` mode the
    steps under `ipc_from_bytes` are copied to the host (as a stage does) and take the host path, interleaved with
    the IPC ones."""
    import ray

    from omni_ray.relay.transports import device_bytes
    from omni_ray.stages.base import host_copies

    @ray.remote(num_cpus=0.1, num_gpus=0.4)
    class Consumer:
        async def peer(self) -> RelayPeer:
            self.endpoint = RelayEndpoint()
            self.server = RelayServer(self.endpoint)
            self.collective = CollectiveReceiver(self.endpoint, "cuda")
            self.ipc = IpcReceiver(self.endpoint, "cuda")
            self.got: list[RelayItem] = []
            self.endpoint.claim("r", self.got.append)
            return RelayPeer("consumer", await self.server.start("127.0.0.1"), "cuda", gpu_uuid(torch.device("cuda")))

        async def received(self) -> list[dict[str, Any]]:
            return [{"kind": i.kind, "devices": {k: t.device.type for k, t in i.tensors.items()},
                     **{k: t.cpu() for k, t in i.tensors.items()}} for i in self.got]

        async def ipc_count(self) -> int:
            return self.ipc.received

    @ray.remote(num_cpus=0.1, num_gpus=0.4)
    class Producer:
        async def send_all(self, peer: RelayPeer, steps: int) -> list[str]:
            transport = PlacementTransport("cuda", mode, ipc_from_bytes=IPC_FROM_BYTES)  # type: ignore[arg-type]
            assert transport.select(peer) is transport.ipc
            transport.ipc.ring_bytes = RING_BYTES
            self.transport = transport
            failures: list[str] = []
            sender = RelaySender("producer", transport, lambda ids, exc: failures.append(str(exc)))
            for step in range(steps):
                items = [RelayItem("r", tensors=_payload(step))]
                torch.cuda.synchronize()  # relay items are complete when handed on
                if transport.needs_host_tensors(peer, device_bytes(items)):
                    items = host_copies(items)
                sender.send(peer, items)
                await asyncio.sleep(0)
            sender.send(peer, [RelayItem("r", kind="end")])
            await asyncio.sleep(2)
            return failures

        async def unringed(self) -> int:
            return self.transport.ipc.unringed

        async def inline(self) -> int:
            return self.transport.ipc.inline

    relay_env = with_relay_env({})  # one relay secret for both actors
    consumer, producer = Consumer.options(**relay_env).remote(), Producer.options(**relay_env).remote()
    peer = ray.get(consumer.peer.remote())
    assert not ray.get(producer.send_all.remote(peer, 20))
    deadline = time.monotonic() + 30
    while len(ray.get(consumer.received.remote())) < 21:
        assert time.monotonic() < deadline, "the IPC relay did not deliver"
        time.sleep(0.05)
    got = ray.get(consumer.received.remote())
    over_ipc = [step for step in range(20) if mode == "ipc" or _rows(step) > 37]
    assert ray.get(consumer.ipc_count.remote()) == len(over_ipc) + (mode == "ipc")  # and the end marker
    assert 1 <= ray.get(producer.unringed.remote()) < len(over_ipc)  # step 7 in its own buffer, the rest in the ring
    # each ring message after the first (which makes the ring) is placed on the loop's thread
    assert 1 <= ray.get(producer.inline.remote()) <= len(over_ipc) - 2
    for step, item in enumerate(got[:20]):
        expected = {k: t.cpu() for k, t in _payload(step).items()}
        device = "cuda" if step in over_ipc else "cpu"
        assert item["devices"] == {"hidden": device, "ids": device, "flag": device}
        for key, tensor in expected.items():
            assert item[key].dtype == tensor.dtype and torch.equal(item[key], tensor)
    assert got[20]["kind"] == "end"
    ray.kill(producer)
    ray.kill(consumer)


def test_one_gpu_pipeline_over_cuda_ipc_matches_the_cpu(pipeline: Any) -> None:
    import ray
    from _reference import run_pipeline

    from omni_ray.config import PipelineConfig
    from omni_ray.pipeline import Pipeline

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = {"device": "cuda", "dtype": "float32", "num_cpus": 0.2, "num_gpus": 0.2}
    config = PipelineConfig.model_validate({"stages": {
        name: {"resources": cuda, "relay": "ipc"} for name in ("encoder", "thinker", "talker", "vocoder")}})
    one_gpu = Pipeline(config)
    try:
        messages = [{"role": "user", "content": "Say something about the sea."}]
        on_cpu = asyncio.run(run_pipeline(pipeline, messages, max_tokens=32, max_frames=24))
        over_ipc = asyncio.run(run_pipeline(one_gpu, messages, max_tokens=32, max_frames=24))
        thinker = ray.get(one_gpu.actors["thinker"].relay_stats.remote())
        talker = ray.get(one_gpu.actors["talker"].relay_stats.remote())
    finally:
        one_gpu.shutdown()
    assert thinker["ipc_shared"] > 0 and talker["ipc_received"] > 0  # Thinker → Talker went over CUDA IPC
    assert over_ipc.token_ids == on_cpu.token_ids
    assert torch.equal(over_ipc.codes.cpu(), on_cpu.codes.cpu())


@pytest.mark.parametrize("handed_over", [True, False])
def test_a_handed_over_buffer_is_not_refilled_before_the_consumers_queued_read(handed_over: bool) -> None:
    """A receiver fills a buffer on its own stream and hands it over; the consumer's read of it is queued behind
    other work on the default stream (a step launched ahead) and the consumer drops it. The receiver's next buffer
    must not take that memory before the read has run: written at once on the receiver's stream, it would change
    what the read sees. Without the hand-over, the allocator gives the next buffer the same memory at once (the
    hazard this guards against)."""
    endpoint = RelayEndpoint()
    receiving = torch.cuda.Stream()
    # every kernel below loaded once first: loading them lazily took longer than the sleep, so the read had run
    # before the free (this test's first version)
    warm = torch.ones(4096, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(1000)
    warm.fill_(2)
    assert int(warm.to(torch.int32).sum()) == 8192
    with torch.cuda.stream(receiving):
        first = torch.full((4096,), 1, dtype=torch.uint8, device="cuda")
        receiving.synchronize()
    if handed_over:
        endpoint.hand_over(first)
    address = first.data_ptr()
    torch.cuda._sleep(1_000_000_000)  # about 0.5 s of the default stream: the consumer is behind
    read = first.to(torch.int32).sum()  # queued behind it
    del first
    with torch.cuda.stream(receiving):
        second = torch.empty(4096, dtype=torch.uint8, device="cuda")
        second.fill_(2)  # at once: the receiving stream is idle
    if handed_over:
        assert int(read) == 4096  # what the first buffer held
    else:
        assert second.data_ptr() == address
    torch.cuda.synchronize()
