"""Schemathesis against the service's own /openapi.json, bodies included: valid and invalid requests, no 5xx."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest

from _service import MODEL, own_app, record

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (hypothesis comes with schemathesis)

APP, PREFIX = "fuzz", "/fuzz"
# Small replies so that the tiny model answers every valid request quickly.
LIMITS = {"max_completion_tokens": 8, "default_max_tokens": 8, "max_prompt_tokens": 256, "max_speech_input_chars": 48,
          "max_request_bytes": 64 * 1024, "max_audio_seconds": 5}
# OMNI_RAY_FUZZ_EXAMPLES: examples per POST operation and mode (GETs take a tenth); OMNI_RAY_FUZZ_S: seconds per
# POST operation and mode, after which the rest of its examples are generated but not sent.
EXAMPLES = int(os.environ.get("OMNI_RAY_FUZZ_EXAMPLES", "250"))
SECONDS = float(os.environ.get("OMNI_RAY_FUZZ_S", "45"))
POSTS = ("/v1/chat/completions", "/v1/audio/speech")


@pytest.fixture(scope="module")
def fuzz_url(serve_url: str) -> Iterator[str]:
    with own_app(serve_url, APP, PREFIX, {"model_name": MODEL, "limits": LIMITS}) as url:
        yield url


@pytest.fixture(scope="module")
def openapi(fuzz_url: str) -> dict[str, Any]:
    return httpx.get(f"{fuzz_url}/openapi.json", timeout=30).json()


def test_openapi_describes_both_request_bodies(openapi: dict[str, Any]) -> None:
    for path in POSTS:
        body = openapi["paths"][path]["post"].get("requestBody")
        assert body and "application/json" in body["content"], f"{path} has no request body in /openapi.json"


def _stream_server_error(response: Any) -> str | None:
    """A 200 chat stream that ended with a server_error event: a server failure after the headers went out."""
    if "text/event-stream" not in response.headers.get("content-type", ""):
        return None
    for line in response.text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            error = json.loads(line[6:]).get("error") or {}
            if error.get("type") == "server_error":
                return str(error.get("message"))
    return None


def _servable(body: dict[str, Any]) -> None:
    """A valid body made to reach the model: the served id (a random one is a 404), a served voice, a token cap
    within limits."""
    body["model"] = MODEL
    if "voice" in body:  # speech: a served voice at the one speed
        body["voice"], body["speed"] = "ethan", 1.0
    if isinstance(body.get("audio"), dict) and "voice" in body["audio"]:
        body["audio"]["voice"] = "ethan"
    for field in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(field), int) and body[field] > LIMITS["max_completion_tokens"]:
            body[field] = LIMITS["max_completion_tokens"]


def _bad_envelope(response: Any) -> bool:
    try:
        error = response.json()["error"]
        return not (set(error) >= {"message", "type", "param", "code"} and error["message"])
    except Exception:
        return True


@pytest.mark.timeout(900)
def test_generated_requests_get_no_server_error(fuzz_url: str, openapi: dict[str, Any]) -> None:
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(openapi)
    statuses: dict[str, Counter[int]] = {}
    server_errors: list[str] = []
    bad_envelopes: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations if op.method.upper() == "POST"} >= set(POSTS), [op.label for op in operations]
    started = time.monotonic()
    for operation in operations:
        post = operation.method.upper() == "POST"
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,)
        for mode in modes:
            label = f"{operation.label} {mode.value}"
            counts = statuses.setdefault(label, Counter())
            until = time.monotonic() + (SECONDS if post else SECONDS / 4)

            @settings(max_examples=EXAMPLES if post else max(1, EXAMPLES // 10), deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
                      derandomize=True)  # the same cases every run; no shrinking
            @given(case=operation.as_strategy(generation_mode=mode))
            def send(case: Any) -> None:
                if time.monotonic() > until:
                    return
                if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
                    _servable(case.body)
                response = case.call(base_url=fuzz_url, timeout=120)
                counts[response.status_code] += 1
                failure = _stream_server_error(response) if response.status_code == 200 else None
                if response.status_code >= 500 or failure:
                    server_errors.append(f"{label}: {response.status_code} {failure or response.text[:300]}\n"
                                         f"{case.as_curl_command()}")
                elif response.status_code >= 400 and _bad_envelope(response):
                    bad_envelopes.append(f"{label}: {response.status_code} {response.text[:200]}")

            send()
    cases = sum(sum(c.values()) for c in statuses.values())
    record("schemathesis", {
        "schemathesis": schemathesis.__version__, "cases": cases, "server_errors": len(server_errors),
        "non_envelope_4xx": len(bad_envelopes), "seconds": round(time.monotonic() - started, 1),
        "statuses": {label: {str(k): v for k, v in sorted(c.items())} for label, c in statuses.items()},
    })
    assert not server_errors, "\n\n".join(server_errors[:5])
    assert not bad_envelopes, "\n".join(bad_envelopes[:10])
    assert all(sum(statuses[f"POST {path} {mode}"].values()) >= 10 for path in POSTS for mode in ("positive", "negative")), statuses
    # After the fuzzing the service still serves a plain request.
    response = httpx.post(f"{fuzz_url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]})
    assert response.status_code == 200, response.text
