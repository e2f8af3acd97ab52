"""`upload`: a step's host-built inputs packed into one byte buffer and handed back as views, each equal to
its input (shape, dtype, values), including empty ones; `stack_on_device` and `cat_on_device` over rows on the host
and the device."""

from __future__ import annotations

import torch

from omni_ray.engine.host_inputs import upload


def test_upload_packs_every_dtype_into_one_buffer_and_returns_equal_views() -> None:
    inputs = {
        "positions": torch.tensor([5, 7, 2047, 2047]),
        "keys": torch.tensor([[1, 2], [3, 4]], dtype=torch.int64),
        "none": torch.tensor([], dtype=torch.long),
        "table": torch.tensor([[0.7, 50.0, 0.8, 1.05]], dtype=torch.float64),
        "no_eos": torch.tensor([True, False]),
        "texts": torch.randn(3, 5).to(torch.bfloat16),
        "after_odd_bytes": torch.tensor([1.5, -2.0], dtype=torch.float32),
    }
    moved = upload(inputs, torch.device("cpu"))
    assert moved.keys() == inputs.keys()
    for name, tensor in inputs.items():
        assert moved[name].dtype == tensor.dtype and moved[name].shape == tensor.shape
        assert torch.equal(moved[name], tensor)
    # one buffer for all: every input shares its storage
    assert len({t.untyped_storage().data_ptr() for t in moved.values()}) == 1


def test_to_device_and_step_done_on_the_cpu() -> None:
    from omni_ray.engine.host_inputs import StepDone, to_device

    tensor = torch.tensor([[3, 1], [4, 1]])
    moved = to_device(tensor, torch.device("cpu"))
    assert moved.dtype == tensor.dtype and torch.equal(moved, tensor)
    StepDone(torch.device("cpu")).wait()  # nothing queued: returns at once


def test_stack_on_device_takes_rows_from_the_host_and_the_device_in_one_batch() -> None:
    """One step's text embeddings, some relayed on the host path and some already on the device (here torch's `meta`
    device stands in for a GPU: no values, but the same device checks): a plain stack refuses the mix, and
    `stack_on_device` gives one tensor on the device, in order. On the CPU it is a plain stack, values and all."""
    import pytest

    from omni_ray.engine.host_inputs import stack_on_device

    meta = torch.device("meta")
    mixed = [torch.randn(4), torch.empty(4, device=meta), torch.randn(4)]
    with pytest.raises(RuntimeError):
        torch.stack(mixed)
    stacked = stack_on_device(mixed, meta)
    assert stacked.device == meta and stacked.shape == (3, 4)
    rows = [torch.randn(4) for _ in range(3)]
    assert torch.equal(stack_on_device(rows, torch.device("cpu")), torch.stack(rows))


def test_cat_on_device_joins_prefixes_of_different_lengths_from_the_host_and_the_device() -> None:
    """As `stack_on_device`, for a batch's prefix states of different lengths: one tensor on the device, in order."""
    import pytest

    from omni_ray.engine.host_inputs import cat_on_device

    meta = torch.device("meta")
    mixed = [torch.randn(2, 4), torch.empty(3, 4, device=meta), torch.randn(5, 4)]
    with pytest.raises(RuntimeError):
        torch.cat(mixed)
    joined = cat_on_device(mixed, meta)
    assert joined.device == meta and joined.shape == (10, 4)
    parts = [torch.randn(n, 4) for n in (2, 1, 3)]
    assert torch.equal(cat_on_device(parts, torch.device("cpu")), torch.cat(parts))
