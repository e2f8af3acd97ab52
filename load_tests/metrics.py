"""Pure per-request and aggregate load-test metrics: stream accumulation, playback simulation, percentiles."""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

SAMPLE_RATE = 24_000
BYTES_PER_SECOND = SAMPLE_RATE * 2  # PCM16 mono

PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)
STAT_FIELDS: tuple[str, ...] = ("ttft_s", "ttfa_s", "latency_s", "rtf", "streaming_rtf")


def pcm16_seconds(n_bytes: int) -> float:
    """Duration of `n_bytes` of PCM16 little-endian mono audio at 24 kHz."""
    return n_bytes / BYTES_PER_SECOND


@dataclass
class StreamState:
    """What a response stream has delivered so far; times are seconds on the caller's clock."""

    first_text_t: float | None = None  # first non-empty delta.content or delta.audio.transcript
    audio: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, PCM16 bytes)
    text: list[str] = field(default_factory=list)
    transcript: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # chat: saw `data: [DONE]`
    error_type: str | None = None
    error_message: str | None = None

    def add_audio(self, t: float, n_bytes: int) -> None:
        """Record `n_bytes` of PCM arriving at `t` (empty pieces are ignored)."""
        if n_bytes > 0:
            self.audio.append((t, n_bytes))

    def fail(self, error_type: str, message: str) -> None:
        """Mark the stream failed, keeping the first failure."""
        if self.error_type is None:
            self.error_type, self.error_message = error_type, message


def apply_chat_event(state: StreamState, payload: str, t: float) -> None:
    """Fold one SSE `data` payload of a chat-completions stream, received at `t`, into `state`."""
    if payload.strip() == "[DONE]":
        state.done = True
        return
    try:
        chunk = json.loads(payload)
    except json.JSONDecodeError as exc:
        state.fail("protocol_error", f"bad SSE JSON: {exc}")
        return
    if not isinstance(chunk, dict):
        state.fail("protocol_error", "SSE chunk is not a JSON object")
        return
    if "error" in chunk:  # an error reported in-stream after the 200 status line
        err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
        state.fail(str(err.get("type") or "stream_error"), str(err.get("message", "")))
        return
    if isinstance(chunk.get("usage"), dict):
        state.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if isinstance(content, str) and content:
            if state.first_text_t is None:
                state.first_text_t = t
            state.text.append(content)
        audio = delta.get("audio")
        if isinstance(audio, dict):
            data = audio.get("data")
            if isinstance(data, str) and data:
                try:
                    state.add_audio(t, len(base64.b64decode(data, validate=True)))
                except (binascii.Error, ValueError) as exc:
                    state.fail("protocol_error", f"bad base64 audio: {exc}")
            transcript = audio.get("transcript")
            if isinstance(transcript, str) and transcript:  # OpenAI-style audio replies carry their text here
                if state.first_text_t is None:
                    state.first_text_t = t
                state.transcript.append(transcript)
        if choice.get("finish_reason"):
            state.finish_reason = str(choice["finish_reason"])


@dataclass(frozen=True)
class Playback:
    """Outcome of playing a stream in real time from its first audio byte."""

    underruns: int
    stall_s: float
    end_t: float | None  # when playback finishes, on the arrivals' clock


def simulate_playback(arrivals: Sequence[tuple[float, float]]) -> Playback:
    """Play audio pieces `(arrival time, seconds of audio)` in real time, starting at the first arrival.

    The buffer holds audio until `play_end`, the time playback runs out. A piece arriving after
    `play_end` is an underrun: playback stalled for `t - play_end` and resumes the moment it arrives.
    A piece arriving exactly as the buffer drains is on time. Arrivals must be in time order.
    """
    if not arrivals:
        return Playback(0, 0.0, None)
    underruns, stall = 0, 0.0
    play_end = arrivals[0][0]
    for t, seconds in arrivals:
        if t > play_end:  # never true for the first piece: playback starts when it arrives
            underruns += 1
            stall += t - play_end
            play_end = t
        play_end += seconds
    return Playback(underruns, stall, play_end)


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds, `start_s` relative to the run's start."""

    index: int
    scenario: str
    start_s: float
    status: int | None
    ok: bool
    error_type: str | None
    error_message: str | None
    retry_after: str | None
    finish_reason: str | None
    ttft_s: float | None
    ttfa_s: float | None
    latency_s: float
    audio_s: float
    audio_bytes: int
    audio_chunks: int
    rtf: float | None
    streaming_rtf: float | None
    underruns: int
    stall_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    text_chars: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (one line of requests.jsonl)."""
        return asdict(self)


def build_record(index: int, scenario: str, start: float, end: float, run_start: float, status: int | None,
                 state: StreamState, retry_after: str | None = None) -> RequestRecord:
    """Derive a request's metrics from its stream `state`; `start`, `end` and arrival times share one clock."""
    audio_bytes = sum(n for _, n in state.audio)
    audio_s = pcm16_seconds(audio_bytes)
    first_audio = state.audio[0][0] if state.audio else None
    last_audio = state.audio[-1][0] if state.audio else None
    playback = simulate_playback([(t, pcm16_seconds(n)) for t, n in state.audio])
    latency = end - start
    error_type = state.error_type
    if error_type is None and status != 200:
        error_type = "http_error" if status is not None else "client_error"
    usage = state.usage or {}
    return RequestRecord(
        index=index, scenario=scenario, start_s=start - run_start, status=status,
        ok=error_type is None, error_type=error_type, error_message=state.error_message,
        retry_after=retry_after, finish_reason=state.finish_reason,
        ttft_s=None if state.first_text_t is None else state.first_text_t - start,
        ttfa_s=None if first_audio is None else first_audio - start,
        latency_s=latency, audio_s=audio_s, audio_bytes=audio_bytes, audio_chunks=len(state.audio),
        rtf=latency / audio_s if audio_s > 0 else None,
        streaming_rtf=(last_audio - first_audio) / audio_s if audio_s > 0 and first_audio is not None
        and last_audio is not None else None,
        underruns=playback.underruns, stall_s=playback.stall_s,
        prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        completion_tokens=_int_or_none(usage.get("completion_tokens")),
        text_chars=sum(len(s) for s in (state.text or state.transcript)),
    )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100) by linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def describe(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, min, max and the PERCENTILES of the non-None values."""
    vals = [float(v) for v in values if v is not None]
    out: dict[str, float | int | None] = {"count": len(vals), "mean": sum(vals) / len(vals) if vals else None,
                                          "min": min(vals) if vals else None, "max": max(vals) if vals else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(vals, p)
    return out


def error_samples(records: list[RequestRecord], limit: int = 5) -> list[str]:
    """Up to `limit` distinct failures as 'KEY: message' (what a run that lost requests lost them to)."""
    seen: list[str] = []
    for record in records:
        sample = f"{error_key(record)}: {record.error_message or ''}".strip()
        if not record.ok and sample not in seen:
            seen.append(sample)
    return seen[:limit]


def error_key(record: RequestRecord) -> str:
    """How an error is bucketed: its HTTP status if not 200, else its error type (timeout, stream error...)."""
    if record.status is not None and record.status != 200:
        return str(record.status)
    return record.error_type or "unknown"


def underrun_rate(records: Sequence[RequestRecord]) -> float | None:
    """The share of streams that underran at least once (`simulate_playback`: played in real time from the first
    chunk, the next chunk came after the audio so far had finished); None without streams."""
    return sum(1 for r in records if r.underruns) / len(records) if records else None


def aggregate(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Run summary. Latency-type stats cover successful requests; audio throughput counts all audio received."""
    ok = [r for r in records if r.ok]
    errors_by_status: dict[str, int] = {}
    errors_by_type: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = error_key(r)
            errors_by_status[key] = errors_by_status.get(key, 0) + 1
            etype = r.error_type or "unknown"
            errors_by_type[etype] = errors_by_type.get(etype, 0) + 1
    finish: dict[str, int] = {}
    for r in ok:
        key = r.finish_reason or "none"
        finish[key] = finish.get(key, 0) + 1
    audio_total = sum(r.audio_s for r in records)
    tokens = sum(r.completion_tokens or 0 for r in ok)

    def rate(x: float) -> float:
        return x / wall_s if wall_s > 0 else 0.0

    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "errors_by_status": dict(sorted(errors_by_status.items())),
        "errors_by_type": dict(sorted(errors_by_type.items())),
        "error_samples": error_samples(records),
        "finish_reasons": dict(sorted(finish.items())),
        "wall_s": wall_s,
        "requests_per_s": rate(len(ok)),
        "audio_s_total": audio_total,
        "audio_throughput": rate(audio_total),  # seconds of audio received per wall-clock second
        "completion_tokens_total": tokens,
        "completion_tokens_per_s": rate(tokens),
        "underruns": {"events": sum(r.underruns for r in ok),
                      "requests_affected": sum(1 for r in ok if r.underruns),
                      "rate": underrun_rate(ok),
                      "stall_s_total": sum(r.stall_s for r in ok),
                      "stall_s": describe(r.stall_s for r in ok)},
        "stats": {name: describe(getattr(r, name) for r in ok) for name in STAT_FIELDS},
    }
