"""Transfers between host and device that must not wait for work queued on the producer's stream (what a pipelined
engine has in flight): uploads through pinned memory, a step's completion event, and the relay's host copy. Skipped
without CUDA."""

from __future__ import annotations

import pytest
import torch

from omni_ray.engine.host_inputs import Download, StepDone, to_device, upload
from omni_ray.relay import RelayItem
from omni_ray.stages.base import host_copies, host_copy, warm_host_copy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUSY_CYCLES = 2_000_000_000  # about a second of GPU clock: far longer than any of the calls under test


def _calls_that_waited() -> list[str]:
    """A step's completion event, its download, an upload and the relay's host copies (one item, a step's items),
    each called with "the next step" queued behind them: the calls that returned only once that work had finished."""
    device = torch.device("cuda")
    made = torch.arange(12, device=device).float()  # "this step's" tensor
    mixed = {"half": made[:5].to(torch.bfloat16), "ids": made[3:6].long().reshape(1, 3), "flags": made > 6,
             "cpu": torch.arange(2), "empty": made[:0], "column": made.reshape(3, 4)[:, 1]}
    # this step's too: byte sizes that leave later ones unaligned, and a strided view
    done = StepDone(device)
    downloaded = Download(made)
    torch.cuda._sleep(BUSY_CYCLES)  # "the next step", queued after it on the same stream
    stream = torch.cuda.current_stream()
    waited = []

    def check(call: str) -> None:
        if stream.query():
            waited.append(call)

    try:
        done.wait()
        check("StepDone.wait")
        assert torch.equal(downloaded.result(), torch.arange(12).float())
        check("Download.result")
        uploaded = to_device(torch.tensor([5, 6, 7]), device)
        check("to_device")
        step_inputs = {"flags": torch.tensor([True, False, True]), "texts": torch.arange(6.0).reshape(2, 3).bfloat16(),
                       "none": torch.zeros(0, dtype=torch.long), "keys": torch.arange(4).reshape(2, 2)}
        packed = upload(step_inputs, device)  # every dtype in one pinned staging buffer, one copy
        check("upload")
        copied = host_copy(RelayItem("r", tensors={"x": made}))
        check("host_copy")
        assert torch.equal(copied.tensors["x"], torch.arange(12).float())
        on_cpu = RelayItem("c", tensors={"y": torch.ones(2)})
        step = host_copies([RelayItem(f"r{i}", tensors={"x": made[i]}) for i in range(3)] + [on_cpu]
                           + [RelayItem("m", tensors=mixed)])
        check("host_copies")
        assert [item.tensors["x"].item() for item in step[:3]] == [0.0, 1.0, 2.0]
        assert step[3] is on_cpu
        for name, tensor in mixed.items():
            got = step[4].tensors[name]
            assert got.device.type == "cpu" and got.dtype == tensor.dtype and torch.equal(got, tensor.cpu()), name
    finally:
        stream.synchronize()
    assert torch.equal(uploaded.cpu(), torch.tensor([5, 6, 7]))
    for name, tensor in step_inputs.items():
        assert packed[name].is_cuda and packed[name].dtype == tensor.dtype and torch.equal(packed[name].cpu(), tensor)
    return waited


def test_transfers_return_while_later_work_still_runs() -> None:
    """After the warm-up a GPU stage makes at startup (this test runs first in its file, in a fresh process). Without
    it, on an H200, the first round's host copy waited and the second's did not: a first-use cost. With a warm-up of
    one-tensor copies only, the first round's gather of several tensors waited."""
    warm_host_copy(torch.device("cuda"))
    first, second = _calls_that_waited(), _calls_that_waited()
    assert not first and not second, f"these waited for the next step: first round {first}, second round {second}"


@pytest.mark.parametrize(
    "upload_queued, numel", [(False, 12), (True, 12), (False, 1 << 22)],
    ids=["alone", "behind_an_upload", "a_pinned_size_not_cached"],
)
def test_no_part_of_a_side_stream_copy_to_the_host_waits_for_queued_work(upload_queued: bool, numel: int) -> None:
    """The parts of `host_copy`, one by one, with work queued on the producer's stream: a new side stream, a pinned
    host buffer, the copy queued on the side stream and the side stream's synchronisation. Names the first that waits.
    On an H200 no part waited, alone, behind an upload, or for a pinned block of a size the caching
    host allocator had not held before (16 MB, new pinned memory), while host_copy waited in the test above, the first
    in its process."""
    device = torch.device("cuda")
    made = torch.arange(numel, device=device).float()
    torch.cuda.current_stream().synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    if upload_queued:  # a host-to-device copy that must wait for the busy work (stream order)
        to_device(torch.tensor([5, 6, 7]), device)
    stream = torch.cuda.current_stream()
    waited = []

    def check(part: str) -> None:
        if stream.query() and not waited:
            waited.append(part)

    try:
        side = torch.cuda.Stream(device)
        check("a new side stream")
        host = torch.empty(made.shape, dtype=made.dtype, pin_memory=True)
        check("a pinned host buffer")
        with torch.cuda.stream(side):
            host.copy_(made, non_blocking=True)
        check("the copy queued on the side stream")
        side.synchronize()
        check("the side stream's synchronize")
        assert torch.equal(host, torch.arange(numel).float())
    finally:
        stream.synchronize()
    assert not waited, f"waited for the queued work: {waited[0]}"
