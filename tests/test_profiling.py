"""The in-service step profiler: inert by default; with a directory it skips the first steps at the qualifying
batch size, records one window of steps and writes one report of where their time went (CPU here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_ray.engine.profiling import RANGE_PREFIX, SKIP_STEPS, StepProfiler, host_range, is_kernel


def _work() -> None:
    a = torch.randn(64, 64)
    with host_range("three products"):
        for _ in range(3):
            a = a @ a.T / 64


def test_inert_without_a_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_RAY_PROFILE_DIR", raising=False)
    profiler = StepProfiler("thinker")
    assert not profiler.active
    for _ in range(30):
        with profiler.step(8):
            _work()
    assert profiler.report_path is None


def test_one_window_of_large_enough_steps_is_reported(tmp_path: Path) -> None:
    profiler = StepProfiler("talker", directory=str(tmp_path), min_batch=4, steps=6)
    for batch in [1, 2, 3] * 5:  # too small: never counted
        with profiler.step(batch):
            _work()
    assert profiler.active and not list(tmp_path.iterdir())
    for _ in range(SKIP_STEPS + 6 + 10):
        with profiler.step(8):
            _work()
    reports = list(tmp_path.iterdir())
    assert reports == [profiler.report_path] and not profiler.active  # one report, then nothing more
    text = reports[0].read_text()
    assert "talker: 6 steps in the service, mean batch 8.0" in text
    assert "aten::mm" in text and "wall per step" in text
    named = text.split("## host: named stretches")[1].splitlines()[1:]
    assert len(named) == 1 and named[0].endswith("1.0 calls/step  three products"), named  # with its 3 products


def test_a_named_stretch_is_not_counted_as_a_kernel() -> None:
    """With CUDA activity the profiler records each `host_range` as a device event too, spanning its kernels: the
    device time per step counts only kernels and copies."""
    device = SimpleNamespace(name="CUDA")
    assert is_kernel(SimpleNamespace(key="_rows_matmul_kernel", device_type=device))
    assert is_kernel(SimpleNamespace(key="Memcpy HtoD (Pinned -> Device)", device_type=device))
    assert not is_kernel(SimpleNamespace(key=RANGE_PREFIX + "launch", device_type=device))
    assert not is_kernel(SimpleNamespace(key="aten::mm", device_type=SimpleNamespace(name="CPU")))


def test_the_wave_profile_prefills_a_later_wave_in_one_step_beside_the_decodes(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """`profile_step --wave K` (a burst's later wave) on the tiny Thinker, on the CPU: three requests decode, then a
    wave of two arrives twice (an untimed step, then the profiled one); each wave is one prefill batch."""
    from transformers import Qwen3OmniMoeConfig

    from benchmarks.profile_step import profile_wave
    from omni_ray.bench import benchmark_prompt_ids
    from omni_ray.engine.kv_cache import SlotKVCache
    from omni_ray.engine.sampler import SamplingParams
    from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

    config = Qwen3OmniMoeConfig.from_pretrained(tiny_checkpoint)
    text = config.thinker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, 8, 256, text.num_key_value_heads, text.head_dim, torch.float32, "cpu")
    runner = ThinkerRunner(load_thinker(tiny_checkpoint, config, "cpu", torch.float32), config, cache)

    def prompt(i: int) -> ThinkerSequence:
        return ThinkerSequence(f"p{i}", benchmark_prompt_ids(config, 20, i), SamplingParams(temperature=0.0), 16,
                               frozenset(), for_talker=True)

    profile_wave(runner, prompt, running=3, wave=2)
    assert (runner.prefills.batches, runner.prefills.sequences) == (3, 3 + 2 + 2)
    assert runner.cache.used_slots == 0  # every request released
    report = capsys.readouterr().out
    assert "## thinker decode alone, batch 3" in report and "## thinker wave step: prefill 2 + decode 3" in report
