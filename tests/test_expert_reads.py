"""The expert-count probe on the tiny model, on the CPU: it counts what each router picks, per layer and decode step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Qwen3OmniMoeConfig

from benchmarks import expert_reads
from omni_ray.floors import floor_ms


def test_counts_lie_between_one_rows_picks_and_every_rows(tiny_checkpoint: Path, tmp_path: Path) -> None:
    config_file = tiny_checkpoint / "config.json"
    expert_reads.main(["--config", str(config_file), "--device", "cpu", "--dtype", "float32", "--batches", "1,4",
                       "--prompt", "12", "--steps", "4", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "expert_reads.json").read_text())
    text = Qwen3OmniMoeConfig.from_json_file(str(config_file)).thinker_config.text_config
    top_k, experts, layers = int(text.num_experts_per_tok), int(text.num_experts), int(text.num_hidden_layers)
    rows = {(r["workload"], r["batch"]): r for r in document["rows"]}
    assert len(rows) == 4
    for (_, batch), row in rows.items():
        assert row["layers"] == layers
        assert top_k <= row["distinct_min"] <= row["distinct_max"] <= min(experts, top_k * batch)
        if batch == 1:  # one row reads its k experts, as the independent count says
            assert row["distinct_mean"] == top_k
            assert row["floor_ms_measured"] == pytest.approx(row["floor_ms_independent"])
    distinct, shared = rows[(expert_reads.WORKLOADS[0], 4)], rows[(expert_reads.WORKLOADS[1], 4)]
    assert distinct["distinct_mean"] > top_k  # different prompts pick different experts
    assert shared["distinct_mean"] > top_k  # so do one prompt's rows, sampled with seeds of their own
    assert distinct["floor_ms_measured"] < floor_ms(Qwen3OmniMoeConfig.from_json_file(str(config_file)), "thinker", 4,
                                                    expert_share=1.0)
    assert "| a prompt per row | 4 |" in (tmp_path / "expert_reads.md").read_text()
