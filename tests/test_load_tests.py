"""Tests of load_tests/: pure SSE/metric/aggregation code, and the CLI end to end against an in-test fake server."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import math
import random
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("tqdm")
from aiohttp import web  # noqa: E402

from load_tests import loadgen  # noqa: E402
from load_tests.client import load_audio_input  # noqa: E402
from load_tests.metrics import (RequestRecord, StreamState, aggregate, apply_chat_event, build_record,  # noqa: E402
                                describe, percentile, simulate_playback)
from load_tests.report import format_table  # noqa: E402
from load_tests.sse import SSEParser, parse_sse  # noqa: E402

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None  # without it the CLI skips plots


# ---------------------------------------------------------------- SSE parsing

STREAM = (b'data: {"a": 1}\n\n'
          b': keep-alive comment\n\n'
          b'event: message\r\nid: 7\r\ndata: {"b": "h\xc3\xa9llo \xe2\x82\xac"}\r\n\r\n'
          b'data: line one\ndata:line two\n\n'
          b'data: [DONE]\n\n')
EXPECTED = ['{"a": 1}', '{"b": "h\u00e9llo \u20ac"}', "line one\nline two", "[DONE]"]


def test_sse_whole_body() -> None:
    assert parse_sse(STREAM) == EXPECTED


def test_sse_split_at_every_boundary() -> None:
    for cut in range(1, len(STREAM)):  # includes cuts inside CRLF and inside multi-byte UTF-8 characters
        parser = SSEParser()
        assert parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) + parser.close() == EXPECTED, cut


def test_sse_byte_by_byte_and_random_pieces() -> None:
    parser = SSEParser()
    assert [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i:i + 1])] == EXPECTED
    rng = random.Random(3)
    for _ in range(50):
        parser, events, pos = SSEParser(), [], 0
        while pos < len(STREAM):
            step = rng.randint(1, 9)
            events += parser.feed(STREAM[pos:pos + step])
            pos += step
        assert events + parser.close() == EXPECTED


def test_sse_cr_only_line_endings_and_trailing_partial_event() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\r\r") == []  # the final CR could still be half of CRLF
    assert parser.feed(b"data: y\r") == ["x"]
    assert parser.close() == []  # "y" never got its blank line: dropped, as the spec says
    assert parse_sse(b"data: x\r\r") == ["x"]
    assert parse_sse(b"data\n\ndata:\n\n") == ["", ""]  # field with no value is an empty data line


# ---------------------------------------------------------------- chat chunks

def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None) -> str:
    body: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body)


def _audio(n_bytes: int, transcript: str = "") -> dict[str, Any]:
    return {"audio": {"id": "a1", "data": base64.b64encode(b"\x01" * n_bytes).decode(), "transcript": transcript}}


def test_apply_chat_event_accumulates_text_audio_finish_and_usage() -> None:
    st = StreamState()
    apply_chat_event(st, _chunk({"role": "assistant"}), 1.0)
    apply_chat_event(st, _chunk({"content": "Hi"}), 1.1)
    apply_chat_event(st, _chunk(_audio(4800, "Hi")), 1.3)
    apply_chat_event(st, _chunk({"content": " there"}), 1.4)
    apply_chat_event(st, _chunk({"content": ""}, finish="stop",
                                usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}), 1.5)
    apply_chat_event(st, "[DONE]", 1.5)
    assert st.first_text_t == 1.1 and st.audio == [(1.3, 4800)] and "".join(st.text) == "Hi there"
    assert st.finish_reason == "stop" and st.usage["completion_tokens"] == 2 and st.done
    assert st.transcript == ["Hi"] and st.error_type is None


def test_apply_chat_event_transcript_only_text() -> None:
    st = StreamState()  # OpenAI-style: with audio on, the text may come only as audio.transcript
    apply_chat_event(st, _chunk({"audio": {"id": "a", "transcript": "Hel"}}), 2.0)
    apply_chat_event(st, _chunk(_audio(480, "lo")), 2.2)
    apply_chat_event(st, json.dumps({"id": "c", "choices": [], "usage": {"completion_tokens": 3}}), 2.3)
    rec = build_record(0, "chat", 1.5, 2.5, 1.5, 200, st)
    assert rec.ttft_s == pytest.approx(0.5) and rec.ttfa_s == pytest.approx(0.7) and rec.text_chars == 5
    assert rec.completion_tokens == 3 and rec.audio_bytes == 480


def test_apply_chat_event_errors() -> None:
    st = StreamState()
    apply_chat_event(st, '{"error": {"message": "boom", "type": "server_error"}}', 1.0)
    apply_chat_event(st, "not json", 1.1)  # the first failure is kept
    assert (st.error_type, st.error_message) == ("server_error", "boom")
    st = StreamState()
    apply_chat_event(st, _chunk({"audio": {"id": "a", "data": "!!!notbase64"}}), 1.0)
    assert st.error_type == "protocol_error"


# ---------------------------------------------------------------- playback simulation

def test_playback_no_audio_and_single_chunk() -> None:
    assert simulate_playback([]).underruns == 0 and simulate_playback([]).end_t is None
    pb = simulate_playback([(2.0, 0.5)])
    assert (pb.underruns, pb.stall_s, pb.end_t) == (0, 0.0, 2.5)


def test_playback_hand_made_arrivals() -> None:
    # buffer drains at 1.0 -> 2.0 (piece 2 on time) -> stall 2.0..2.5 -> ends 3.0; piece 4 lands exactly at 3.0
    pb = simulate_playback([(0.0, 1.0), (0.5, 1.0), (2.5, 0.5), (3.0, 0.5)])
    assert pb.underruns == 1 and pb.stall_s == pytest.approx(0.5) and pb.end_t == pytest.approx(3.5)
    # two stalls of 0.3 s and 0.1 s, then a burst that keeps up
    pb = simulate_playback([(10.0, 0.2), (10.5, 0.2), (10.8, 0.1), (10.85, 0.3), (10.9, 0.3)])
    assert pb.underruns == 2 and pb.stall_s == pytest.approx(0.4) and pb.end_t == pytest.approx(11.5)
    # a server far faster than real time never underruns
    assert simulate_playback([(i * 0.01, 0.1) for i in range(100)]).underruns == 0


def test_build_record_metrics() -> None:
    st = StreamState(first_text_t=10.2, finish_reason="length", done=True,
                     usage={"prompt_tokens": 9, "completion_tokens": 16})
    for t, n in ((10.5, 24_000), (10.9, 24_000), (12.0, 48_000)):  # 0.5 s + 0.5 s + 1 s of audio
        st.add_audio(t, n)
    rec = build_record(3, "chat", start=10.0, end=12.5, run_start=9.0, status=200, state=st)
    assert rec.ok and rec.index == 3 and rec.start_s == pytest.approx(1.0)
    assert rec.ttft_s == pytest.approx(0.2) and rec.ttfa_s == pytest.approx(0.5)
    assert rec.latency_s == pytest.approx(2.5) and rec.audio_s == pytest.approx(2.0) and rec.audio_chunks == 3
    assert rec.rtf == pytest.approx(1.25) and rec.streaming_rtf == pytest.approx(0.75)
    assert rec.underruns == 1 and rec.stall_s == pytest.approx(0.5)  # drained at 11.5, next piece at 12.0
    assert (rec.finish_reason, rec.prompt_tokens, rec.completion_tokens) == ("length", 9, 16)
    err = StreamState()
    err.fail("rate_limit_exceeded", "slow down")
    rec = build_record(0, "speech", 1.0, 1.1, 1.0, 429, err, retry_after="2")
    assert not rec.ok and rec.rtf is None and rec.ttfa_s is None and rec.retry_after == "2"


# ---------------------------------------------------------------- percentiles and aggregation

def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        vals = [rng.uniform(0, 5) for _ in range(n)]
        for p in (0, 50, 90, 99, 100):
            assert percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)))
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    d = describe([None, 1.0, 3.0])
    assert d["count"] == 2 and d["mean"] == 2.0 and d["p50"] == 2.0 and d["max"] == 3.0


def _rec(i: int, *, ok: bool = True, status: int | None = 200, latency: float = 1.0, audio: float = 2.0,
         error_type: str | None = None, underruns: int = 0, stall: float = 0.0) -> RequestRecord:
    return RequestRecord(index=i, scenario="chat", start_s=0.1 * i, status=status, ok=ok, error_type=error_type,
                         error_message=None, retry_after=None, finish_reason="stop" if ok else None,
                         ttft_s=0.1 if ok else None, ttfa_s=0.2 if ok else None, latency_s=latency,
                         audio_s=audio if ok else 0.0, audio_bytes=int(audio * 48000) if ok else 0, audio_chunks=2,
                         rtf=latency / audio if ok else None, streaming_rtf=0.4 if ok else None,
                         underruns=underruns, stall_s=stall, prompt_tokens=5, completion_tokens=10 if ok else None,
                         text_chars=3)


def test_aggregate() -> None:
    records = [_rec(0, latency=1.0), _rec(1, latency=2.0, underruns=2, stall=0.3), _rec(2, latency=3.0),
               _rec(3, ok=False, status=503, error_type="overloaded", latency=0.01),
               _rec(4, ok=False, status=None, error_type="timeout", latency=5.0),
               _rec(5, ok=False, status=503, error_type="overloaded", latency=0.01)]
    s = aggregate(records, wall_s=4.0)
    assert (s["requests"], s["ok"], s["errors"]) == (6, 3, 3)
    assert s["errors_by_status"] == {"503": 2, "timeout": 1}
    assert s["errors_by_type"] == {"overloaded": 2, "timeout": 1}
    assert s["error_samples"] == ["503:", "timeout:"]  # distinct, in order (these records carry no message)
    records[4].error_message = "stream stalled"
    assert aggregate(records, wall_s=4.0)["error_samples"] == ["503:", "timeout: stream stalled"]
    assert s["finish_reasons"] == {"stop": 3}
    lat = s["stats"]["latency_s"]  # errors excluded
    assert lat["count"] == 3 and lat["p50"] == 2.0 and lat["mean"] == 2.0 and lat["p90"] == pytest.approx(2.8)
    assert s["audio_s_total"] == 6.0 and s["audio_throughput"] == 1.5 and s["requests_per_s"] == 0.75
    assert s["completion_tokens_total"] == 30
    assert s["underruns"]["events"] == 2 and s["underruns"]["requests_affected"] == 1
    assert s["underruns"]["stall_s_total"] == pytest.approx(0.3)
    table = format_table({**s, "config": {"scenario": "chat", "concurrency": 2}, "model": "m"})
    assert "TTFA (ms)" in table and "503: 2" in table and "3/6 ok" in table
    assert aggregate([], 0.0)["stats"]["ttfa_s"]["p99"] is None


def test_build_bodies_seeds_and_prompt_cycle() -> None:
    cfg = loadgen.LoadConfig(url="u", scenario="chat", concurrency=1, requests=5, seed=7, max_tokens=12)
    bodies = loadgen.build_bodies(cfg, "m", ["a", "b"], None)
    assert [b["seed"] for b in bodies] == [7, 8, 9, 10, 11]
    assert sorted(b["messages"][0]["content"] for b in bodies[:2]) == ["a", "b"]
    assert all(b["stream"] and b["max_completion_tokens"] == 12 and b["modalities"] == ["text", "audio"]
               for b in bodies)


def test_audio_input_part_and_default_out_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clip = tmp_path / "in.WAV"
    clip.write_bytes(b"RIFF....WAVEfmt ")
    audio = load_audio_input(str(clip))
    assert audio.format == "wav" and base64.b64decode(audio.data_b64) == clip.read_bytes()
    cfg = loadgen.LoadConfig(url="u", scenario="chat", concurrency=1, requests=1)
    content = loadgen.build_bodies(cfg, "m", ["what is this?"], audio)[0]["messages"][0]["content"]
    assert content[0] == {"type": "input_audio", "input_audio": {"data": audio.data_b64, "format": "wav"}}
    assert content[1] == {"type": "text", "text": "what is this?"}
    with pytest.raises(SystemExit):  # input audio only makes sense for chat
        loadgen.parse_args(["--scenario", "speech", "--audio-in", str(clip)])
    monkeypatch.chdir(tmp_path)
    first = loadgen.default_out_dir()
    first.mkdir(parents=True)
    assert first.parent == Path("load_results") and loadgen.default_out_dir() != first


# ---------------------------------------------------------------- fake server and end-to-end runs

CHAT_AUDIO = (9600, 4800, 7200)  # PCM16 bytes per audio delta: 0.2 s, 0.1 s, 0.15 s
SPEECH_PIECES = (2401, 2399, 4800)  # odd sizes split samples across pieces; 0.05 s, 0.05 s, 0.1 s
SPEECH_GAP_S = 0.08  # longer than the 0.05 s pieces last, so a real-time player stalls


class FakeOmni:
    """A tiny stand-in for the service's HTTP protocol: SSE chat, raw-PCM speech, one configured failure."""

    def __init__(self, fail_on: int | None = None, hang_on: int | None = None) -> None:
        self.fail_on, self.hang_on = fail_on, hang_on
        self.received: list[dict[str, Any]] = []
        self.inflight = 0
        self.max_inflight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/audio/speech", self.speech)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-omni", "object": "model"}]})

    @staticmethod
    def _error(status: int, etype: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response({"error": {"message": message, "type": etype, "param": None, "code": None}},
                                 status=status, headers=headers)

    async def _admit(self, request: web.Request) -> tuple[int, dict[str, Any]]:
        body = await request.json()
        self.received.append(body)
        return len(self.received) - 1, body

    async def chat(self, request: web.Request) -> web.StreamResponse:
        n, body = await self._admit(request)
        if not (body.get("model") == "fake-omni" and body.get("stream") is True and body.get("messages")
                and body.get("modalities") == ["text", "audio"] and body.get("audio", {}).get("format") == "pcm16"
                and body.get("stream_options") == {"include_usage": True}):
            return self._error(400, "invalid_request_error", "unexpected request body")
        if n == self.fail_on:
            return self._error(503, "server_overloaded", "try later", headers={"Retry-After": "1"})
        if n == self.hang_on:
            await asyncio.sleep(1.5)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunks = [_chunk({"role": "assistant", "content": "Hel"}), _chunk({"content": "lo"})]
            chunks += [_chunk(_audio(n_bytes, "Hello")) for n_bytes in CHAT_AUDIO]
            usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
            chunks += [_chunk({}, finish="stop"), json.dumps({"id": "c1", "choices": [], "usage": usage}), "[DONE]"]
            for c in chunks:
                event = f"data: {c}\n\n".encode()
                half = len(event) // 2  # split every event across two writes
                await resp.write(event[:half])
                await asyncio.sleep(0.01)
                await resp.write(event[half:])
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1

    async def speech(self, request: web.Request) -> web.StreamResponse:
        n, body = await self._admit(request)
        if body.get("response_format") != "pcm" or not body.get("input") or body.get("model") != "fake-omni":
            return self._error(400, "invalid_request_error", "unexpected request body")
        if n == self.fail_on:
            return self._error(429, "rate_limit_exceeded", "slow down", headers={"Retry-After": "2"})
        resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
        await resp.prepare(request)
        for i, size in enumerate(SPEECH_PIECES):
            if i:
                await asyncio.sleep(SPEECH_GAP_S)
            await resp.write(b"\x00" * size)
        await resp.write_eof()
        return resp


@pytest.fixture
def serve() -> Iterator[Any]:
    """Start a FakeOmni on 127.0.0.1 (random port) in its own event-loop thread; yields a starter function."""
    started: list[tuple[asyncio.AbstractEventLoop, threading.Thread, web.AppRunner]] = []

    def start(fake: FakeOmni) -> str:
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(fake.app(), handler_cancellation=True)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = runner.addresses[0][1]
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        started.append((loop, thread, runner))
        return f"http://127.0.0.1:{port}"

    yield start
    for loop, thread, runner in started:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def _outputs(out: Path, n: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == n
    if HAVE_MPL:
        for name in ("latency_cdf.png", "ttfa_over_time.png", "rtf_hist.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    return summary, [json.loads(line) for line in lines]


def test_cli_chat_end_to_end(serve: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeOmni(fail_on=2)
    url = serve(fake)
    out = tmp_path / "chat"
    rc = loadgen.main(["--url", url, "--scenario", "chat", "--concurrency", "3", "--requests", "6",
                       "--max-tokens", "16", "--seed", "5", "--out-dir", str(out)])
    assert rc == 0
    summary, recs = _outputs(out, 6)
    assert summary["model"] == "fake-omni"  # discovered through GET /v1/models
    assert (summary["requests"], summary["ok"], summary["errors"]) == (6, 5, 1)
    assert summary["errors_by_status"] == {"503": 1} and summary["errors_by_type"] == {"server_overloaded": 1}
    per_request_audio = sum(CHAT_AUDIO) / 48_000
    assert summary["audio_s_total"] == pytest.approx(5 * per_request_audio, abs=1e-9)
    assert summary["finish_reasons"] == {"stop": 5} and summary["completion_tokens_total"] == 10
    assert summary["stats"]["ttfa_s"]["count"] == 5 and summary["underruns"]["events"] == 0
    assert fake.max_inflight == 3  # exactly C in flight
    assert sorted(b["seed"] for b in fake.received) == [5, 6, 7, 8, 9, 10]
    assert all(b["max_completion_tokens"] == 16 for b in fake.received)
    assert [r["index"] for r in recs] == list(range(6))
    failed = [r for r in recs if not r["ok"]]
    assert len(failed) == 1 and failed[0]["status"] == 503 and failed[0]["retry_after"] == "1"
    for r in (r for r in recs if r["ok"]):
        assert r["audio_s"] == pytest.approx(per_request_audio) and r["audio_chunks"] == len(CHAT_AUDIO)
        assert 0 < r["ttft_s"] < r["ttfa_s"] < r["latency_s"] < 5
        assert r["rtf"] == pytest.approx(r["latency_s"] / r["audio_s"]) and 0 < r["streaming_rtf"] < r["rtf"]
        assert r["finish_reason"] == "stop" and r["text_chars"] == 5
    table = capsys.readouterr().out
    assert "TTFT (ms)" in table and "5/6 ok" in table and "503: 1" in table


def test_cli_speech_end_to_end(serve: Any, tmp_path: Path) -> None:
    fake = FakeOmni(fail_on=4)
    url = serve(fake)
    out = tmp_path / "speech"
    rc = loadgen.main(["--url", url, "--scenario", "speech", "--concurrency", "3", "--requests", "6",
                       "--model", "fake-omni", "--out-dir", str(out), "--no-progress"])
    assert rc == 0
    summary, recs = _outputs(out, 6)
    assert (summary["ok"], summary["errors_by_status"]) == (5, {"429": 1})
    assert summary["audio_s_total"] == pytest.approx(5 * sum(SPEECH_PIECES) / 48_000, abs=1e-9)
    assert summary["stats"]["ttft_s"]["count"] == 0 and summary["stats"]["ttfa_s"]["count"] == 5
    # pieces of 0.05 s arrive 0.08 s apart: a real-time player runs dry
    assert summary["underruns"]["events"] >= 1 and summary["underruns"]["stall_s_total"] > 0
    for r in (r for r in recs if r["ok"]):
        assert r["ttft_s"] is None and r["audio_bytes"] == sum(SPEECH_PIECES)
        assert r["latency_s"] >= 2 * SPEECH_GAP_S * 0.9  # last piece comes after two gaps
        assert r["streaming_rtf"] == pytest.approx(2 * SPEECH_GAP_S / r["audio_s"], rel=0.5)
    assert [r["retry_after"] for r in recs if not r["ok"]] == ["2"]


def test_cli_timeout_is_counted(serve: Any, tmp_path: Path) -> None:
    url = serve(FakeOmni(hang_on=0))
    out = tmp_path / "timeout"
    rc = loadgen.main(["--url", url, "--scenario", "chat", "--concurrency", "2", "--requests", "2",
                       "--timeout", "0.5", "--out-dir", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] == 1 and summary["errors_by_status"] == {"timeout": 1}


def test_cli_setup_failure_returns_2(tmp_path: Path) -> None:
    rc = loadgen.main(["--url", "http://127.0.0.1:9", "--requests", "1", "--timeout", "2",
                       "--out-dir", str(tmp_path / "x"), "--no-progress"])
    assert rc == 2 and not (tmp_path / "x").exists()


def test_poisson_arrivals_are_seeded_start_at_zero_and_average_the_rate() -> None:
    from load_tests.loadgen import poisson_offsets

    offsets = poisson_offsets(20.0, 4000, seed=7)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets == poisson_offsets(20.0, 4000, seed=7)
    assert offsets != poisson_offsets(20.0, 4000, seed=8)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)  # exponential gaps of mean 1/rate
    assert sum(g > 1 / 20 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    with pytest.raises(ValueError):
        poisson_offsets(0.0, 3, seed=0)


def test_underrun_rate_is_the_share_of_streams_that_ran_dry() -> None:
    from load_tests.metrics import underrun_rate

    # two streams on time, one whose second chunk came after its first chunk's audio had played out
    records = [_rec(0), _rec(1), _rec(2, underruns=1, stall=0.2), _rec(3, ok=False, error_type="timeout")]
    summary = aggregate(records, 1.0)
    assert summary["underruns"]["rate"] == pytest.approx(1 / 3)
    assert underrun_rate([]) is None and aggregate([], 0.0)["underruns"]["rate"] is None
    assert summary["stats"]["ttfa_s"]["p95"] is not None  # first audio's p95 is reported


def test_speech_body_sends_the_tts_fields_given() -> None:
    from load_tests.client import speech_body

    body = speech_body("m", "Hi.", voice=None, max_new_tokens=75, ignore_eos=True, task_type="Base",
                       ref_audio="UklG", ref_text="hello", language=None)
    assert body == {"model": "m", "input": "Hi.", "response_format": "pcm", "stream": True, "max_new_tokens": 75,
                    "ignore_eos": True, "task_type": "Base", "ref_audio": "UklG", "ref_text": "hello"}
    assert speech_body("m", "Hi.", voice="ethan") == {"model": "m", "input": "Hi.", "voice": "ethan",
                                                       "response_format": "pcm", "stream": True}
