"""A small named actor where every stage replica posts its load, read by the ingress for /metrics and /ready."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import ray

BOARD_NAME = "omni-ray-stats"
REPORT_PERIOD_S = 0.25
STALE_AFTER_S = 3.0
# /ready counts a replica only while its reports keep coming: three missed reports, and its stage is gone.
READY_AFTER_S = 3 * REPORT_PERIOD_S


@ray.remote(num_cpus=0)
class StatsBoard:
    """Latest stats per replica; replicas that stop reporting disappear after STALE_AFTER_S."""

    def __init__(self) -> None:
        self._stats: dict[str, tuple[float, dict[str, Any]]] = {}

    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        self._stats[replica_id] = (time.time(), stats)

    def snapshot(self, max_age_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Every replica's latest stats; with `max_age_s`, only those of replicas that reported that recently."""
        now = time.time()
        cutoff = now - STALE_AFTER_S
        self._stats = {rid: (t, s) for rid, (t, s) in self._stats.items() if t >= cutoff}
        fresh = now - (STALE_AFTER_S if max_age_s is None else max_age_s)
        return {rid: s for rid, (t, s) in self._stats.items() if t >= fresh}


def current_app_name() -> str:
    """The Serve application this replica belongs to ('' outside Serve)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().app_name or "")
    except Exception:
        return ""


def serve_replica_id() -> str | None:
    """This Serve replica's unique id (None outside Serve)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not a Serve replica
        return None


def serve_deployment_name() -> str | None:
    """This Serve replica's deployment (None outside Serve)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().deployment)
    except Exception:  # not a Serve replica
        return None


def stats_board(app_name: str | None = None) -> Any:
    """The board of one Serve application (each app sees only its own replicas), created on first use."""
    app = current_app_name() if app_name is None else app_name
    return StatsBoard.options(
        name=f"{BOARD_NAME}-{app}", namespace="omni-ray", get_if_exists=True, lifetime="detached"
    ).remote()


class StatsReporter:
    """Background thread posting `collect()` to the board every REPORT_PERIOD_S, with the replica's deployment (under
    Serve): /ready tells one model's stages from another's by it."""

    def __init__(self, replica_id: str, collect: Callable[[], dict[str, Any]]) -> None:
        self.replica_id = replica_id
        self.collect = collect
        deployment = serve_deployment_name()
        self.identity = {} if deployment is None else {"deployment": deployment}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        board = None
        while not self._stop.wait(REPORT_PERIOD_S):
            try:
                board = board or stats_board()
                board.report.remote(self.replica_id, {**self.collect(), **self.identity})
            except Exception:  # the board is best effort: serving never waits on it
                board = None

    def stop(self) -> None:
        self._stop.set()
