"""A stage replica's startup phases: each one's wall time, and what of it torch.compile took (StageBase alone, no Ray)."""

from __future__ import annotations

import time

import torch

from omni_ray.stages.base import StageBase, compile_seconds


def test_a_phase_that_compiles_reports_its_compile_time_within_its_own() -> None:
    stage = StageBase("startup-stage")
    with stage.startup_phase("load"):
        time.sleep(0.01)  # no compiling here
    assert stage.startup_s["load"] >= 0.01 and "compile" not in stage.startup_s

    def scaled_sine(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 3.0 + x

    before = compile_seconds()
    with stage.startup_phase("warmup"):
        compiled = torch.compile(scaled_sine, dynamic=False)
        x = torch.randn(16)
        torch.testing.assert_close(compiled(x), scaled_sine(x))
    assert compile_seconds() > before
    assert 0 < stage.startup_s["compile"] <= stage.startup_s["warmup"]
    assert stage.load_stats()["startup_compile_s"] == stage.startup_s["compile"]
