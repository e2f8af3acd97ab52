"""`upload`: a step's host-built inputs packed into one buffer per dtype and handed back as views, each equal to
its input (shape, dtype, values), including empty ones."""

from __future__ import annotations

import torch

from omni_ray.engine.host_inputs import upload


def test_upload_packs_per_dtype_and_returns_equal_views() -> None:
    inputs = {
        "positions": torch.tensor([5, 7, 2047, 2047]),
        "keys": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
        "none": torch.tensor([], dtype=torch.long),
        "table": torch.tensor([[0.7, 50.0, 0.8, 1.05]], dtype=torch.float64),
        "no_eos": torch.tensor([True, False]),
    }
    moved = upload(inputs, torch.device("cpu"))
    assert moved.keys() == inputs.keys()
    for name, tensor in inputs.items():
        assert moved[name].dtype == tensor.dtype and moved[name].shape == tensor.shape
        assert torch.equal(moved[name], tensor)
    # one buffer per dtype: the int64 inputs share storage
    assert moved["positions"].untyped_storage().data_ptr() == moved["keys"].untyped_storage().data_ptr()
    assert moved["table"].untyped_storage().data_ptr() != moved["keys"].untyped_storage().data_ptr()


def test_to_device_and_step_done_on_the_cpu() -> None:
    from omni_ray.engine.host_inputs import StepDone, to_device

    tensor = torch.tensor([[3, 1], [4, 1]])
    moved = to_device(tensor, torch.device("cpu"))
    assert moved.dtype == tensor.dtype and torch.equal(moved, tensor)
    StepDone(torch.device("cpu")).wait()  # nothing queued: returns at once
