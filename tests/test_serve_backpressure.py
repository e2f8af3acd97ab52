"""Full stage queues answer 503 with Retry-After in the OpenAI envelope, at once, and the service keeps serving (and
stays ready) through a burst."""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter

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


BURST = 160
BURST_APP, BURST_PREFIX = "burst", "/burst"
# A Talker of two slots that refuses a request expected to wait over 0.3 s for one, behind a Serve queue of 12; a
# Thinker whose Serve queue takes the whole burst, so that a request refused by the Talker would wait behind the
# Thinker's queue if the opens waited for each other.
BURST_PIPELINE = {"stages": {"talker": {"engine": {"max_batch": 2, "max_queue_wait_s": 0.3}}}}
BURST_OPTIONS = {"thinker": {"max_ongoing_requests": 16, "max_queued_requests": 2 * BURST},
                 "talker": {"max_ongoing_requests": 8, "max_queued_requests": 4}}


async def _burst(url: str) -> tuple[list[tuple[float, float, httpx.Response]], list[tuple[float, int]]]:
    """Fires BURST requests at once while polling /ready every 0.1 s; returns each request's (sent, answered,
    response) and each poll's (latency, status)."""
    import asyncio

    body = {**BODY, "max_completion_tokens": 4}
    limits = httpx.Limits(max_connections=BURST + 8, max_keepalive_connections=BURST + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one() -> tuple[float, float, httpx.Response]:
            sent = time.perf_counter()
            response = await client.post(f"{url}{BURST_PREFIX}/v1/chat/completions", json=body)
            return sent, time.perf_counter(), response

        polls: list[tuple[float, int]] = []
        done = asyncio.Event()

        async def poll_ready() -> None:
            while not done.is_set():
                asked = time.perf_counter()
                status = (await client.get(f"{url}{BURST_PREFIX}/ready")).status_code
                polls.append((time.perf_counter() - asked, status))
                await asyncio.sleep(0.1)

        poller = asyncio.create_task(poll_ready())
        results = await asyncio.gather(*(one() for _ in range(BURST)))
        done.set()
        await poller
    return results, polls


def test_a_burst_is_refused_at_once_and_ready_stays_true(serve_url: str) -> None:
    import asyncio

    app = build_app({"model_name": "qwen3-omni", "pipeline": BURST_PIPELINE, "stage_options": BURST_OPTIONS})
    serve.run(app, name=BURST_APP, route_prefix=BURST_PREFIX)
    try:
        wait_for_route(serve_url, BURST_PREFIX)
        url = f"{serve_url}{BURST_PREFIX}/v1/chat/completions"
        assert httpx.post(url, json={**BODY, "max_completion_tokens": 4}, timeout=120).status_code == 200  # warm
        results, polls = asyncio.run(_burst(serve_url))
        statuses = Counter(response.status_code for _, _, response in results)
        assert set(statuses) == {200, 503}, statuses
        refused = sorted(answered - sent for sent, answered, response in results if response.status_code == 503)
        served = sorted(answered - sent for sent, answered, response in results if response.status_code == 200)
        for _, _, response in results:
            if response.status_code == 503:
                assert int(response.headers["retry-after"]) >= 1
                assert response.json()["error"]["code"] == "overloaded"
        talker = serve.get_deployment_handle("talker", app_name=BURST_APP).stats.remote().result(timeout_s=30)
        print(f"\n{statuses[200]} served, {statuses[503]} refused ({talker['refused']} by the Talker's expected "
              f"wait); 503 after {1000 * refused[len(refused) // 2]:.0f} ms median, {1000 * refused[-1]:.0f} ms "
              f"at most; 200 after {served[0]:.1f}-{served[-1]:.1f} s; /ready {len(polls)} polls, slowest "
              f"{1000 * max(latency for latency, _ in polls):.0f} ms")
        # None waited for the stages' queues: each came back as soon as the ingress got to it. (On a quiet machine
        # within a second; on a shared 2-core one the ingress's event loop, busy with the whole burst, sets the pace:
        # the refusal itself reaches the orchestrator's caller within 0.1 s, `test_fail_fast_open.py`.)
        assert refused[len(refused) // 2] < served[len(served) // 2] and refused[-1] < served[-1], (refused, served)
        assert talker["refused"] >= 1  # some refusals came from the Talker's expected wait, not only Serve's count
        assert polls and all(status == 200 for _, status in polls), polls
        after = httpx.post(url, json={**BODY, "max_completion_tokens": 4}, timeout=120)
        assert after.status_code == 200
    finally:
        serve.delete(BURST_APP)
