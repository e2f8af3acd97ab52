"""The real HTTP service (Ray Serve, tiny model) called with the official `openai` client: outputs equal the
Python API's for the same greedy request."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

import openai
import pytest
import soundfile as sf

from _reference import wav_part
from conftest import INGRESS_REPLICAS
from omni_ray.audio import encode_audio
from omni_ray.engine.sampler import SamplingParams
from omni_ray.events import AudioChunk, Finished, TextDelta

MODEL = "qwen3-omni"
GREEDY = SamplingParams(temperature=0.0)
GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)  # what temperature 0 means over HTTP


@pytest.fixture(scope="module")
def client(serve_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=120)


def python_api(events: Any) -> tuple[str, bytes, Finished]:
    """Text, PCM16 bytes (quantised as the server does) and the final event of a Python API reply."""

    async def collect() -> tuple[str, bytes, Finished]:
        text, pcm, final = "", b"", None
        async for event in events:
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, AudioChunk):
                pcm += encode_audio(event.pcm, 24000, "pcm16")
            elif isinstance(event, Finished):
                final = event
        assert final is not None
        return text, pcm, final

    return asyncio.run(collect())


def test_streaming_chat_with_audio_equals_the_python_api(client: openai.OpenAI, pipeline: Any) -> None:
    messages = [{"role": "user", "content": "Tell me about the weather in spring."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        stream=True, temperature=0, max_completion_tokens=14, stream_options={"include_usage": True},
    )
    text, pcm, finish_reason, usage, transcript, audio_finish_reason = "", b"", None, None, "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            text += delta.get("content") or ""
            audio = delta.get("audio") or {}
            pcm += base64.b64decode(audio.get("data") or "")
            transcript += audio.get("transcript") or ""
            finish_reason = choice.finish_reason or finish_reason
            audio_finish_reason = getattr(choice, "audio_finish_reason", None) or audio_finish_reason
    expected_text, expected_pcm, final = python_api(
        pipeline.generate(messages, sampling=GREEDY, max_tokens=14, speaker="ethan", talker_sampling=GREEDY_TALKER)
    )
    assert text == expected_text and transcript == expected_text
    assert len(pcm) > 0 and pcm == expected_pcm
    assert finish_reason == final.finish_reason == "length"
    # the speech's own end, next to the text's (an extension field of the final chunk's choice)
    assert audio_finish_reason == final.audio_finish_reason and audio_finish_reason in ("stop", "length")
    assert usage is not None and usage.completion_tokens == 14 and usage.prompt_tokens == final.usage["prompt_tokens"]


def test_chat_with_audio_in_and_wav_out_equals_the_python_api(client: openai.OpenAI, pipeline: Any) -> None:
    part = wav_part(1.3, 22050, 2, seed=11)
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What was that?"}]}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"},
        temperature=0, max_completion_tokens=10,
    )
    message = reply.choices[0].message
    samples, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="int16")
    expected_text, expected_pcm, final = python_api(
        pipeline.generate(messages, sampling=GREEDY, max_tokens=10, speaker="chelsie", talker_sampling=GREEDY_TALKER)
    )
    assert message.content == expected_text and message.audio.transcript == expected_text
    assert rate == 24000 and samples.tobytes() == expected_pcm
    assert message.audio.expires_at > reply.created
    assert getattr(reply.choices[0], "audio_finish_reason") == final.audio_finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == len(final.token_ids)


def test_text_only_chat_equals_the_python_api(client: openai.OpenAI, pipeline: Any) -> None:
    messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Name a colour."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=9)
    expected_text, expected_pcm, _ = python_api(pipeline.generate(messages, sampling=GREEDY, max_tokens=9, audio=False))
    assert reply.choices[0].message.content == expected_text and expected_pcm == b""
    assert getattr(reply.choices[0].message, "audio", None) is None


def test_speech_equals_the_python_api_streamed_or_not(client: openai.OpenAI, pipeline: Any) -> None:
    text = "Good morning, the train leaves at seven."
    whole = client.audio.speech.create(
        model=MODEL, voice="aiden", input=text, response_format="pcm", extra_body={"temperature": 0}
    ).read()
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="aiden", input=text, response_format="pcm", extra_body={"temperature": 0, "stream": True}
    ) as response:
        streamed = b"".join(response.iter_bytes())
    spoken_text, expected_pcm, final = python_api(pipeline.speak(text, speaker="aiden", talker_sampling=GREEDY_TALKER))
    assert spoken_text == text  # the input is the reply, verbatim
    assert len(whole) > 0 and whole == expected_pcm and streamed == expected_pcm
    assert final.finish_reason == "stop"
    wav = client.audio.speech.create(model=MODEL, voice="aiden", input=text, extra_body={"temperature": 0}).read()
    samples, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000 and samples.tobytes() == expected_pcm


def test_speech_stream_formats_with_the_openai_client(client: openai.OpenAI, pipeline: Any) -> None:
    """`stream_format="sse"`: speech.audio.delta events whose audio joins into the same bytes as
    `stream_format="audio"` gives, then speech.audio.done with usage."""
    import json

    text = "Seven swans swim by the bridge."
    raw = client.audio.speech.create(model=MODEL, voice="chelsie", input=text, response_format="pcm",
                                     stream_format="audio", extra_body={"temperature": 0}).read()
    events: list[dict[str, Any]] = []
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="chelsie", input=text, response_format="pcm", stream_format="sse",
        extra_body={"temperature": 0},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"} and len(kinds) > 2
    streamed = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    _, expected_pcm, final = python_api(pipeline.speak(text, speaker="chelsie", talker_sampling=GREEDY_TALKER))
    assert len(raw) > 0 and raw == streamed == expected_pcm
    usage = events[-1]["usage"]
    assert usage["input_tokens"] == final.usage["prompt_tokens"] + final.usage["completion_tokens"]
    assert usage["output_tokens"] == final.usage["audio_frames"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    with client.audio.speech.with_streaming_response.create(  # wav as events: a stream header, then the PCM
        model=MODEL, voice="chelsie", input=text, stream_format="sse", extra_body={"temperature": 0},
    ) as response:
        pieces = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    wav = b"".join(base64.b64decode(e["audio"]) for e in pieces if e["type"] == "speech.audio.delta")
    assert wav[:4] == b"RIFF" and wav.endswith(expected_pcm)


def test_models_health_ready_metrics(client: openai.OpenAI, serve_url: str) -> None:
    import httpx

    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{serve_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{serve_url}/ready").status_code == 200
    metrics = httpx.get(f"{serve_url}/metrics").text
    for name in ("omni_requests_total", "omni_time_to_first_token_seconds", "omni_time_to_first_audio_seconds",
                 "omni_time_to_first_audio_received_seconds", "omni_time_to_first_audio_sent_seconds",
                 "omni_request_path_seconds",
                 "omni_real_time_factor", "omni_stage_waiting", "omni_stage_running"):
        assert name in metrics, name
    assert 'omni_stage_replicas{stage="talker"} 1.0' in metrics
    assert f'omni_stage_replicas{{stage="ingress"}} {float(INGRESS_REPLICAS)}' in metrics
    counts = _counts(metrics)
    # the earlier streamed replies with audio say when their first chunk was handed on
    assert counts["omni_time_to_first_audio_sent_seconds_count"] > 0
    # a request that says when it left (X-Request-Start) gets its way in measured
    started = time.time_ns() // 1000
    reply = httpx.post(f"{serve_url}/v1/chat/completions", headers={"X-Request-Start": f"t={started}"}, timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert reply.status_code == 200
    # whichever ingress replica served it, and whichever serves /metrics, the page counts it once (each replica
    # posts its samples every 0.25 s)
    deadline = time.time() + 5
    while True:
        after = _counts(httpx.get(f"{serve_url}/metrics").text)
        if after["omni_request_path_seconds_count"] != counts["omni_request_path_seconds_count"] or time.time() > deadline:
            break
        time.sleep(0.1)
    assert after["omni_request_path_seconds_count"] == counts["omni_request_path_seconds_count"] + 1
    way_in = after["omni_request_path_seconds_sum"] - counts["omni_request_path_seconds_sum"]
    assert 0 <= way_in < time.time() - started / 1e6
    # the earlier tests of this module spoke: the vocoder reports the work its decode thread has done
    vocoder = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("omni_stage_decode_") and 'stage="vocoder"' in line}
    assert vocoder["omni_stage_decode_busy_s"] > 0 and vocoder["omni_stage_decode_frames"] > 0, vocoder
    assert 0 < vocoder["omni_stage_decode_calls"] <= vocoder["omni_stage_decode_windows"], vocoder
    # the engines count their prefill batches and the requests in them (the earlier tests' requests came one by one)
    for stage in ("thinker", "talker"):
        prefills = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("omni_stage_prefill") and f'stage="{stage}"' in line}
        assert 0 < prefills["omni_stage_prefill_batches"] <= prefills["omni_stage_prefilled_sequences"], (stage, prefills)
    # every stage replica says how long its startup took, by phase: the engines loaded weights and warmed up
    startup = {(line.split("{")[0], line.split('stage="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines() if line.startswith("omni_stage_startup_")}
    for stage in ("thinker", "talker", "vocoder"):
        assert startup[("omni_stage_startup_load_s", stage)] > 0, startup
        assert startup[("omni_stage_startup_warmup_s", stage)] > 0, startup
        assert startup[("omni_stage_startup_process_s", stage)] > 0, startup
    assert startup[("omni_stage_startup_load_s", "encoder")] > 0, startup
    # the stages with CUDA graph caches report what their pools keep beyond the graphs' outputs (none: on a CPU no
    # graphs are captured)
    kept = {line.split('stage="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines() if line.startswith("omni_stage_graph_pool_kept_blocks{")}
    assert kept == {"thinker": 0.0, "talker": 0.0, "vocoder": 0.0}, kept
    gauges = {(line.split("{")[0], line.split('stage="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line.startswith("omni_stage_") and 'stage="' in line}
    # every stage replica times its process's garbage collections; the tiny layout does not freeze startup's objects
    for stage in ("encoder", "thinker", "talker", "vocoder"):
        assert gauges[("omni_stage_gc_collections", stage)] > 0 and gauges[("omni_stage_gc_pause_s", stage)] > 0
        assert gauges[("omni_stage_gc_frozen_objects", stage)] == 0
    # the engines' step tails: the p90, and the wait in the runner's collect
    for stage in ("thinker", "talker"):
        assert gauges[("omni_stage_step_ms_p90", stage)] >= gauges[("omni_stage_step_ms_p50", stage)] > 0
        assert gauges[("omni_stage_collect_ms_mean", stage)] > 0, stage


def _counts(metrics: str) -> dict[str, float]:
    """Unlabelled samples of a /metrics page by name."""
    return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line and not line.startswith("#") and "{" not in line.split(" ")[0]}
