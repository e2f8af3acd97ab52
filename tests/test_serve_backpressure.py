"""Full stage queues answer 503 with Retry-After in the OpenAI envelope; the service keeps serving."""

from __future__ import annotations

import concurrent.futures

import httpx
from ray import serve

from omni_ray.serve.app import build_app
from _scaling import wait_for_route

APP, PREFIX = "tight", "/tight"
BODY = {
    "model": "qwen3-omni", "messages": [{"role": "user", "content": "Talk for a while."}],
    "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "max_completion_tokens": 40,
}


def test_full_queue_is_503_with_retry_after(serve_url: str) -> None:
    tight = {"thinker": {"max_ongoing_requests": 1, "max_queued_requests": 1}}
    serve.run(build_app({"model_name": "qwen3-omni", "stage_options": tight}), name=APP, route_prefix=PREFIX)
    try:
        wait_for_route(serve_url, PREFIX)
        url = f"{serve_url}{PREFIX}/v1/chat/completions"
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: httpx.post(url, json=BODY, timeout=120), range(8)))
        statuses = sorted(r.status_code for r in responses)
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}, statuses
        for response in responses:
            if response.status_code == 503:
                assert int(response.headers["retry-after"]) >= 1
                error = response.json()["error"]
                assert error["type"] == "server_error" and error["code"] == "overloaded"
        after = httpx.post(url, json={**BODY, "max_completion_tokens": 4}, timeout=120)
        assert after.status_code == 200
    finally:
        serve.delete(APP)
