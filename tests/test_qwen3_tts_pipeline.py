"""Qwen3-TTS through the Python API's real stages (Ray actors, tiny checkpoints): a named voice and a cloned one equal
the official package frame for frame and in audio, a reply that never samples EOS ends at its text-proportional
frame cap with finish_reason length, and a request the variant cannot serve is refused before any stage runs."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import soundfile as sf
from safetensors.torch import load_file

from omni_ray.config import PipelineConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.events import AudioChunk, Finished
from omni_ray.reference_audio import ReferenceAudio

GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tts"
GREEDY = {"sampling": SamplingParams(temperature=0.0, repetition_penalty=1.05),
          "code_sampling": SamplingParams(temperature=0.0)}


def golden(key: str) -> tuple[dict[str, Any], np.ndarray]:
    cases = json.loads((GOLDENS / "seed0" / "cases.json").read_text())["cases"]
    case = next(c for c in cases if c["key"] == key)
    return case, load_file(str(GOLDENS / "seed0" / "waveforms.safetensors"))[key].numpy()


def speak(pipeline: Any, text: str, **kwargs: Any) -> tuple[np.ndarray, Finished]:
    async def run() -> tuple[np.ndarray, Finished]:
        pcm, final = [], None
        async for event in pipeline.speak(text, return_codes=True, **kwargs):
            if isinstance(event, AudioChunk):
                pcm.append(event.pcm)
            elif isinstance(event, Finished):
                final = event
        assert final is not None
        return (np.concatenate(pcm) if pcm else np.zeros(0, np.float32)), final

    return asyncio.run(run())


def _pipeline(variant: str) -> Iterator[Any]:
    from omni_ray.pipeline import Pipeline

    pipe = Pipeline(PipelineConfig.model_validate({"model": {"family": "qwen3_tts", "variant": variant}}))
    yield pipe
    pipe.shutdown()


@pytest.fixture(scope="module")
def custom_voice(ray_cluster: str) -> Iterator[Any]:
    yield from _pipeline("custom_voice")


@pytest.fixture(scope="module")
def base(ray_cluster: str) -> Iterator[Any]:
    yield from _pipeline("base")


def test_a_named_voice_equals_the_official_package(custom_voice: Any) -> None:
    case, wave = golden("custom_voice_instruct-non_streaming")
    audio, final = speak(custom_voice, case["text"], voice=case["speaker"], language=case["language"],
                         instructions=case["instruct"], max_audio_frames=case["frames"], **GREEDY)
    assert final.codes is not None and final.codes.T.tolist() == case["codes"]
    np.testing.assert_allclose(audio, wave, atol=1e-4)
    assert (final.finish_reason, final.audio_finish_reason) == ("length", "length")  # the cap the goldens stop at


def test_a_reply_that_never_samples_eos_ends_at_its_text_proportional_cap(custom_voice: Any) -> None:
    text = "Hello there."
    audio, final = speak(custom_voice, text, voice="ryan", ignore_eos=True, **GREEDY)
    talker = PipelineConfig().stages.talker.engine
    tokens = len(custom_voice.tokenizer.encode(text, add_special_tokens=False))
    expected = talker.frame_budget_base + int(talker.frames_per_text_token * tokens)
    assert final.finish_reason == "length" and final.audio_finish_reason == "length"
    assert final.usage["audio_frames"] == expected and len(audio) == expected * 1920


@pytest.mark.parametrize("key", ["base_in_context-streaming", "base_x_vector_only-non_streaming"])
def test_a_cloned_voice_from_reference_audio_equals_the_official_package(base: Any, key: str) -> None:
    """The reference stage encodes the wav (codes and x-vector), the Talker prompts with them, and the vocoder's
    stream has the reference codes as its left context; the official clone output may hold one more sample, from
    the reference's audio, before the first new frame's."""
    case, wave = golden(key)
    samples, rate = sf.read(io.BytesIO((GOLDENS / "reference.wav").read_bytes()), dtype="float32")
    reference = ReferenceAudio(samples, rate, case.get("ref_text"), bool(case.get("x_vector_only_mode")))
    audio, final = speak(base, case["text"], language=case["language"], reference=reference,
                         streaming_text=not case["non_streaming_mode"], max_audio_frames=case["frames"], **GREEDY)
    assert final.codes is not None and final.codes.T.tolist() == case["codes"]
    lead = len(wave) - len(audio)
    assert lead in (0, 1)
    np.testing.assert_allclose(audio, wave[lead:], atol=1e-4)


@pytest.mark.parametrize("kwargs,message", [
    ({"voice": "nobody"}, "unknown voice"),
    ({"voice": "ryan", "language": "klingon"}, "language"),
    ({"voice": "ryan", "task_type": "Base"}, "task_type"),
    ({"reference": ReferenceAudio(np.zeros(24000, np.float32), 24000, "hi")}, "Base model"),
])
def test_a_request_the_variant_cannot_serve_is_refused_with_its_reason(custom_voice: Any, kwargs: dict[str, Any],
                                                                      message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        speak(custom_voice, "Hello.", **kwargs)
    _, final = speak(custom_voice, "Hello.", voice="ryan", max_audio_frames=3, **GREEDY)  # and it keeps serving
    assert final.usage["audio_frames"] == 3


@pytest.mark.parametrize("reference,message", [
    (ReferenceAudio(np.zeros(48000, np.float32), 24000, "hi"), "silent"),
    (ReferenceAudio(np.full(2400, 0.1, np.float32), 24000, "hi"), "at least 1 s"),
    (ReferenceAudio(np.full(48000, 0.1, np.float32), 24000, None), "ref_text"),
])
def test_unusable_reference_audio_is_refused_before_any_stage_runs(base: Any, reference: ReferenceAudio,
                                                                   message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        speak(base, "Hello.", reference=reference)
