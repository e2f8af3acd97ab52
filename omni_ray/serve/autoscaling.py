"""Serve autoscaling on each stage's own load signal (engine batch + queue), reported by its replicas."""

from __future__ import annotations

import math
from typing import Any

LOAD_METRIC = "load"  # running + waiting sequences (or active streams), per replica
KV_METRIC = "kv_occupancy"  # fraction of KV slots in use, per replica
KV_HIGH_WATER = 0.9
SAMPLES_KEY = "load_samples"  # the policy state's recent (time, load) samples, oldest first
MIN_WINDOW_S = 1.0  # the shortest look-back over which a rise is judged


def stage_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas = total stage load / target per replica (`target_ongoing_requests`).

    The load comes from `record_autoscaling_stats` of the stage replicas, so it counts what the engine is
    actually doing (running batch and admission queue), not only requests in flight at Serve's router.
    A stage whose replicas are nearly out of KV slots asks for one more replica. Serve applies
    min/max replicas, scaling factors and up/down delays on top.

    While the load is rising (the replicas' latest reports add up to more than one replica's worth,
    `target_ongoing_requests`, above the least load sampled over the look-back window: `look_back_period_s`, at
    least a second; the samples live in the policy state), the policy never asks for fewer replicas than Serve's
    current target. Serve's downscale delay counts from the first of an unbroken run of lower decisions, so asking
    for the target again ends that run: a scale-down decided while idle is not acted on once load arrives, even
    while the averaged load still lags behind it."""
    target = float(ctx.config.get_target_ongoing_requests() or 1.0)
    metrics = ctx.aggregated_metrics or {}
    per_replica = metrics.get(LOAD_METRIC) or {}
    if per_replica:
        load = float(sum(per_replica.values()))
    else:  # replicas have not reported yet: fall back to Serve's own request count
        load = float(ctx.total_num_requests)
    desired = max(load / target, 0.0)
    kv = metrics.get(KV_METRIC) or {}
    if kv and max(kv.values()) >= KV_HIGH_WATER:
        desired = max(desired, ctx.current_num_replicas + 1)
    now = _latest_load(ctx, load)
    samples = _recent_samples(ctx, now)
    if now - min(sampled for _, sampled in samples) > target:  # rising: hold what Serve is scaling to
        desired = max(desired, float(ctx.target_num_replicas))
    state = {"last_load": load, SAMPLES_KEY: samples}
    return (math.ceil(desired) if desired > 0 else 0), state


def _latest_load(ctx: Any, aggregated: float) -> float:
    """The stage's load as its replicas last reported it (the aggregated load averages the look-back window, so it
    lags a burst), or `aggregated` where Serve keeps no raw reports."""
    series = (ctx.raw_metrics or {}).get(LOAD_METRIC) or {}
    latest = [points[-1].value for points in series.values() if points]
    return float(sum(latest)) if latest else aggregated


def _recent_samples(ctx: Any, load: float) -> list[tuple[float, float]]:
    """The policy state's samples within the look-back window, plus this one."""
    now = float(ctx.current_time)
    window = max(float(getattr(ctx.config, "look_back_period_s", 0.0) or 0.0), MIN_WINDOW_S)
    previous = (ctx.policy_state or {}).get(SAMPLES_KEY) or []
    return [(float(t), float(v)) for t, v in previous if now - float(t) <= window] + [(now, load)]
