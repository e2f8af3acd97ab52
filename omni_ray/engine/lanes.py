"""Engine lanes: several engine loops in one replica, each with its own runner and CUDA stream, whose steps overlap."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from omni_ray.engine.loop import EngineLoop, Sequence

S = TypeVar("S", bound=Sequence)
O = TypeVar("O")


class EngineLanes(Generic[S, O]):
    """The `EngineLoop` interface over lanes that share a model but not its state.

    A step of a small batch is bound by kernel latency, not by the GPU's throughput. Each lane runs its own share of
    the requests in its own thread, with its own KV slots, CUDA graphs and stream. While one lane's thread waits for
    its step, the other queues its own, and the GPU runs both. A request stays in the lane that admitted it: the one
    with the fewest requests at the time. One lane is the plain engine loop.
    """

    def __init__(self, loops: list[EngineLoop[S, O]]) -> None:
        if not loops:
            raise ValueError("at least one lane")
        self.loops = loops

    @property
    def runners(self) -> list[Any]:
        return [loop.runner for loop in self.loops]

    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    def stop(self) -> None:
        for loop in self.loops:
            loop.stop()

    def add(self, seq: S) -> None:
        min(self.loops, key=lambda loop: loop.load()).add(seq)

    def abort(self, request_id: str) -> None:
        """Every lane hears it: an abort may come before its request is added, and then no lane holds it yet."""
        for loop in self.loops:
            loop.abort(request_id)

    def notify(self) -> None:
        for loop in self.loops:
            loop.notify()

    def expected_wait_s(self) -> float:
        """`EngineLoop.expected_wait_s` of the lane `add` would pick now."""
        return min(self.loops, key=lambda loop: loop.load()).expected_wait_s()

    def check_health(self) -> None:
        """`EngineLoop.check_health` for every lane."""
        for loop in self.loops:
            loop.check_health()

    def stats(self) -> dict[str, float]:
        """Counts add up over the lanes. The step time is the slowest lane's, which sets their streams' pace. The
        batch is the sequences stepped together over all lanes."""
        per_lane = [loop.stats() for loop in self.loops]
        counts = ("running", "waiting", "steps", "steps_launched_ahead", "max_batch_seen")
        total = {key: sum(stats[key] for stats in per_lane) for key in counts}
        for key in per_lane[0]:
            if key.endswith(("_p50", "_p90", "_mean")) and key != "batch_mean":
                total[key] = max(stats[key] for stats in per_lane)
        total["batch_mean"] = sum(stats["batch_mean"] for stats in per_lane)
        total["expected_wait_s"] = self.expected_wait_s()
        total["lanes"] = len(self.loops)
        return total
