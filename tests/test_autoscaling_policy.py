"""The stage load policy under Serve's own delay logic: a scale-down decided while idle is not acted on once load
arrives (its look-back over recent load samples), and scale-down still follows a lasting fall in load."""

from __future__ import annotations

from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from omni_ray.serve.autoscaling import SAMPLES_KEY, stage_load_policy

CONFIG = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=8, upscale_delay_s=3,
                           downscale_delay_s=30, look_back_period_s=10)


class Controller:
    """Calls the policy as Serve's controller does (wrapped with Serve's factors, bounds and delays), each tick on a
    clock of its own, and keeps the policy state and the target between calls."""

    def __init__(self, replicas: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        self.replicas = replicas
        self.state: dict[str, Any] = {}
        self.policy = _apply_autoscaling_config(stage_load_policy)
        monkeypatch.setattr("ray.serve.autoscaling_policy.time.time", lambda: self.now)

    def tick(self, averaged: float, latest: float, seconds: float = 1.0) -> int:
        """One decision after `seconds`: `averaged` is the replicas' load averaged over the look-back window (what
        Serve aggregates), `latest` their last reports. Applies the decision and returns it."""
        self.now += seconds
        replicas = [f"r{i}" for i in range(self.replicas)]
        ctx = AutoscalingContext(
            deployment_id=DeploymentID("talker", "app"), deployment_name="talker", app_name="app",
            current_num_replicas=self.replicas, target_num_replicas=self.replicas, running_replicas=replicas,
            total_num_requests=averaged, total_queued_requests=0.0,
            aggregated_metrics={"load": {r: averaged / len(replicas) for r in replicas}},
            raw_metrics={"load": {r: [TimeStampedValue(self.now - 0.5, latest / len(replicas))] for r in replicas}},
            capacity_adjusted_min_replicas=CONFIG.min_replicas, capacity_adjusted_max_replicas=CONFIG.max_replicas,
            policy_state=dict(self.state), last_scale_up_time=None, last_scale_down_time=None,
            current_time=self.now, config=CONFIG,
        )
        decision, self.state = self.policy(ctx)
        self.replicas = max(CONFIG.min_replicas, min(CONFIG.max_replicas, decision))
        return self.replicas


def test_a_scale_down_decided_while_idle_is_not_acted_on_once_a_burst_arrives(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = Controller(replicas=2, monkeypatch=monkeypatch)
    for _ in range(29):  # idle for 29 s: a scale-down to 1 is pending, its 30 s delay over in 1 s
        assert serve.tick(averaged=0, latest=0) == 2
    # The burst: 64 requests reach the replicas, whose averaged load still lags (4, i.e. one replica's worth) while
    # the downscale delay runs out. The look-back sees the rise and holds the two replicas.
    decisions = [serve.tick(averaged=averaged, latest=64) for averaged in (4, 4, 6, 8)]
    assert decisions == [2, 2, 2, 2]
    assert serve.tick(averaged=64, latest=64, seconds=3) >= 2  # then the load averages in; never fewer than 2
    assert len(serve.state[SAMPLES_KEY]) <= 11  # only the look-back window's samples are kept


def test_the_same_lagging_reports_without_a_rise_scale_down_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the look-back guards against: averaged load one replica's worth after an idle 30 s, no burst behind it,
    is a scale-down, acted on once the delay has run."""
    serve = Controller(replicas=2, monkeypatch=monkeypatch)
    for _ in range(29):
        assert serve.tick(averaged=0, latest=0) == 2
    assert [serve.tick(averaged=4, latest=4) for _ in range(2)] == [2, 1]  # the 30 s delay ends at the second


def test_after_a_rise_scale_down_waits_a_whole_delay_from_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = Controller(replicas=2, monkeypatch=monkeypatch)
    for _ in range(29):
        serve.tick(averaged=0, latest=0)
    serve.tick(averaged=4, latest=64)  # the rise resets the pending scale-down
    decisions = [serve.tick(averaged=4, latest=4) for _ in range(40)]  # then light, flat load
    assert decisions[0] == 2  # the pending scale-down did not survive the rise
    first_down = decisions.index(1)
    assert 25 <= first_down <= 35, decisions  # a whole delay after the rise left the look-back window


def test_small_fluctuations_do_not_hold_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    """Light load that comes and goes (0 to 8, one replica's worth) is not a rise: the scale-down goes ahead."""
    serve = Controller(replicas=2, monkeypatch=monkeypatch)
    decisions = [serve.tick(averaged=4, latest=8 * (i % 2)) for i in range(40)]
    assert 1 in decisions and decisions.index(1) <= 31, decisions
