"""The engine benchmark on the tiny model, on the CPU: its rows decode different tokens (as a service's streams do),
and its table gives each step's ratio to the bandwidth floor at that batch."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray import bench
from omni_ray.bench import benchmark_prompt_ids, main
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker


def test_a_batchs_rows_decode_different_tokens(tiny_checkpoint: Path) -> None:
    config = Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint)
    text = config.thinker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, 4, 64, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    runner = ThinkerRunner(load_thinker(None, config, "cpu", torch.float32), config, cache, cuda_graphs=False)
    seqs = [ThinkerSequence(f"r{i}", benchmark_prompt_ids(config, 24, i), SamplingParams(temperature=0.0), 6, frozenset())
            for i in range(4)]
    for seq in seqs:
        runner.admit(seq)
    for _ in range(6):
        runner.step(seqs)
    replies = {tuple(seq.output_ids) for seq in seqs}
    assert len(replies) == 4, replies  # one prompt for all would decode one reply four times


def test_talker_inputs_sit_where_the_one_gpu_relay_hands_them_over() -> None:
    """A burst's prefix states as large as CUDA IPC's messages on the runner's device, a smaller one's on the host (the
    host path), reply tokens always on the host; all in the model's dtype. ("meta" stands in for a GPU.)"""
    config = Qwen3OmniMoeConfig.from_json_file(bench.FULL_CONFIG)
    hidden = config.talker_config.thinker_hidden_size
    burst = bench._talker_seqs(config, 32, 100, 2, device="meta", dtype=torch.bfloat16)
    alone = bench._talker_seqs(config, 1, 100, 2, device="meta", dtype=torch.bfloat16)
    assert 32 * 103 * hidden * 2 >= bench.IPC_FROM_BYTES > 103 * hidden * 2  # the two sides of the rule
    for seqs, where in ((burst, "meta"), (alone, "cpu")):
        for seq in seqs:
            assert all(t.device.type == where for t in seq.prefix.values())
            assert seq.prefix["user_states"].dtype == seq.prefix["assistant_prefix"].dtype == torch.bfloat16
            assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in seq.text_embeds)


def test_the_table_gives_the_floor_at_each_batch(tiny_checkpoint: Path, tmp_path: Path) -> None:
    main(["--config", str(tiny_checkpoint / "config.json"), "--device", "cpu", "--dtype", "float32", "--eager",
          "--batches", "1,4", "--prompt", "24", "--steps", "3", "--max-seq-len", "64", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "engine_steps.json").read_text())["rows"]
    assert [(r["stage"], r["batch"]) for r in rows] == [("thinker", 1), ("thinker", 4), ("talker", 1), ("talker", 4)]
    for stage in ("thinker", "talker"):
        one, four = (r["floor_ms"] for r in rows if r["stage"] == stage)
        assert 0 < one < four  # four rows pick more experts than one
    for row in rows:  # both runners launch ahead: the host's share of a launched step is measured
        assert 0 < row["host_ms_per_launch"] and row["host_syncs_per_launch"] == 0  # no sync counting off CUDA
    table = (tmp_path / "engine_steps.md").read_text()
    assert "floor at this batch (ms)" in table and table.count("| thinker |") == 2


def test_the_launch_clock_counts_syncs_and_says_where_they_were_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    class Runner:
        def launch(self, seqs: list[int]) -> str:
            warnings.warn("called a synchronizing CUDA operation")  # what torch's sync debug mode says
            warnings.warn("something else")
            return "pending"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    clock = bench._LaunchClock(Runner(), count_syncs=True)
    assert clock.launch([1]) == "pending" and clock.launch([1]) == "pending"
    assert (clock.launches, clock.syncs) == (2, 2)
    [(site, count)] = clock.sync_sites.items()
    assert count == 2 and site.startswith(__file__)  # no omni_ray frame asked for it: the warning's own place


def test_results_name_the_commit_and_mark_a_work_tree_that_differs_from_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results files record $OMNI_RAY_COMMIT when set, else the repository's HEAD, with `+changes` when tracked files
    differ from it: a work tree copied beside a stale .git does not pass for the older commit."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    monkeypatch.delenv("OMNI_RAY_COMMIT", raising=False)
    assert bench.source_commit(tmp_path) == "unknown"  # no repository
    git("init", "-q")
    (tmp_path / "kernel.py").write_text("three stages\n")
    git("add", "kernel.py")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "--short", "HEAD")
    assert bench.source_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert bench.source_commit(tmp_path) == head
    (tmp_path / "kernel.py").write_text("four stages\n")
    assert bench.source_commit(tmp_path) == f"{head}+changes"
    monkeypatch.setenv("OMNI_RAY_COMMIT", "abc1234")
    assert bench.source_commit(tmp_path) == "abc1234"
