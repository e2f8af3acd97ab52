"""S2 Pro end to end on the tiny checkpoint (CPU): the Python pipeline's real stages speak the official greedy frames
with no reference and in a stored voice, clone a voice from one reference or two speakers' with the engine's frames,
stop on `<|im_end|>`, end at the frame cap with `length`, and speak a voice added before a restart the same after it;
and one Serve app streams /v1/audio/speech with references to the openai client and /v1/tts to a msgpack client,
keeps voices added through /v1/references, answers bad input with a 4xx envelope and keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgpack
import numpy as np
import openai
import pytest
import soundfile as sf
import torch

from _service import own_app
from conftest import SERVE_PORT
from omni_ray.config import PipelineConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.events import AudioChunk, Finished
from omni_ray.models.s2_pro.codec import load_codec
from omni_ray.models.s2_pro.prompt import Reference
from omni_ray.reference_audio import ReferenceAudio, prepare_reference_audio
from omni_ray.voice_store import VoiceStore

GOLDENS = json.loads((Path(__file__).parent / "goldens" / "s2_pro" / "dual_ar_seed0.json").read_text())
REFERENCE = Path(__file__).resolve().parent / "goldens" / "qwen3_tts" / "reference.wav"  # 24 kHz speech, 2.6 s
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
GREEDY = SamplingParams(temperature=1.0, top_k=1, top_p=1.0)  # the goldens' draw
SAMPLES_PER_FRAME = 2048  # 44.1 kHz
HTTP_SAMPLES_PER_FRAME = SAMPLES_PER_FRAME * 24000 / 44100  # the service's 24 kHz
APP, PREFIX, MODEL = "s2-pro-app", "/s2-pro-app", "s2-pro"
ENGINE = {"max_batch": 4, "max_seq_len": 1024, "prefix_cache_mb": 4}  # a voice's prompt prefix is reused
VOCODER = {"left_context": 64}


def _pipeline_config(voices: Path) -> dict[str, Any]:
    return {"model": {"family": "s2_pro"}, "voices_dir": str(voices),
            "stages": {"talker": {"engine": ENGINE}, "vocoder": {"streaming": VOCODER}}}


@pytest.fixture(scope="module")
def services(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path]]:
    """The Python pipeline and one Serve app of the tiny model (and the app's voices directory), started side by
    side."""
    from ray import serve

    from omni_ray.models.s2_pro.model_files import resolve_model
    from omni_ray.pipeline import Pipeline

    resolve_model(PipelineConfig.model_validate(_pipeline_config(Path("."))).model)  # made once, before both start
    made: dict[str, Any] = {}
    starting = threading.Thread(target=lambda: made.update(pipe=Pipeline(PipelineConfig.model_validate(
        _pipeline_config(tmp_path_factory.mktemp("s2-pro-pipeline-voices"))))))
    starting.start()
    voices = tmp_path_factory.mktemp("s2-pro-voices")
    args = {"models": [{"model_name": MODEL, "pipeline": _pipeline_config(voices)}],
            "limits": {"max_audio_seconds": 20}}
    serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
    try:
        with own_app(f"http://127.0.0.1:{SERVE_PORT}", APP, PREFIX, args) as url:
            starting.join()
            yield made["pipe"], url, voices
    finally:
        starting.join()
        if "pipe" in made:
            made["pipe"].shutdown()


@pytest.fixture(scope="module")
def pipe(services: tuple[Any, str, Path]) -> Any:
    return services[0]


@pytest.fixture(scope="module")
def url(services: tuple[Any, str, Path]) -> str:
    return services[1]


def speak(pipeline: Any, text: str, **kwargs: Any) -> tuple[np.ndarray, int, Finished]:
    async def run() -> tuple[np.ndarray, int, Finished]:
        pcm, rates, final = [], set(), None
        async for event in pipeline.speak(text, return_codes=True, **kwargs):
            if isinstance(event, AudioChunk):
                pcm.append(event.pcm)
                rates.add(event.sample_rate)
            elif isinstance(event, Finished):
                final = event
        assert final is not None and len(rates) <= 1
        return np.concatenate(pcm) if pcm else np.zeros(0, np.float32), rates.pop() if rates else 0, final

    return asyncio.run(run())


def reference_audio() -> ReferenceAudio:
    samples, rate = sf.read(REFERENCE, dtype="float32")
    return ReferenceAudio(samples, rate, REFERENCE_TEXT)


def golden_codes(case: str) -> list[list[int]]:
    return [frame[1:] for frame in GOLDENS["cases"][case]["frames"]]


# ---- the Python pipeline -----------------------------------------------------------------------------------------

def test_speech_without_a_reference_is_the_official_greedy_frames_and_ends_at_the_cap(pipe: Any) -> None:
    case = GOLDENS["cases"]["plain"]
    frames = len(case["frames"])  # no <|im_end|> among them
    audio, rate, final = speak(pipe, case["text"], sampling=GREEDY, max_audio_frames=frames)
    assert final.codes is not None and final.codes.T.tolist() == golden_codes("plain")
    assert (final.finish_reason, final.usage["audio_frames"]) == ("length", frames)
    assert rate == 44100 and audio.shape == (frames * SAMPLES_PER_FRAME,) and np.abs(audio).max() > 0
    one_shot = load_codec(pipe.orchestrator.files.directory).decode(final.codes)  # windows reaching frame 0: exact
    np.testing.assert_allclose(audio, one_shot.numpy(), atol=1e-5)


def engine_frames(pipe: Any, text: str, references: list[Reference], frames: int,
                  sampling: SamplingParams = GREEDY) -> tuple[list[list[int]], str | None]:
    """The codec frames and finish reason of the Dual-AR runner alone, in this process, on the same checkpoint."""
    from omni_ray.engine.loop import run_to_end
    from omni_ray.models.s2_pro.dual_ar_runner import dual_ar_sequence, load

    runner = load(pipe.orchestrator.files.directory, 1, dtype=torch.float32, cuda_graphs=False)
    alone = dual_ar_sequence("alone", runner.prompt(text, references), frames, sampling)
    runner.admit(alone)
    outputs = run_to_end(runner, [alone])[alone.request_id]
    return [out.codes[1:] for out in outputs if out.codes is not None], alone.finish_reason


def test_two_speakers_references_clone_with_the_engines_frames(pipe: Any) -> None:
    samples, rate = sf.read(REFERENCE, dtype="float32")
    halves = [ReferenceAudio(half, rate, text) for half, text in
              zip(np.array_split(samples, 2), ("First voice here.", "<|speaker:1|>Second voice, already tagged."))]
    codec = load_codec(pipe.orchestrator.files.directory)
    encoded = [Reference(codec.encode(torch.from_numpy(prepare_reference_audio(ref.samples, rate, target_rate=44100))),
                         str(ref.text)) for ref in halves]
    expected, _ = engine_frames(pipe, "Two voices.", encoded, 6)
    _, _, final = speak(pipe, "Two voices.", references=halves, sampling=GREEDY, max_audio_frames=6)
    assert final.codes is not None and final.codes.T.tolist() == expected and len(expected) >= 1


def test_a_sampled_reply_that_draws_im_end_stops_there_with_the_engines_frames(pipe: Any) -> None:
    """Seed 24 of the official API's draw makes the tiny model end this text with `<|im_end|>` after 23 frames."""
    from omni_ray.models.s2_pro.dual_ar_runner import DEFAULT_SAMPLING

    text, sampling = GOLDENS["cases"]["plain"]["text"], DEFAULT_SAMPLING.model_copy(update={"seed": 24})
    expected, reason = engine_frames(pipe, text, [], 40, sampling)
    audio, _, final = speak(pipe, text, sampling=sampling, max_audio_frames=40)
    assert reason == final.finish_reason == "stop" and len(expected) == 23
    assert final.codes is not None and final.codes.T.tolist() == expected
    assert final.usage["audio_frames"] == 23 and audio.size == 23 * SAMPLES_PER_FRAME


def test_a_stored_voice_speaks_the_official_frames_of_its_reference(pipe: Any) -> None:
    case = GOLDENS["cases"]["one_reference"]
    (reference,) = case["references"]
    store = pipe.orchestrator.voice_store
    store.save_tensors("golden_speaker", {"codes": torch.tensor(reference["codes"])}, reference["text"],
                       len(reference["codes"][0]), 1.0)
    for _ in range(2):  # prefilled whole, then from the voice's prefix in the Talker's prefix cache
        _, _, final = speak(pipe, case["text"], voice="golden_speaker", sampling=GREEDY,
                            max_audio_frames=len(case["frames"]))
        assert final.codes is not None and final.codes.T.tolist() == golden_codes("one_reference")
    assert asyncio.run(pipe.stats())["talker"]["prefix_cache_hits"] >= 1


def test_reference_audio_is_encoded_by_the_codec_and_clones_like_the_voice_stored_from_it(pipe: Any) -> None:
    reference = reference_audio()
    _, _, cloned = speak(pipe, "A cloned voice.", references=[reference], sampling=GREEDY, max_audio_frames=6)
    _, _, plain = speak(pipe, "A cloned voice.", sampling=GREEDY, max_audio_frames=6)
    entry = asyncio.run(pipe.orchestrator.add_voice("tea", reference))
    stored = pipe.orchestrator.voice_store.load_tensors("tea")
    at_44k = prepare_reference_audio(reference.samples, reference.sample_rate, target_rate=44100)
    expected = load_codec(pipe.orchestrator.files.directory).encode(torch.from_numpy(at_44k))
    assert torch.equal(stored.tensors["codes"], expected) and stored.text == REFERENCE_TEXT
    assert entry["frames"] == expected.shape[1] == -(-at_44k.size // SAMPLES_PER_FRAME)
    _, _, by_voice = speak(pipe, "A cloned voice.", voice="tea", sampling=GREEDY, max_audio_frames=6)
    assert cloned.codes is not None and plain.codes is not None and by_voice.codes is not None
    assert torch.equal(cloned.codes, by_voice.codes) and not torch.equal(cloned.codes, plain.codes)


def test_unusable_requests_are_refused_before_any_stage_runs(pipe: Any) -> None:
    async def first(**kwargs: Any) -> Any:
        return await anext(pipe.speak(**kwargs))

    untranscribed = ReferenceAudio(reference_audio().samples, 24000, None)
    too_short = ReferenceAudio(np.full(2400, 0.1, np.float32), 24000, "Hi.")
    for kwargs, message in [({"text": " "}, "must not be empty"),
                            ({"text": "Hi.", "references": [untranscribed]}, "transcript"),
                            ({"text": "Hi.", "references": [too_short]}, "at least"),
                            ({"text": "Hi.", "max_audio_frames": 0}, "at least 1")]:
        with pytest.raises(InvalidRequestError, match=message):
            asyncio.run(first(**kwargs))


def test_a_voice_added_before_a_restart_speaks_the_same_frames_after_it(pipe: Any) -> None:
    """The module's last use of the Python pipeline: it is shut down, and a new one on the same voices directory lists
    the voice and speaks in it with the frames it gave before (greedy), the engine's frames of its stored codes."""
    from omni_ray.pipeline import Pipeline

    entry = asyncio.run(pipe.orchestrator.add_voice("harbour_voice", reference_audio()))
    text = GOLDENS["cases"]["long_text"]["text"]
    _, _, before = speak(pipe, text, voice="harbour_voice", sampling=GREEDY, max_audio_frames=6)
    listed = asyncio.run(pipe.orchestrator.list_voices())
    stored = pipe.orchestrator.voice_store.load_tensors("harbour_voice").tensors["codes"]
    pipe.shutdown()
    restarted = Pipeline(pipe.config)
    try:
        assert restarted.orchestrator.voice_store.directory == pipe.orchestrator.voice_store.directory
        assert asyncio.run(restarted.orchestrator.list_voices()) == listed
        assert any(voice["name"] == "harbour_voice" for voice in listed) and entry["frames"] == stored.shape[1]
        _, _, after = speak(restarted, text, voice="harbour_voice", sampling=GREEDY, max_audio_frames=6)
        expected, _ = engine_frames(restarted, text, [Reference(stored, REFERENCE_TEXT)], 6)
    finally:
        restarted.shutdown()
    assert before.codes is not None and after.codes is not None
    assert torch.equal(after.codes, before.codes) and after.codes.T.tolist() == expected


# ---- over HTTP ---------------------------------------------------------------------------------------------------

def _whole_frames(samples: int, at_most: int) -> bool:
    """Whether `samples` 24 kHz samples are the audio of a whole number of frames, 1 to `at_most`."""
    return any(abs(samples - frames * HTTP_SAMPLES_PER_FRAME) <= 2 for frames in range(1, at_most + 1))


def _wav_b64() -> str:
    return base64.b64encode(REFERENCE.read_bytes()).decode()


def post_msgpack(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/tts", content=msgpack.packb(body, use_bin_type=True), timeout=120,
                      headers={"content-type": "application/msgpack"})


def test_the_openai_client_streams_speech_cloned_from_references(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"references": [{"audio": _wav_b64(), "text": REFERENCE_TEXT}], "temperature": 0, "max_new_tokens": 6,
             "stream": True}
    with client.audio.speech.with_streaming_response.create(model=MODEL, voice="unused", input="Hello there.",
                                                            response_format="pcm", extra_body=extra) as response:
        pieces = list(response.iter_bytes())
    pcm = np.frombuffer(b"".join(pieces), np.int16)
    assert _whole_frames(pcm.size, 6) and np.abs(pcm).max() > 0


def _wav_at_44k() -> bytes:
    """The reference speech as a 44.1 kHz file with a 15 kHz tone over it, which a trip through 24 kHz would lose."""
    samples, rate = sf.read(REFERENCE, dtype="float32")
    speech = prepare_reference_audio(samples, rate, target_rate=44100)
    tone = 0.3 * np.sin(2 * np.pi * 15000 * np.arange(speech.size) / 44100)
    buffer = io.BytesIO()
    sf.write(buffer, (0.6 * speech + tone).astype(np.float32), 44100, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def test_a_msgpack_client_streams_tts_and_a_voice_added_through_references_speaks_the_same(
        services: tuple[Any, str, Path]) -> None:
    """The stored voice's codes are the codec's of the audio at its own rate, and speak as the request's did."""
    pipe, url, voices = services
    reference = _wav_at_44k()
    body = {"text": "A voice from fish.", "references": [{"audio": reference, "text": REFERENCE_TEXT}],
            "format": "pcm", "streaming": True, "max_new_tokens": 5, "temperature": 0.7, "seed": 3}
    with httpx.stream("POST", f"{url}/v1/tts", content=msgpack.packb(body, use_bin_type=True), timeout=120,
                      headers={"content-type": "application/msgpack"}) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/octet-stream"
        assert response.headers["x-sample-rate"] == "44100"  # fish-speech's clients play the codec's own rate
        streamed = b"".join(response.iter_bytes())
    assert (len(streamed) // 2) % SAMPLES_PER_FRAME == 0 and 0 < len(streamed) // 2 <= 5 * SAMPLES_PER_FRAME
    added = httpx.post(f"{url}/v1/references/add", params={"format": "json"}, timeout=120,
                       data={"id": "Tea", "text": REFERENCE_TEXT},
                       files={"audio": ("tea.wav", reference, "audio/wav")})
    assert added.status_code == 200, added.text
    listed = httpx.get(f"{url}/v1/references/list", params={"format": "json"}, timeout=30).json()
    assert "Tea" in listed["reference_ids"]
    samples, _ = sf.read(io.BytesIO(reference), dtype="float32")
    codec = load_codec(pipe.orchestrator.files.directory)
    assert torch.equal(VoiceStore(voices).load_tensors("Tea").tensors["codes"], codec.encode(torch.from_numpy(samples)))
    by_id = post_msgpack(url, {**body, "references": [], "reference_id": "Tea", "streaming": False})
    assert by_id.status_code == 200 and by_id.content == streamed  # seeded: the stored codes are the request's
    whole = post_msgpack(url, {**body, "references": [], "reference_id": "Tea", "streaming": False, "format": "wav"})
    audio, rate = sf.read(io.BytesIO(whole.content), dtype="int16")
    assert rate == 44100 and audio.tobytes() == streamed
    voices = httpx.get(f"{url}/v1/audio/voices", timeout=30).json()["data"]  # the same store through OpenAI's route
    frames = -(-samples.size // SAMPLES_PER_FRAME)
    assert [(voice["name"], voice["text"], voice["frames"]) for voice in voices] == [("Tea", REFERENCE_TEXT, frames)]
    assert httpx.delete(f"{url}/v1/audio/voices/Tea", timeout=30).json()["deleted"] is True
    assert post_msgpack(url, {**body, "references": [], "reference_id": "Tea"}).status_code == 404


def test_bad_input_is_a_4xx_envelope_and_the_service_keeps_serving(url: str) -> None:
    untranscribed = httpx.post(f"{url}/v1/audio/speech", timeout=60, json={
        "model": MODEL, "input": "Hi.", "references": [{"audio": _wav_b64()}]})
    assert untranscribed.status_code == 400
    assert untranscribed.json()["error"]["code"] == "missing_ref_text"
    unknown = post_msgpack(url, {"text": "Hi.", "reference_id": "nobody", "format": "pcm"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"]
    spoken = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
        "model": MODEL, "input": "Still here.", "response_format": "pcm", "max_new_tokens": 3, "temperature": 0})
    assert spoken.status_code == 200 and _whole_frames(len(spoken.content) // 2, 3)
    assert spoken.headers["X-Finish-Reason"] in ("stop", "length")
