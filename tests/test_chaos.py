"""kill -9 of a stage's replica under streaming load: in-flight chats end with an error event within 2 s, the service
serves again once /ready is 200; with two Talkers, a kill fails only the dead replica's requests. On its own app."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Iterator

import pytest
from ray import serve

from omni_ray.serve.app import build_app
from _service import (
    MODEL, StreamRecord, chat_body, own_app, record, ready_status, replica_pids, stage_streams, start_streams,
    stream_chat, summary, wait_until, wav_b64,
)

APP, PREFIX = "chaos", "/chaos"
ERROR_EVENT_WITHIN_S = 2.0  # the bound: kill → the in-flight stream's error event
READY_503_WITHIN_S = 5.0  # /ready notices a stage without a replica (stats go stale after 3 s)
RECOVERY_WITHIN_S = 180.0  # a new replica starts (imports, tiny weights) on a shared 2-core machine
INGRESS_CUT_WITHIN_S = 5.0  # a killed ingress: the client sees its body end, no hang
# Long replies (runs to its token cap, speech to its frame budget) so each stage is still busy with every stream at
# the kill; short ones for the requests that probe recovery.
LONG = chat_body("Keep talking for a while.", stream=True, audio=True, max_tokens=160, ignore_eos=True)
# Two Talkers: the survivors' streams run to their end, so shorter (still mid-reply at the kill).
MEDIUM = chat_body("Keep talking for a while.", stream=True, audio=True, max_tokens=60, ignore_eos=True)
SHORT = chat_body("Say hello.", stream=True, audio=True, max_tokens=8, ignore_eos=True)
AUDIO_IN = wav_b64(1.0)


@pytest.fixture(scope="module")
def chaos_url(serve_url: str) -> Iterator[str]:
    """A separate application: the kills never touch the session's shared service."""
    with own_app(serve_url, APP, PREFIX, {"model_name": MODEL}) as url:
        yield url


def _one_request(url: str, audio_in: bool = False) -> StreamRecord:
    body = chat_body("Say hello.", stream=True, audio=True, max_tokens=8, ignore_eos=True,
                     audio_in=AUDIO_IN if audio_in else None)
    rec = StreamRecord()
    stream_chat(url, body, rec, timeout=120)
    return rec


def _healthy(url: str) -> None:
    assert wait_until(lambda: ready_status(url) == 200, RECOVERY_WITHIN_S), "the chaos app is not ready"
    rec = _one_request(url)
    assert rec.ok and rec.audio_chunks > 0, rec


def _busy_streams(url: str, bodies: list[dict[str, Any]]) -> tuple[list[StreamRecord], list[threading.Thread]]:
    """Start the streams and return once every one has audio flowing (every stage holds it)."""
    records, threads = start_streams(url, bodies, timeout=300)
    assert wait_until(lambda: all(r.first_audio or r.ended for r in records), 120, 0.02), records
    assert all(r.ended is None for r in records), f"a stream ended before the kill: {records}"
    return records, threads


def _kill(app: str, deployment: str, replica: str | None = None) -> tuple[str, float]:
    replicas = replica_pids(app, deployment)
    victim = replica or next(iter(replicas))
    os.kill(replicas[victim], signal.SIGKILL)
    return victim, time.monotonic()


def _ready_cycle(url: str, killed_at: float) -> tuple[float | None, float]:
    """Seconds from the kill until /ready first answered other than 200, and until it was 200 again."""
    down: float | None = None
    deadline = killed_at + RECOVERY_WITHIN_S
    while time.monotonic() < deadline:
        status = ready_status(url)
        now = time.monotonic()
        if status != 200 and down is None:
            down = now - killed_at
        if down is not None and status == 200:
            return down, now - killed_at
        if down is None and now - killed_at > READY_503_WITHIN_S:
            break  # /ready never noticed the lost stage: asserted by the caller
        time.sleep(0.05)
    return down, time.monotonic() - killed_at


def _recover(url: str, stage: str, killed_at: float) -> dict[str, Any]:
    down, up = _ready_cycle(url, killed_at)
    assert down is not None and down <= READY_503_WITHIN_S, f"/ready stayed 200 for {READY_503_WITHIN_S} s after the {stage} died"
    assert up < RECOVERY_WITHIN_S, f"/ready was not 200 again {RECOVERY_WITHIN_S} s after the {stage} died"
    after = _one_request(url, audio_in=stage == "encoder")  # the encoder serves only requests with input audio
    assert after.ok and after.audio_chunks > 0, f"the first request after /ready turned 200 failed: {after}"
    return {"ready_not_200_after_s": round(down, 3), "ready_200_after_s": round(up, 3),
            "first_request_ok_after_s": round(time.monotonic() - killed_at, 3)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", ["thinker", "talker", "vocoder", "encoder"])
def test_killed_stage_replica_fails_its_streams_fast_and_the_service_recovers(chaos_url: str, stage: str) -> None:
    _healthy(chaos_url)
    bodies = [LONG] * 4 if stage != "encoder" else [{**chat_body("Keep talking.", stream=True, audio=True, max_tokens=60,
                                                                 ignore_eos=True, audio_in=AUDIO_IN)}] * 4
    records, threads = _busy_streams(chaos_url, bodies)
    victim, killed_at = _kill(APP, stage)
    figures = _recover(chaos_url, stage, killed_at)
    for thread in threads:
        thread.join(timeout=300)
    outcomes = [summary(r, killed_at) for r in records]
    if stage == "encoder":
        # The streams were encoded before the kill: they need no encoder any more, and must end, none hung.
        assert all(r.ended is not None and r.status == 200 and r.broken is None and r.done for r in records), outcomes
    else:
        late = [o for o, r in zip(outcomes, records)
                if r.error is None or r.error_at is None or r.error_at - killed_at > ERROR_EVENT_WITHIN_S]
        assert not late, f"streams without an error event within {ERROR_EVENT_WITHIN_S} s of the {stage}'s kill: {late}"
        assert all(r.done and r.broken is None and r.error["type"] == "server_error" for r in records), outcomes
    errors_after = [round(r.error_at - killed_at, 3) for r in records if r.error_at is not None]
    record("chaos", {stage: {
        "in_flight": len(records), "ended_with_error_event": len(errors_after), "completed": sum(r.ok for r in records),
        "error_event_after_kill_s": errors_after, **figures,
    }})


@pytest.mark.timeout(600)
def test_killed_ingress_cuts_its_bodies_without_hanging_and_the_service_recovers(chaos_url: str) -> None:
    _healthy(chaos_url)
    records, threads = _busy_streams(chaos_url, [LONG] * 4)
    _, killed_at = _kill(APP, "ingress")
    assert wait_until(lambda: all(r.ended is not None for r in records), INGRESS_CUT_WITHIN_S, 0.02), \
        [summary(r, killed_at) for r in records]
    outcomes = [summary(r, killed_at) for r in records]
    # The killed process cannot write an error event: the client sees an incomplete stream (no [DONE]) or an error.
    assert all(not r.done for r in records), outcomes
    figures = _recover(chaos_url, "ingress", killed_at)
    for thread in threads:
        thread.join(timeout=10)
    record("chaos", {"ingress": {
        "in_flight": len(records), "cut_without_done": sum(not r.done for r in records),
        "broken_connections": sum(r.broken is not None for r in records),
        "body_ended_after_kill_s": [round(r.ended - killed_at, 3) for r in records if r.ended is not None], **figures,
    }})


@pytest.mark.timeout(600)
def test_with_two_talkers_a_kill_fails_only_its_requests(chaos_url: str, serve_url: str) -> None:
    serve.run(build_app({"model_name": MODEL, "stage_options": {"talker": {"num_replicas": 2}}}),
              name=APP, route_prefix=PREFIX)
    assert wait_until(lambda: len(replica_pids(APP, "talker")) == 2 and len(stage_streams(chaos_url, "talker")) == 2, 180), \
        "the second Talker never reported"
    _healthy(chaos_url)
    records, threads = _busy_streams(chaos_url, [MEDIUM] * 6)
    time.sleep(0.6)  # replicas post their gauges every 0.25 s
    load = stage_streams(chaos_url, "talker")
    assert sorted(load.values()) != [0.0, 6.0] and sum(load.values()) == 6, f"the streams did not spread: {load}"
    victim = max(load, key=lambda rid: load[rid])
    _, killed_at = _kill(APP, "talker", victim)
    # New requests right after the kill, with no wait for /ready: each must succeed on the surviving Talker.
    fresh: list[StreamRecord] = []
    for _ in range(3):
        rec = StreamRecord()
        stream_chat(chaos_url, SHORT, rec, timeout=120)
        fresh.append(rec)
    for thread in threads:
        thread.join(timeout=300)
    outcomes = [summary(r, killed_at) for r in records]
    failed = [r for r in records if not r.ok]
    assert len(failed) == load[victim], f"{load[victim]:.0f} streams were on the killed Talker: {outcomes}"
    assert all(r.error_at is not None and r.error_at - killed_at <= ERROR_EVENT_WITHIN_S for r in failed), outcomes
    assert all(r.ok and r.audio_chunks > 0 for r in fresh), [summary(r, killed_at) for r in fresh]
    record("chaos", {"talker_one_of_two": {
        "in_flight": len(records), "on_killed_replica": int(load[victim]), "failed": len(failed),
        "completed": sum(r.ok for r in records),
        "error_event_after_kill_s": [round(r.error_at - killed_at, 3) for r in failed if r.error_at is not None],
        "new_requests_ok": sum(r.ok for r in fresh), "new_requests": len(fresh),
        "new_request_seconds": [round(r.ended - r.started, 3) for r in fresh if r.ended is not None],
        "new_request_first_audio_s": [round(r.first_audio - r.started, 3) for r in fresh if r.first_audio is not None],
    }})
