"""GPU: Qwen3-TTS's Talker replayed from CUDA graphs gives the official package's codes (the goldens), as eager does;
the 12 Hz decoder's graphed stateful streams give the official audio; full-size random weights step in bfloat16 with
graphs as without. Skipped without CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omni_ray.config import ModelSource
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.loop import run_to_end
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint
from omni_ray.models.qwen3_tts.codec_decoder import load_codec_decoder, make_codec
from omni_ray.models.qwen3_tts.model_files import load_tokenizer, resolve_model
from omni_ray.models.qwen3_tts.prompt import NO_CODEC, SpeechRequest, TalkerPrompt, VoiceReference, build_prompt
from omni_ray.models.qwen3_tts.talker import TTSTalkerRunner, speech_sequence
from omni_ray.models.qwen3_tts.talker_model import TalkerAssets, TTSModelConfig, load_talker
from omni_ray.vocoder import ChunkSchedule, StatefulStreamingDecoder, step_shapes
from omni_ray.vocoder.batching import BatchingStatefulCodec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tts" / "seed0"
GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)
GREEDY = SamplingParams(temperature=0.0)


def _cases() -> dict[str, dict[str, Any]]:
    return {case["key"]: case for case in json.loads((GOLDENS / "cases.json").read_text())["cases"]}


def _runner(assets: TalkerAssets, rows: int, graphs: bool, max_len: int = 256) -> TTSTalkerRunner:
    t = assets.config.talker
    cache = SlotKVCache(t["num_hidden_layers"], rows, max_len, t["num_key_value_heads"], t["head_dim"],
                        assets.tts_pad.dtype, "cuda")
    runner = TTSTalkerRunner(assets, cache, rows, cuda_graphs=graphs)
    runner.warmup(rows)
    return runner


@pytest.mark.parametrize("variant,keys", [
    ("custom_voice", ["custom_voice_speaker-streaming", "custom_voice_instruct-non_streaming",
                      "custom_voice_dialect-streaming", "custom_voice_speaker-non_streaming"]),
    ("base", ["base_in_context-streaming", "base_x_vector_only-non_streaming", "base_in_context-non_streaming",
              "base_x_vector_only-streaming"]),
])
@pytest.mark.parametrize("graphs", [False, True])
def test_four_requests_on_the_gpu_equal_the_official_package(variant: str, keys: list[str], graphs: bool) -> None:
    directory = ensure_tiny_checkpoint(variant, 0)
    config = TTSModelConfig.from_checkpoint(directory)
    assets = load_talker(directory, config, "cuda", torch.float32)
    tokenizer = load_tokenizer(directory)
    runner = _runner(assets, 4, graphs)
    cases, seqs = _cases(), []
    for key in keys:
        case = cases[key]
        reference = None
        if variant == "base":
            codes = None if case.get("ref_codes") is None else torch.tensor(case["ref_codes"])
            reference = VoiceReference(torch.tensor(case["x_vector"]), codes, case.get("ref_text"))
        request = SpeechRequest(case["text"], case["language"], case.get("speaker"), case.get("instruct"), reference,
                                streaming_text=not case["non_streaming_mode"])
        prompt = build_prompt(request, lambda text: tokenizer.encode(text, add_special_tokens=False), config)
        seqs.append(speech_sequence(key, prompt, assets.model, case["frames"], GREEDY_TALKER, GREEDY))
        runner.admit(seqs[-1])
    outputs = run_to_end(runner, seqs)
    assert not runner.graphs.uncapturable
    for key in keys:
        assert [out.codes for out in outputs[key] if out.codes is not None] == cases[key]["codes"], key


@pytest.fixture
def exact_convolutions() -> Any:
    """float32 convolutions without TF32 (cuDNN's default rounds their inputs to 10 bits: 7e-4 off the goldens)."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


def test_graphed_stateful_streams_give_the_official_audio(exact_convolutions: Any) -> None:
    """Two streams at once (a cloned voice's, with its reference codes, and a named voice's), decoded on the chunk
    ramp from CUDA graphs."""
    cases = _cases()
    waves = load_file(str(GOLDENS / "waveforms.safetensors"))
    module = load_codec_decoder(ensure_tiny_checkpoint("base", 0), "cuda", torch.float32)
    codec = make_codec(module, cuda_graphs=True, max_streams=4)
    schedule = ChunkSchedule(left_context=16)
    codec.warmup([], 4, step_shapes(schedule, reference=True))
    batching = BatchingStatefulCodec(codec, max_batch=4)
    for key in ("base_in_context-streaming", "base_x_vector_only-non_streaming"):
        case = cases[key]
        reference = None if case.get("ref_codes") is None else torch.tensor(case["ref_codes"]).T.contiguous()
        decoder = StatefulStreamingDecoder(batching, schedule, reference_codes=reference)
        try:
            chunks = [c for frame in case["codes"] for c in decoder.push(torch.tensor(frame)[:, None])]
            last = decoder.finish()
        finally:
            decoder.close()
        audio = torch.cat([*chunks, *([last] if last is not None else [])]).cpu().numpy()
        wave = waves[key].numpy()
        lead = len(wave) - len(audio)
        assert lead in (0, 1)
        np.testing.assert_allclose(audio, wave[lead:], atol=1e-4)


def test_full_size_random_weights_step_in_bfloat16_with_graphs_as_without() -> None:
    """1.7B CustomVoice shapes, four rows of different prompts: 24 greedy frames replayed from graphs equal eager's."""
    files = resolve_model(ModelSource(family="qwen3_tts", random_weights=True))
    assets = load_talker(None, files.config, "cuda", torch.bfloat16)
    frames = {}
    for graphs in (False, True):
        runner = _runner(assets, 4, graphs, max_len=512)
        seqs = []
        for i in range(4):
            ids = [10 + (7 * i + j) % 900 for j in range(30 + 5 * i)]
            prompt = TalkerPrompt(ids, [NO_CODEC] * len(ids), text_tokens=len(ids))
            seqs.append(speech_sequence(f"r{i}", prompt, assets.model, 24, GREEDY_TALKER, GREEDY, ignore_eos=True))
            runner.admit(seqs[-1])
        outputs = run_to_end(runner, seqs)
        frames[graphs] = {rid: [out.codes for out in outs if out.codes is not None] for rid, outs in outputs.items()}
    assert all(len(codes) == 24 for codes in frames[True].values())
    assert frames[True] == frames[False]
