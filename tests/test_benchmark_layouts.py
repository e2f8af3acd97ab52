"""Benchmark layouts stay valid configs, and `e2e_serve --set` overrides land where the pipeline reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.e2e_serve import with_overrides
from omni_ray.config import PipelineConfig

LAYOUTS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("serve_*.yaml"))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[p.name for p in LAYOUTS])
def test_overrides_reach_the_pipeline_config(layout: Path, tmp_path: Path) -> None:
    used = with_overrides(layout, ["pipeline.stages.vocoder.streaming.stateful=true", "pipeline.stages.thinker.relay=ipc",
                                   "limits.max_completion_tokens=512"], tmp_path)
    args = yaml.safe_load(used.read_text())["applications"][0]["args"]
    config = PipelineConfig.model_validate(args["pipeline"])
    assert config.stages.vocoder.streaming.stateful is True and config.stages.thinker.relay == "ipc"
    assert config.stages.thinker.engine.compile_layers is True  # the layout's own settings are kept
    assert args["limits"]["max_completion_tokens"] == 512
