"""Per-stage autoscaling: load on the Talker raises its replica count, which falls back after the load.
Every request in flight completes, over the host-path relay and over pairwise collective groups (gloo on CPU)
that the Thinker opens to each new Talker replica and drops when it leaves."""

from __future__ import annotations

import pytest
from _scaling import scale_talker_up_and_down


@pytest.mark.parametrize("relay", ["auto", "collective"])
def test_talker_scales_up_under_load_and_back_down(serve_url: str, relay: str) -> None:
    pipeline = {"stages": {"thinker": {"relay": relay}}}
    completed = scale_talker_up_and_down(serve_url, "scaling", "/scaling", pipeline, collective=relay == "collective")
    print(f"\n{completed} requests completed across the scale-up and scale-down, none failed")
