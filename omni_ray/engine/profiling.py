"""Profiling a running service from the inside: when `OMNI_RAY_PROFILE_DIR` is set, each stage replica records one
window of its own steps with torch.profiler, once its batch is large enough, and writes where the time went; when
`OMNI_RAY_STEP_TRACE_DIR` is set, each engine loop and vocoder decode thread writes every step's start and parts.

The engine-only benchmarks time a step alone on a GPU; in the service the same step shares the GPU with other stages
and the host with the relay and streams. This shows the difference: wall time per step against the device time the
replica's own kernels took, and the kernels by time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

PROFILE_DIR_ENV = "OMNI_RAY_PROFILE_DIR"
PROFILE_MIN_BATCH_ENV = "OMNI_RAY_PROFILE_MIN_BATCH"  # profile once the step batch is at least this (default 1)
PROFILE_STEPS_ENV = "OMNI_RAY_PROFILE_STEPS"  # steps in the window (default 20)
SKIP_STEPS = 5  # steps at the qualifying batch size left alone first (warm caches, settled batch)
RANGE_PREFIX = "omni_ray: "
STEP_TRACE_DIR_ENV = "OMNI_RAY_STEP_TRACE_DIR"


def host_range(name: str) -> torch.profiler.record_function:
    """A named stretch of host work (`with host_range("relay"): ...`): a profiled step's report gives each one's CPU
    time including what it calls, where the op table gives only ops' own time. About a microsecond when no profiler
    records."""
    return torch.profiler.record_function(RANGE_PREFIX + name)


def cuda_allocator_stats() -> dict[str, int]:
    """This process's CUDA caching-allocator counters (cumulative; empty where CUDA is not in use): its retries (an
    allocation that failed, freed the cache and tried again: each synchronises the device, inside whatever call
    allocated) and its out-of-memory errors."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    stats = torch.cuda.memory_stats_as_nested_dict()
    return {"cuda_alloc_retries": int(stats.get("num_alloc_retries", 0)), "cuda_ooms": int(stats.get("num_ooms", 0))}


def is_kernel(event: Any) -> bool:
    """A profile's device event that is a kernel or a copy, not the device-side span of a `host_range` (which the
    profiler also records as a device event, as long as the kernels launched inside it took end to end)."""
    return event.device_type.name == "CUDA" and not event.key.startswith(RANGE_PREFIX)


class StepProfiler:
    """`with profiler.step(batch_size): ...` around each step. Inert unless `OMNI_RAY_PROFILE_DIR` is set; then the
    first `SKIP_STEPS` steps at batch ≥ min_batch pass, the next `steps` are profiled, and one report is written to
    `<dir>/<name>-<pid>.txt`. Nothing more is recorded afterwards."""

    def __init__(self, name: str, directory: str | None = None, min_batch: int | None = None, steps: int | None = None) -> None:
        self.name = name
        env_dir = directory if directory is not None else os.environ.get(PROFILE_DIR_ENV)
        self.directory = Path(env_dir) if env_dir else None
        self.min_batch = min_batch if min_batch is not None else int(os.environ.get(PROFILE_MIN_BATCH_ENV, "1"))
        self.steps = steps if steps is not None else int(os.environ.get(PROFILE_STEPS_ENV, "20"))
        self._seen = 0
        self._recorded: list[tuple[float, int]] = []  # (wall ms, batch) of profiled steps
        self._profile: Any = None
        self.report_path: Path | None = None

    @property
    def active(self) -> bool:
        return self.directory is not None and self.report_path is None

    def step(self, batch_size: int) -> AbstractContextManager[Any]:
        if not self.active or batch_size < self.min_batch:
            return nullcontext()
        self._seen += 1
        if self._seen <= SKIP_STEPS:
            return nullcontext()
        return self._profiled(batch_size)

    @contextmanager
    def _profiled(self, batch_size: int) -> Iterator[None]:
        if self._profile is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profile = profile(activities=activities)
            self._profile.__enter__()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._recorded.append(((time.perf_counter() - started) * 1000, batch_size))
            if len(self._recorded) >= self.steps:
                self._finish()

    def _finish(self) -> None:
        assert self.directory is not None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.report_path = self.directory / f"{self.name}-{os.getpid()}.txt"
        self.report_path.write_text(self.report())
        log.info("wrote the %s step profile to %s", self.name, self.report_path)

    def report(self) -> str:
        steps = len(self._recorded)
        wall = sum(ms for ms, _ in self._recorded) / steps
        batch = sum(b for _, b in self._recorded) / steps
        events = self._profile.key_averages()
        device = [e for e in events if is_kernel(e)]
        device_ms = sum(e.self_device_time_total for e in device) / steps / 1000
        kernels = sum(e.count for e in device) / steps
        host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
        ranges = sorted((e for e in events if e.key.startswith(RANGE_PREFIX)), key=lambda e: e.key)
        lines = [f"# {self.name}: {steps} steps in the service, mean batch {batch:.1f}",
                 f"wall per step {wall:.2f} ms; this replica's device time per step {device_ms:.2f} ms "
                 f"({kernels:.0f} kernels); host-side (CPU) ops below", "",
                 self._profile.key_averages().table(sort_by="self_cuda_time_total" if device else "self_cpu_time_total",
                                                    row_limit=25, max_name_column_width=70),
                 "## host: top ops by self CPU time",
                 *[f"{e.self_cpu_time_total / steps / 1000:8.3f} ms/step  {e.count / steps:7.1f} calls/step  {e.key[:90]}"
                   for e in host[:15]],
                 "## host: named stretches (`host_range`), CPU time including what they call",
                 *[f"{e.cpu_time_total / steps / 1000:8.3f} ms/step  {e.count / steps:7.1f} calls/step  "
                   f"{e.key[len(RANGE_PREFIX):]}" for e in ranges]]
        return "\n".join(lines) + "\n"


class StepTrace:
    """Every step of one engine loop or decode thread as a JSON line of `<dir>/<name>-<pid>.jsonl` when
    `OMNI_RAY_STEP_TRACE_DIR` is set (inert otherwise): `t`, the wall clock (epoch s) the step began at, and what
    its caller measured. The steps of every stage process then line up on one clock (`benchmarks/step_timeline.py`):
    what each engine did while a burst of requests came in, which a window's means cannot show."""

    def __init__(self, name: str, directory: str | None = None) -> None:
        env_dir = directory if directory is not None else os.environ.get(STEP_TRACE_DIR_ENV)
        self.path = Path(env_dir) / f"{name}-{os.getpid()}.jsonl" if env_dir else None
        self._file: Any = None

    @property
    def active(self) -> bool:
        return self.path is not None

    def record(self, started: float, **fields: float | int) -> None:
        """One step that began at wall-clock `started` (epoch s); its fields rounded to the microsecond."""
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # a line at a time: a process killed at the end loses none
        values = {key: round(value, 3) if isinstance(value, float) else value for key, value in fields.items()}
        self._file.write(json.dumps({"t": round(started, 6), **values}) + "\n")
