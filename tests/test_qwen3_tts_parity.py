"""Qwen3-TTS's Talker against the official package (goldens of qwen-tts 0.1.1 on the tiny checkpoints, seeds 0 and
1): the prompt of every variant and form position by position, every frame's 16 codes under greedy decoding, one
request at a time and four at once, and the streamed audio against the official waveform."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint
from omni_ray.models.qwen3_tts.codec_decoder import load_codec_decoder, make_codec
from omni_ray.models.qwen3_tts.model_files import load_tokenizer
from omni_ray.models.qwen3_tts.prompt import NO_CODEC, SpeechRequest, TalkerPrompt, VoiceReference, build_prompt
from omni_ray.engine.loop import run_to_end
from omni_ray.models.qwen3_tts.talker import TTSTalkerRunner, speech_sequence
from omni_ray.models.qwen3_tts.talker_model import TalkerAssets, TTSModelConfig, load_talker
from omni_ray.vocoder import ChunkSchedule, StatefulStreamingDecoder
from omni_ray.vocoder.batching import BatchingStatefulCodec

GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tts"
SEEDS = (0, 1)
GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)  # the package's penalty applies under greedy
GREEDY = SamplingParams(temperature=0.0)


def cases(seed: int) -> list[dict[str, Any]]:
    return json.loads((GOLDENS / f"seed{seed}" / "cases.json").read_text())["cases"]


def case_ids() -> list[tuple[int, str]]:
    return [(seed, case["key"]) for seed in SEEDS for case in cases(seed)]


def golden(seed: int, key: str) -> dict[str, Any]:
    return next(case for case in cases(seed) if case["key"] == key)


@lru_cache(maxsize=None)
def talker(variant: str, seed: int) -> tuple[TalkerAssets, Any]:
    directory = ensure_tiny_checkpoint(variant, seed)
    config = TTSModelConfig.from_checkpoint(directory)
    return load_talker(directory, config, "cpu", torch.float32), load_tokenizer(directory)


def request_of(case: dict[str, Any]) -> SpeechRequest:
    reference = None
    if case["variant"] == "base":
        codes = None if case.get("ref_codes") is None else torch.tensor(case["ref_codes"])
        reference = VoiceReference(torch.tensor(case["x_vector"]), codes, case.get("ref_text"))
    return SpeechRequest(case["text"], case["language"], case.get("speaker"), case.get("instruct"), reference,
                         streaming_text=not case["non_streaming_mode"])


def prompt_of(case: dict[str, Any], seed: int) -> TalkerPrompt:
    assets, tokenizer = talker(case["variant"], seed)
    return build_prompt(request_of(case), lambda text: tokenizer.encode(text, add_special_tokens=False), assets.config)


def runner(assets: TalkerAssets, rows: int) -> TTSTalkerRunner:
    t = assets.config.talker
    cache = SlotKVCache(t["num_hidden_layers"], rows, 256, t["num_key_value_heads"], t["head_dim"], torch.float32, "cpu")
    return TTSTalkerRunner(assets, cache, rows, cuda_graphs=False)


def speak(seed: int, keys: list[str]) -> dict[str, list[list[int]]]:
    """The goldens' cases `keys` (one variant) stepped together in one runner, greedy, to the goldens' frame count."""
    chosen = [golden(seed, key) for key in keys]
    assets, _ = talker(chosen[0]["variant"], seed)
    run = runner(assets, len(keys))
    seqs = []
    for case in chosen:
        seq = speech_sequence(case["key"], prompt_of(case, seed), assets.model, case["frames"], GREEDY_TALKER, GREEDY)
        run.admit(seq)
        seqs.append(seq)
    outputs = run_to_end(run, seqs)
    return {key: [out.codes for out in outs if out.codes is not None] for key, outs in outputs.items()}


@pytest.mark.parametrize("seed,key", case_ids())
def test_the_prompt_is_the_packages_position_by_position(seed: int, key: str) -> None:
    case = golden(seed, key)
    prompt = prompt_of(case, seed)
    expected = case["prompt"]
    assert len(prompt) == len(expected)
    for position, want in enumerate(expected):
        assert prompt.text_ids[position] == want["text"], position
        if "codec" in want:
            assert prompt.codec_ids[position] == want["codec"], position
        elif "x_vector" in want:
            assert prompt.speaker_position == position
        elif "ref_frame" in want:
            assert prompt.reference_start + want["ref_frame"] == position
        else:
            assert prompt.codec_ids[position] == NO_CODEC and prompt.speaker_position != position, position
    config = talker(case["variant"], seed)[0].config
    for step in range(len(case["trailing_text"]) + 2):  # each decode step's text: the package's, then tts_pad
        want = case["trailing_text"][step] if step < len(case["trailing_text"]) else config.tts_pad_token_id
        assert decode_text(prompt, step, config) == want, step


def decode_text(prompt: TalkerPrompt, step: int, config: TTSModelConfig) -> int:
    """The text id decode step `step` reads (the codec Talker's rule: past the prompt's share, then tts_eos once,
    then tts_pad)."""
    index = step + prompt.text_offset
    if index < len(prompt.trailing_ids):
        return prompt.trailing_ids[index]
    return config.tts_eos_token_id if index == len(prompt.trailing_ids) else config.tts_pad_token_id


@pytest.mark.parametrize("seed,key", case_ids())
def test_every_frame_equals_the_official_packages(seed: int, key: str) -> None:
    case = golden(seed, key)
    assert speak(seed, [key])[key] == case["codes"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("keys", [
    ["custom_voice_speaker-streaming", "custom_voice_instruct-non_streaming", "custom_voice_dialect-streaming",
     "custom_voice_speaker-non_streaming"],
    ["base_in_context-streaming", "base_x_vector_only-non_streaming", "base_in_context-non_streaming",
     "base_x_vector_only-streaming"],
])
def test_four_requests_at_once_each_equal_the_official_package(seed: int, keys: list[str]) -> None:
    frames = speak(seed, keys)
    for key in keys:
        assert frames[key] == golden(seed, key)["codes"], key


def _snr_db(signal: np.ndarray, reference: np.ndarray) -> float:
    noise = float(np.sum((signal - reference) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(reference**2)) / noise)


@pytest.mark.parametrize("seed,key", [(0, "custom_voice_speaker-non_streaming"), (1, "voice_design-streaming"),
                                      (0, "base_in_context-streaming"), (1, "base_x_vector_only-non_streaming")])
def test_the_streamed_audio_equals_the_official_waveform(seed: int, key: str) -> None:
    """The shared stateful vocoder on the chunk ramp (1, 2, 4, then 8), fed the golden frames one at a time; a cloned
    voice's stream has the reference codes as its left context. The official clone cut may keep one sample of the
    reference's audio: the stream starts at the first new frame's."""
    case = golden(seed, key)
    wave = load_file(str(GOLDENS / f"seed{seed}" / "waveforms.safetensors"))[key].numpy()
    module = load_codec_decoder(ensure_tiny_checkpoint(case["variant"], seed))
    codec = BatchingStatefulCodec(make_codec(module, cuda_graphs=False, max_streams=2))
    reference = None if case.get("ref_codes") is None else torch.tensor(case["ref_codes"]).T.contiguous()
    decoder = StatefulStreamingDecoder(codec, ChunkSchedule(), reference_codes=reference)
    try:
        chunks = [chunk for frame in case["codes"] for chunk in decoder.push(torch.tensor(frame)[:, None])]
        last = decoder.finish()
    finally:
        decoder.close()
    streamed = torch.cat([*chunks, *([last] if last is not None else [])]).numpy()
    lead = wave.shape[0] - streamed.shape[0]
    assert lead in (0, 1) and (lead == 0 or case.get("ref_codes") is not None)
    np.testing.assert_allclose(streamed, wave[lead:], atol=1e-4)
    assert _snr_db(streamed, wave[lead:]) >= 45


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("key", ["base_in_context-streaming", "base_in_context-non_streaming",
                                 "base_x_vector_only-streaming", "custom_voice_instruct-non_streaming"])
def test_a_voice_seen_before_reuses_its_prefix_and_speaks_the_same(seed: int, key: str) -> None:
    """The second request in a voice finds the voice's leading positions (speaker, language, and a cloned voice's
    reference transcript) in the prefix cache, prefills only the rest, and its frames still equal the package's;
    another text in the same voice reuses the prefix too."""
    case = golden(seed, key)
    assets, tokenizer = talker(case["variant"], seed)
    t = assets.config.talker
    cache = SlotKVCache(t["num_hidden_layers"], 2, 256, t["num_key_value_heads"], t["head_dim"], torch.float32, "cpu")
    run = TTSTalkerRunner(assets, cache, 2, cuda_graphs=False, prefix_cache_bytes=1 << 24)
    prompt = prompt_of(case, seed)
    shared = prompt.shared_prefix()
    assert shared is not None and 0 < shared[1] < len(prompt)
    for attempt in range(2):
        seq = speech_sequence(key, prompt_of(case, seed), assets.model, case["frames"], GREEDY_TALKER, GREEDY)
        run.admit(seq)
        frames = [out.codes for out in run_to_end(run, [seq])[key] if out.codes is not None]
        assert frames == case["codes"], attempt
    assert run.prefix_cache is not None
    assert (run.prefix_cache.hits, run.prefix_cache.misses) == (1, 1)
    assert run.prefix_cache.reused_positions == shared[1]
    other = request_of(case)
    other.text = "A different sentence in the same voice."
    tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert build_prompt(other, tokenize, assets.config).shared_prefix() == shared
