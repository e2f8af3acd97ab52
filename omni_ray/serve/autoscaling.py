"""Serve autoscaling on each stage's own load signal (engine batch + queue), reported by its replicas."""

from __future__ import annotations

import math
from typing import Any

LOAD_METRIC = "load"  # running + waiting sequences (or active streams), per replica
KV_METRIC = "kv_occupancy"  # fraction of KV slots in use, per replica
KV_HIGH_WATER = 0.9


def stage_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas = total stage load / target per replica (`target_ongoing_requests`).

    The load comes from `record_autoscaling_stats` of the stage replicas, so it counts what the engine is
    actually doing (running batch and admission queue), not only requests in flight at Serve's router.
    A stage whose replicas are nearly out of KV slots asks for one more replica. Serve applies
    min/max replicas, scaling factors and up/down delays on top."""
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
    return (math.ceil(desired) if desired > 0 else 0), {"last_load": load}
