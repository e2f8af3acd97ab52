"""The vocoder benchmark on the tiny model's config, on the CPU: its step table, and the eager op profile it writes
with each op's input shapes (what a GPU run of it reads for which convolution takes the time)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.vocoder_bench import main


def test_the_bench_writes_its_steps_and_an_op_profile_with_shapes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    assert main(["--config", str(tiny_checkpoint / "config.json"), "--device", "cpu", "--dtype", "float32",
                 "--streams", "2", "--ticks", "4", "--codes-on-device", "--profile-ops", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "vocoder_steps.json").read_text())["rows"]
    assert [(r["mode"], r["streams"]) for r in rows] == [("window", 2), ("stateful", 2)]
    assert all(r["frames_decoded_per_tick"] > 0 for r in rows)
    ops = (tmp_path / "vocoder_ops.txt").read_text()
    assert ops.startswith("# The stateful vocoder's ops, eager: 2 decodes of 8 frames for 2 streams at once")
    assert "convolution" in ops and "Input Shapes" in ops


def test_the_bench_runs_only_the_decoders_asked_for(tiny_checkpoint: Path, tmp_path: Path) -> None:
    assert main(["--config", str(tiny_checkpoint / "config.json"), "--device", "cpu", "--dtype", "float32",
                 "--streams", "2", "--ticks", "4", "--decoders", "stateful", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "vocoder_steps.json").read_text())["rows"]
    assert [(r["mode"], r["streams"]) for r in rows] == [("stateful", 2)] and rows[0]["frames_decoded_per_tick"] > 0
