"""End to end on Ray: the four-stage pipeline's tokens and codes equal transformers' greedy generate()."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from _reference import run_pipeline, run_transformers, snr_db, wav_part

# The streamed audio uses 25 frames of left context; transformers decodes the whole reply at once. The
# streaming-vocoder tests measure ~48-54 dB for this context on a random Code2Wav; 30 dB leaves room for
# the tiny checkpoint's different weights while still failing on any misaligned or missing chunk (~0 dB).
STREAM_SNR_FLOOR_DB = 30.0


def _check(reply: Any, ref_tokens: list[int], ref_codes: torch.Tensor, ref_wav: torch.Tensor) -> None:
    assert reply.token_ids == ref_tokens
    assert reply.codes.shape == ref_codes.shape, (reply.codes.shape, ref_codes.shape)
    assert torch.equal(reply.codes, ref_codes.to(reply.codes.dtype))
    assert reply.pcm.shape[0] == ref_wav.shape[0]
    assert snr_db(ref_wav.numpy(), reply.pcm) > STREAM_SNR_FLOOR_DB


def test_text_prompt_matches_transformers(pipeline: Any, hf_model: Any) -> None:
    messages = [
        {"role": "system", "content": "You are a friendly voice assistant."},
        {"role": "user", "content": "What should I cook for dinner tonight?"},
    ]
    reply = asyncio.run(run_pipeline(pipeline, messages, max_tokens=24, max_frames=14))
    ids = pipeline.prompts.build(messages).ids
    tokens, codes, wav = run_transformers(hf_model, ids, max_tokens=24, max_frames=14)
    assert len(tokens) == 24 and codes.shape == (16, 14)  # random weights: runs to both limits
    _check(reply, tokens, codes, wav)
    assert reply.final.finish_reason == "length" and reply.final.audio_finish_reason == "length"


def test_audio_prompt_matches_transformers(pipeline: Any, hf_model: Any) -> None:
    from omni_ray.audio import AudioFeatureExtractor

    part = wav_part(seconds=1.7, sample_rate=44100, channels=2, seed=3)
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this sound?"}]}]
    reply = asyncio.run(run_pipeline(pipeline, messages, max_tokens=16, max_frames=10))
    prompt = pipeline.prompts.build(messages)
    assert prompt.audio_tokens > 0
    features, _ = AudioFeatureExtractor(pipeline.checkpoint)(prompt.clips[0])
    tokens, codes, wav = run_transformers(hf_model, prompt.ids, max_tokens=16, max_frames=10, features=features)
    _check(reply, tokens, codes, wav)
    # The audio really reached the Thinker: without it the reply differs.
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is this sound?"}]}]
    assert asyncio.run(run_pipeline(pipeline, text_only, max_tokens=16, max_frames=2)).token_ids != tokens


def test_concurrent_staggered_requests_each_match_their_own_reference(pipeline: Any, hf_model: Any) -> None:
    cases = [
        ([{"role": "user", "content": "Hi."}], 60, 12),
        ([{"role": "user", "content": "Tell me a long story about a boat, the sea and the wind at night."}], 90, 9),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to five, please."}], 70, 16),
        ([{"role": "user", "content": [wav_part(1.1, 16000, 1, seed=7), {"type": "text", "text": "And this?"}]}], 80, 7),
    ]

    async def staggered(index: int) -> Any:
        await asyncio.sleep(0.04 * index)
        messages, max_tokens, max_frames = cases[index]
        return await run_pipeline(pipeline, messages, max_tokens, max_frames)

    async def all_requests() -> list[Any]:
        return await asyncio.gather(*(staggered(i) for i in range(len(cases))))

    before = asyncio.run(pipeline.stats())
    replies = asyncio.run(all_requests())
    after = asyncio.run(pipeline.stats())
    from omni_ray.audio import AudioFeatureExtractor

    extractor = AudioFeatureExtractor(pipeline.checkpoint)
    for (messages, max_tokens, max_frames), reply in zip(cases, replies):
        prompt = pipeline.prompts.build(messages)
        features = extractor(prompt.clips[0])[0] if prompt.clips else None
        tokens, codes, wav = run_transformers(hf_model, prompt.ids, max_tokens, max_frames, features)
        _check(reply, tokens, codes, wav)
    # The requests really shared engine steps (continuous batching), in both autoregressive stages.
    assert after["thinker"]["max_batch_seen"] >= 2
    assert after["talker"]["max_batch_seen"] >= 2
    assert after["thinker"]["steps"] > before["thinker"]["steps"]
    assert all(s["running"] == 0 for s in (after["thinker"], after["talker"]))


def test_first_audio_leaves_before_the_thinker_finishes(pipeline: Any) -> None:
    messages = [{"role": "user", "content": "Please talk for a long while about anything you like."}]
    reply = asyncio.run(run_pipeline(pipeline, messages, max_tokens=400, max_frames=30))
    timing = reply.final.timing
    print(
        f"\nfirst token +{timing['first_token'] - timing['submitted']:.3f}s, "
        f"first audio +{timing['first_audio'] - timing['submitted']:.3f}s, "
        f"last token +{timing['last_token'] - timing['submitted']:.3f}s"
    )
    assert len(reply.token_ids) == 400
    assert timing["first_audio"] < timing["last_token"]
    assert timing["first_audio"] <= timing["first_audio_received"]  # made by the vocoder, then relayed to the caller
    # the Thinker starts first; the Talker's and vocoder's streams open while it works
    assert timing["submitted"] < timing["streams_open"] < timing["first_audio"]
    # where the first audio's time went, in the order the reply passed each point (one host's clock). The first
    # token reaches the Talker and the caller by different ways, so their order is not fixed. The Talker's first
    # frame waits for that token's embedding (no early prefill here).
    assert timing["submitted"] <= timing["prefill_launched"] <= timing["first_token"], timing
    # the first token's message to the Talker: queued by the Thinker's relay, sent, read by the Talker's replica
    path = ("prefill_launched", "first_text_queued", "first_text_sent", "first_text_arrived", "talker_first_text",
            "first_frame_launched", "first_frame", "first_audio")
    assert [timing[a] <= timing[b] for a, b in zip(path, path[1:])] == [True] * (len(path) - 1), timing
    assert np.isfinite(reply.pcm).all() and reply.pcm.size == 30 * 1920 - 555


def test_stateful_vocoder_streams_the_one_shot_decode(ray_cluster: str, pipeline: Any, hf_model: Any) -> None:
    """The default vocoder carries state between chunks (`streaming.stateful`): its audio equals transformers'
    one-shot Code2Wav decode of the codes, not merely close to it. A vocoder that re-decodes a window of left
    context instead (`stateful: false`) gets the same tokens and codes, and audio only close to it."""
    from omni_ray.config import PipelineConfig
    from omni_ray.pipeline import Pipeline

    messages = [{"role": "user", "content": "Tell me something about the mountains."}]
    windowed = Pipeline(PipelineConfig.model_validate({"stages": {"vocoder": {"streaming": {"stateful": False}}}}))
    try:
        window = asyncio.run(run_pipeline(windowed, messages, max_tokens=20, max_frames=60))
    finally:
        windowed.shutdown()
    reply = asyncio.run(run_pipeline(pipeline, messages, max_tokens=20, max_frames=60))
    assert reply.token_ids == window.token_ids and torch.equal(reply.codes, window.codes)
    # where the rest of the reply's time went (its 20 tokens end before its 60 frames): the Thinker's end reached the
    # Talker, which then stepped past the text, made its last frame, and the vocoder its last audio
    timing = reply.final.timing
    end = ("talker_text_end", "text_read", "last_frame", "last_audio")
    assert [timing[a] <= timing[b] for a, b in zip(end, end[1:])] == [True] * (len(end) - 1), timing
    assert timing["first_token"] < timing["last_token"] and timing["first_frame"] < timing["last_frame"]
    assert timing["first_audio"] < timing["last_audio"] <= reply.final.t
    with torch.inference_mode():
        one_shot = hf_model.code2wav(reply.codes[None].long()).flatten().float().numpy()
    assert reply.pcm.shape == window.pcm.shape == one_shot.shape == (60 * 1920 - 555,)  # past 25 frames of context
    assert np.abs(reply.pcm - one_shot).max() < 1e-4 * max(1.0, float(np.abs(one_shot).max()))
    assert snr_db(one_shot, reply.pcm) > 80 > snr_db(one_shot, window.pcm) > 30  # the window path is only close


def _variant_replies(settings: dict[str, Any], cases: list[tuple[list[dict[str, Any]], int, int]]) -> tuple[list[Any], dict[str, Any]]:
    """`cases` (messages, max tokens, max frames) all at once on a pipeline built with `settings`, which is then shut
    down: the replies and each stage's stats."""
    from omni_ray.config import PipelineConfig
    from omni_ray.pipeline import Pipeline

    variant = Pipeline(PipelineConfig.model_validate(settings))
    try:
        async def all_requests() -> list[Any]:
            return await asyncio.gather(*(run_pipeline(variant, m, t, f) for m, t, f in cases))

        replies = asyncio.run(all_requests())
        stats = asyncio.run(variant.stats())
    finally:
        variant.shutdown()
    return replies, stats


def _check_all(hf_model: Any, pipeline: Any, cases: list[tuple[list[dict[str, Any]], int, int]], replies: list[Any]) -> None:
    from omni_ray.audio import AudioFeatureExtractor

    extractor = AudioFeatureExtractor(pipeline.checkpoint)
    for (messages, max_tokens, max_frames), reply in zip(cases, replies):
        prompt = pipeline.prompts.build(messages)
        features = extractor(prompt.clips[0])[0] if prompt.clips else None
        _check(reply, *run_transformers(hf_model, prompt.ids, max_tokens, max_frames, features))


def test_talker_lanes_serve_each_request_as_one_lane_does(ray_cluster: str, pipeline: Any, hf_model: Any) -> None:
    """`engine.lanes: 2` runs two Talker engine loops in the replica, each with half the batch, its own KV slots and
    graphs, over one copy of the weights. Concurrent requests are spread over both lanes; each reply still equals
    transformers' greedy reference."""
    cases = [
        ([{"role": "user", "content": "Hi."}], 40, 12),
        ([{"role": "user", "content": "Tell me about the sea and the wind at night."}], 50, 9),
        ([{"role": "user", "content": "Count to five, please."}], 45, 14),
    ]
    replies, all_stats = _variant_replies({"stages": {"talker": {"engine": {"max_batch": 4, "lanes": 2}}}}, cases)
    _check_all(hf_model, pipeline, cases, replies)
    stats = all_stats["talker"]
    assert stats["lanes"] == 2 and stats["kv_total"] == 4 and stats["running"] == 0  # two lanes of two slots
    assert stats["max_batch_seen"] == 3  # 2 + 1: both lanes stepped requests (one lane holds at most 2)


def test_early_talker_prefill_keeps_every_reply_equal_to_transformers(ray_cluster: str, pipeline: Any, hf_model: Any) -> None:
    """`engine.early_prefill`: for a text-only prompt the Talker prefills as soon as the request arrives, alongside
    the Thinker's prefill, and waits only for the first reply token. Replies still equal transformers' greedy ones;
    a prompt with audio takes the usual path (the Thinker's states)."""
    cases = [
        ([{"role": "user", "content": "What should I cook tonight?"}], 40, 14),
        ([{"role": "user", "content": [wav_part(1.1, 16000, 1, seed=7), {"type": "text", "text": "And this?"}]}], 30, 8),
    ]
    replies, stats = _variant_replies({"stages": {"talker": {"engine": {"early_prefill": True}}}}, cases)
    assert stats["talker"]["early_prefills"] == 1  # the text-only request; the one with audio waited for the Thinker's states
    _check_all(hf_model, pipeline, cases, replies)


def test_steps_launched_ahead_keep_every_reply_equal_to_transformers(ray_cluster: str, pipeline: Any, hf_model: Any) -> None:
    """`engine.launch_ahead` in the Thinker and the Talker: each engine loop queues step N+1 before reading step N
    back. Concurrent replies of different lengths (ends learnt a step late) still equal transformers' greedy ones."""
    cases = [
        ([{"role": "user", "content": "Hi."}], 30, 10),
        ([{"role": "user", "content": "Tell me about the sea and the wind at night."}], 45, 13),
        ([{"role": "user", "content": [wav_part(0.9, 16000, 1, seed=3), {"type": "text", "text": "What is it?"}]}], 25, 7),
    ]
    ahead = {"engine": {"launch_ahead": True}}
    replies, stats = _variant_replies({"stages": {"thinker": ahead, "talker": ahead}}, cases)
    _check_all(hf_model, pipeline, cases, replies)
    for stage in ("thinker", "talker"):  # both loops really queued steps ahead, and nothing is left running
        assert stats[stage]["steps_launched_ahead"] > 0 and stats[stage]["running"] == 0
