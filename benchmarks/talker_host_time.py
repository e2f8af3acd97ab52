"""Where a Talker step's host time goes: each stretch of `TalkerRunner.launch`, timed on the host, per batch size.

The engine benchmark gives the host's whole time per launched-ahead step; this splits it. The runner is the
service's (compiled layers, Triton kernels, CUDA graphs, the served sampling), fed as `omni_ray.bench` feeds it, and
its steps are launched ahead as the engine loop launches them. Each named stretch is a runner method, a function
the runner calls or one of torch's own (every call of it in the timed steps), wrapped with a clock and put back
afterwards; nested stretches count in their callers too.

    python -m benchmarks.talker_host_time --batches 1,8,32 --steps 100 --out results/
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DTYPES, FULL_CONFIG, _talker_seqs, launched_ahead, run_meta, write_results
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.models.qwen3_omni import talker as talker_module
from omni_ray.models.qwen3_omni.orchestrator import DEFAULT_TALKER_SAMPLING
from omni_ray.models.qwen3_omni.talker import TalkerRunner
from omni_ray.models.qwen3_omni.talker_model import load_talker

# (stretch, where it lives, attribute): what `SectionClock` wraps, in the table's order
STRETCHES = (
    ("launch", "runner", "launch"),
    ("frame host inputs", "runner", "_frame_host_inputs"),
    ("decode positions", "module", "decode_positions"),
    ("upload", "module", "upload"),
    ("decode", "runner", "_decode"),
    ("trailing texts", "runner", "_trailing_texts"),
    ("frames", "runner", "_frames"),
    ("frame inputs", "runner", "_frame_inputs"),
    ("graph replays", "graphs", "run"),
    ("codes download", "module", "Download"),
    # torch's own, wherever the launch calls them (the upload's staging, pinning and copy among them)
    ("torch.cat, all calls", "torch", "cat"),
    ("Tensor.pin_memory, all calls", "tensor", "pin_memory"),
    ("Tensor.to, all calls", "tensor", "to"),
)


class SectionClock:
    """Wraps callables on objects with a host clock: `seconds[name]` and `calls[name]` accumulate while `running`,
    `longest[name]` is the slowest call."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.longest: dict[str, float] = defaultdict(float)
        self.running = False
        self._wrapped: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.running:
                return inner(*args, **kwargs)
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                self.seconds[name] += took
                self.calls[name] += 1
                self.longest[name] = max(self.longest[name], took)

        self._wrapped.append((owner, attribute, owner.__dict__.get(attribute) if isinstance(owner, type) else inner))
        setattr(owner, attribute, timed)

    def unwrap_all(self) -> None:
        """Put back what `wrap` replaced (a class's inherited method by deleting the wrapper)."""
        for owner, attribute, original in reversed(self._wrapped):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        self._wrapped.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.longest.clear()


def measure(config: Any, device: str, dtype: torch.dtype, batches: list[int], prompt: int, steps: int,
            persistent: bool) -> list[dict[str, Any]]:
    text = config.talker_config.text_config
    runner = TalkerRunner(
        load_talker(None, config, device, dtype), config,
        SlotKVCache(text.num_hidden_layers, max(batches), prompt + 2 * steps + 64, text.num_key_value_heads,
                    text.head_dim, dtype, device),
        max(batches), compile_layers=True, persistent_code_predictor=persistent,
    )
    clock = SectionClock()
    owners = {"runner": runner, "module": talker_module, "graphs": runner.graphs, "torch": torch, "tensor": torch.Tensor}
    for name, where, attribute in STRETCHES:
        clock.wrap(owners[where], attribute, name)
    try:
        return _measure_batches(runner, clock, config, device, dtype, batches, prompt, steps)
    finally:
        clock.unwrap_all()


def _measure_batches(runner: TalkerRunner, clock: SectionClock, config: Any, device: str, dtype: torch.dtype,
                     batches: list[int], prompt: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        for timed in (False, True):  # the untimed pass captures every graph the timed one replays (same key ranges)
            seqs = _talker_seqs(config, batch, prompt, 2 * steps, DEFAULT_TALKER_SAMPLING, device, dtype)
            for seq in seqs:
                runner.admit(seq)
            runner.step(seqs)  # the prefill
            clock.reset()
            clock.running = timed
            torch.cuda.synchronize() if device.startswith("cuda") else None
            started = time.perf_counter()
            launched_ahead(runner.launch, runner.collect, seqs, steps)  # the launch as wrapped
            torch.cuda.synchronize() if device.startswith("cuda") else None
            wall = time.perf_counter() - started
            clock.running = False
            for seq in seqs:
                runner.release(seq)
        rows.append({"batch": batch, "steps": steps, "step_ms": 1000 * wall / steps,
                     "ms_per_step": {name: 1000 * clock.seconds[name] / steps for name, _, _ in STRETCHES},
                     "calls_per_step": {name: clock.calls[name] / steps for name, _, _ in STRETCHES},
                     "slowest_call_ms": {name: 1000 * clock.longest[name] for name, _, _ in STRETCHES}})
        print(rows[-1], flush=True)
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Where a Talker step's host time goes ({meta['gpu']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, dtype {meta['dtype']}, compiled layers, CUDA "
             f"graphs, the served sampling{', persistent code-predictor pass' if meta['persistent'] else ''}; steps "
             "launched ahead as the engine loop runs them", "",
             "Host ms per step in each stretch (nested ones count in their callers too), its calls per step and its "
             "slowest call (ms); step: the wall time per launched-ahead step.", "",
             "| stretch | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    lines.append("| step (wall) | " + " | ".join(f"{r['step_ms']:.2f}" for r in rows) + " |")
    for name, _, _ in STRETCHES:
        lines.append(f"| {name} | " + " | ".join(
            f"{r['ms_per_step'][name]:.3f} ({r['calls_per_step'][name]:g}x, max {r['slowest_call_ms'][name]:.2f})"
            for r in rows) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(FULL_CONFIG))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--persistent-code-predictor", action="store_true")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default="talker_host_time")
    a = ap.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(a.config)
    rows = measure(config, a.device, DTYPES[a.dtype], [int(b) for b in a.batches.split(",")], a.prompt, a.steps,
                   a.persistent_code_predictor)
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    meta = run_meta("benchmarks.talker_host_time", argv, gpu=gpu, dtype=a.dtype, persistent=a.persistent_code_predictor)
    write_results(Path(a.out), a.stem, {**meta, "rows": rows}, markdown(meta, rows))


if __name__ == "__main__":
    main()
