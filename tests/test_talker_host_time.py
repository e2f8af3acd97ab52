"""The Talker host-time probe on the tiny model, on the CPU: every stretch it names is found and timed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import talker_host_time


def test_every_stretch_is_timed_inside_the_launch_and_torch_is_given_back(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cat, to, pin_memory = torch.cat, torch.Tensor.to, torch.Tensor.pin_memory
    talker_host_time.main(["--config", str(tiny_checkpoint / "config.json"), "--device", "cpu", "--dtype", "float32",
                           "--batches", "1,3", "--prompt", "8", "--steps", "4", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "talker_host_time.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        calls, ms = row["calls_per_step"], row["ms_per_step"]
        assert calls["launch"] == 1 and calls["frames"] == 1 and calls["decode"] == 1
        assert calls["graph replays"] == 2  # the backbone's decode and the frame
        assert all(ms[name] > 0 for name, _, _ in talker_host_time.STRETCHES if "pin_memory" not in name)
        assert calls["Tensor.pin_memory, all calls"] == 0  # a CPU runner's upload pins nothing
        assert ms["decode"] + ms["frames"] <= ms["launch"] <= row["step_ms"]
        assert ms["upload"] <= ms["launch"] and ms["graph replays"] <= ms["decode"] + ms["frames"]
    assert torch.cat is cat and torch.Tensor.to is to and torch.Tensor.pin_memory is pin_memory
