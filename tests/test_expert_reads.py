"""The expert-count probe on the tiny model, on the CPU: it counts what each router picks, per layer and decode step,
for the Thinker and the Talker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Qwen3OmniMoeConfig

from benchmarks import expert_reads
from omni_ray.floors import floor_ms


def test_counts_lie_between_one_rows_picks_and_every_rows(tiny_checkpoint: Path, tmp_path: Path) -> None:
    config_file = tiny_checkpoint / "config.json"
    config = Qwen3OmniMoeConfig.from_json_file(str(config_file))
    expert_reads.main(["--config", str(config_file), "--device", "cpu", "--dtype", "float32", "--batches", "1,4",
                       "--prompt", "12", "--steps", "4", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "expert_reads.json").read_text())
    rows = {(r["stage"], r["workload"], r["batch"]): r for r in document["rows"]}
    assert len(rows) == 8
    texts = {"thinker": config.thinker_config.text_config, "talker": config.talker_config.text_config}
    for (stage, _, batch), row in rows.items():
        top_k, layers = int(texts[stage].num_experts_per_tok), int(texts[stage].num_hidden_layers)
        assert row["layers"] == layers
        assert top_k <= row["distinct_min"] <= row["distinct_max"] <= min(row["experts"], top_k * batch)
        if batch == 1:  # one row reads its k experts, as the independent count says
            assert row["distinct_mean"] == top_k
            assert row["floor_ms_measured"] == pytest.approx(row["floor_ms_independent"])
        else:  # rows sampled with seeds of their own pick more than one row's experts
            assert row["distinct_mean"] > top_k
            assert row["floor_ms_measured"] <= floor_ms(config, stage, batch, expert_share=1.0)
    table = (tmp_path / "expert_reads.md").read_text()
    assert "| thinker | a prompt per row | 4 |" in table and "| talker | one prompt, a seed per row | 4 |" in table
