"""Shared body of the autoscaling tests: streaming load raises the Talker's replica count, which falls back once the
load is light; every request completes. Used on CPU (host path and gloo pairs) and on two GPUs (NCCL pairs)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import httpx
from ray import serve

from omni_ray.serve.app import LOAD_POLICY, build_app

TALKER_SCALING = {
    "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
        "upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "look_back_period_s": 1.0,
        "policy": {"policy_function": LOAD_POLICY},
    }
}


def talker_replicas(app: str) -> int:
    status = serve.status().applications[app].deployments["talker"]
    return int(status.replica_states.get("RUNNING", 0))


def _talker_state(app: str) -> str:
    """What Serve says of the Talker deployment, and what the cluster has free (a replica that cannot be placed shows
    here), for a failure message."""
    import ray

    status = serve.status().applications[app].deployments["talker"]
    return f"status {status.status}, replicas {dict(status.replica_states)}, {status.message!r}; free {ray.available_resources()}"


def thinker_relay(app: str) -> dict[str, int]:
    return serve.get_deployment_handle("thinker", app_name=app).relay_stats.remote().result(timeout_s=30)


def stream_one(url: str, prefix: str, results: list[dict[str, Any]]) -> None:
    """One streamed text + audio chat completion; records its status, [DONE] and audio chunk count."""
    body = {
        "model": "qwen3-omni", "messages": [{"role": "user", "content": "Keep talking for a while."}],
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
        "max_completion_tokens": 40, "temperature": 0.8,
    }
    record: dict[str, Any] = {"status": None, "done": False, "audio_chunks": 0}
    try:
        with httpx.stream("POST", f"{url}{prefix}/v1/chat/completions", json=body, timeout=120) as response:
            record["status"] = response.status_code
            for line in response.iter_lines():
                record["done"] |= line == "data: [DONE]"
                record["audio_chunks"] += '"audio":{"id"' in line and '"data"' in line
    except Exception as exc:  # recorded, asserted below
        record["error"] = repr(exc)
    results.append(record)


def wait_for_route(url: str, prefix: str, seconds: float = 30.0) -> None:
    """Until the HTTP proxy routes `prefix` to its new application: `serve.run` returns once the application runs,
    and the proxy learns the route a moment later (requests in between reach the app mounted at `/`: a 404)."""

    def routed() -> bool:
        try:
            return httpx.get(f"{url}{prefix}/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert _wait_until(routed, seconds), f"the proxy never routed {prefix}"


def _wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.25)
    return condition()


def scale_talker_up_and_down(url: str, app: str, prefix: str, pipeline: dict[str, Any], collective: bool) -> int:
    """Deploys `pipeline` with an autoscaled Talker, drives it 1 → 2 → 1 replicas under streaming load and asserts
    that no request failed. With `collective`, the Thinker must open a pairwise group to the new replica and drop it
    when the replica leaves. Returns the number of completed requests."""
    serve.run(build_app({"model_name": "qwen3-omni", "pipeline": pipeline, "stage_options": {"talker": TALKER_SCALING}}),
              name=app, route_prefix=prefix)
    try:
        wait_for_route(url, prefix)
        assert talker_replicas(app) == 1
        results: list[dict[str, Any]] = []
        stop = threading.Event()

        def keep_busy() -> None:
            while not stop.is_set():
                stream_one(url, prefix, results)

        workers = [threading.Thread(target=keep_busy) for _ in range(4)]
        for worker in workers:
            worker.start()
        deadline, peak, pairs_peak = time.time() + 90, 1, 0
        while time.time() < deadline and (peak < 2 or (collective and pairs_peak < 2)):
            peak = max(peak, talker_replicas(app))
            pairs_peak = max(pairs_peak, thinker_relay(app)["collective_pairs"])
            time.sleep(0.25)
        stop.set()
        for worker in workers:
            worker.join(timeout=120)
        assert peak == 2, f"the Talker never scaled up under load: {_talker_state(app)}"
        if collective:  # the new replica got its own pairwise group, with no Thinker restart
            assert pairs_peak == 2, f"the Thinker opened {pairs_peak} pairwise group(s): {_talker_state(app)}"
        # Light load (one stream at a time) continues while the Talker scales back down.
        stop.clear()
        light = threading.Thread(target=keep_busy)
        light.start()
        scaled_down = _wait_until(lambda: talker_replicas(app) == 1, 90)
        time.sleep(1.0)  # let a request start on the remaining replica too
        stop.set()
        light.join(timeout=120)
        assert scaled_down, f"the Talker never scaled back down: {_talker_state(app)}"
        assert results and all(r["status"] == 200 and r["done"] and r["audio_chunks"] > 0 for r in results), results
        if collective:  # the departed replica's group was torn down
            assert _wait_until(lambda: thinker_relay(app)["collective_pairs"] == 1, 30)
        else:
            assert thinker_relay(app)["collective_pairs"] == 0
        return len(results)
    finally:
        serve.delete(app)
