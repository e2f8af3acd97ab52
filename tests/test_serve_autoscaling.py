"""Per-stage autoscaling: load on the Talker raises its replica count, which falls back after the load.
Every request in flight completes, over the host-path relay and over pairwise collective groups (gloo on CPU)
that the Thinker opens to each new Talker replica and drops when it leaves."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from ray import serve

from omni_ray.serve.app import LOAD_POLICY, build_app

APP, PREFIX = "scaling", "/scaling"
TALKER_SCALING = {
    "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
        "upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "look_back_period_s": 1.0,
        "policy": {"policy_function": LOAD_POLICY},
    }
}


def _talker_replicas() -> int:
    status = serve.status().applications[APP].deployments["talker"]
    return int(status.replica_states.get("RUNNING", 0))


def _stream_one(url: str, results: list[dict[str, Any]]) -> None:
    body = {
        "model": "qwen3-omni", "messages": [{"role": "user", "content": "Keep talking for a while."}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
        "max_completion_tokens": 40, "temperature": 0.8,
    }
    record: dict[str, Any] = {"status": None, "done": False, "audio_chunks": 0}
    try:
        with httpx.stream("POST", f"{url}{PREFIX}/v1/chat/completions", json=body, timeout=120) as response:
            record["status"] = response.status_code
            for line in response.iter_lines():
                record["done"] |= line == "data: [DONE]"
                record["audio_chunks"] += '"audio":{"id"' in line and '"data"' in line
    except Exception as exc:  # recorded, asserted below
        record["error"] = repr(exc)
    results.append(record)


def _thinker_relay() -> dict[str, int]:
    return serve.get_deployment_handle("thinker", app_name=APP).relay_stats.remote().result(timeout_s=30)


@pytest.mark.parametrize("relay", ["auto", "collective"])
def test_talker_scales_up_under_load_and_back_down(serve_url: str, relay: str) -> None:
    pipeline = {"stages": {"thinker": {"relay": relay}}}
    serve.run(build_app({"model_name": "qwen3-omni", "pipeline": pipeline, "stage_options": {"talker": TALKER_SCALING}}),
              name=APP, route_prefix=PREFIX)
    try:
        assert _talker_replicas() == 1
        results: list[dict[str, Any]] = []
        stop = threading.Event()

        def keep_busy() -> None:
            while not stop.is_set():
                _stream_one(serve_url, results)

        workers = [threading.Thread(target=keep_busy) for _ in range(4)]
        for worker in workers:
            worker.start()
        deadline, peak, pairs_peak = time.time() + 90, 1, 0
        while time.time() < deadline and (peak < 2 or (relay == "collective" and pairs_peak < 2)):
            peak = max(peak, _talker_replicas())
            pairs_peak = max(pairs_peak, _thinker_relay()["collective_pairs"])
            time.sleep(0.25)
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
        assert peak == 2, "the Talker never scaled up under load"
        if relay == "collective":  # the new replica got its own pairwise group, with no Thinker restart
            assert pairs_peak == 2
        # Light load (one stream at a time) continues while the Talker scales back down.
        stop.clear()
        light = threading.Thread(target=keep_busy)
        light.start()
        deadline = time.time() + 90
        while _talker_replicas() > 1 and time.time() < deadline:
            time.sleep(0.25)
        scaled_down = _talker_replicas() == 1
        time.sleep(1.0)  # let a request start on the remaining replica too
        stop.set()
        light.join(timeout=120)
        assert scaled_down, "the Talker never scaled back down"
        assert results and all(r["status"] == 200 and r["done"] and r["audio_chunks"] > 0 for r in results), results
        if relay == "collective":  # the departed replica's group was torn down
            deadline = time.time() + 30
            while _thinker_relay()["collective_pairs"] > 1 and time.time() < deadline:
                time.sleep(0.25)
            assert _thinker_relay()["collective_pairs"] == 1
        else:
            assert _thinker_relay()["collective_pairs"] == 0
        print(f"\n{len(results)} requests completed across the scale-up and scale-down, none failed")
    finally:
        serve.delete(APP)
