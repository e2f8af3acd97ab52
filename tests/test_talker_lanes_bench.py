"""The Talker lanes benchmark on the tiny model, on the CPU: every layout's lanes step their rows at once, and the
table sets each against one lane of all the rows."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.talker_lanes_bench import main


def test_each_layout_is_timed_every_round_against_one_lane(tiny_checkpoint: Path, tmp_path: Path) -> None:
    main(["--config", str(tiny_checkpoint / "config.json"), "--device", "cpu", "--dtype", "float32",
          "--streams", "4", "--lanes", "2,4", "--prompt", "24", "--steps", "3", "--rounds", "2",
          "--max-seq-len", "64", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "talker_lanes.json").read_text())
    rows = document["rows"]
    assert [(r["lanes"], r["rows_per_lane"]) for r in rows] == [(1, 4), (2, 2), (4, 1)]
    for row in rows:
        assert len(row["frame_period_ms"]) == 2 and all(p > 0 for p in row["frame_period_ms"])
        assert all(len(steps) == row["lanes"] for steps in row["lane_step_ms"])
        # the period spans every lane: no lane's own steps took longer than it
        for period, steps in zip(row["frame_period_ms"], row["lane_step_ms"]):
            assert max(steps) <= period + 1e-6
        assert row["one_lane_best_ms"] == min(rows[0]["frame_period_ms"])
    table = (tmp_path / "talker_lanes.md").read_text()
    assert "| 4 | 1 x 4 |" in table and "| 4 | 2 x 2 |" in table and "1.00x" in table
