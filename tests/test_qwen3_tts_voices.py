"""Qwen3-TTS stored voices: the on-disk store (bit-exact, atomic, shared, named safely, capped) and, through the real
Pipeline, a voice uploaded once and spoken in by name, the same as its reference audio, before and after a restart."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omni_ray.config import PipelineConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.models.qwen3_tts.prompt import VoiceReference
from omni_ray.models.qwen3_tts.voices import (
    InvalidVoiceNameError, TooManyVoicesError, VoiceExistsError, VoiceNotFoundError, VoiceStore, default_voices_dir,
)

GOLDENS = Path(__file__).parent / "goldens" / "qwen3_tts"
TRANSCRIPT = "The morning was cold, so I made a pot of tea."


def in_context_voice(frames: int = 20, seed: int = 0) -> VoiceReference:
    generator = torch.Generator().manual_seed(seed)
    x_vector = torch.randn(64, generator=generator)
    return VoiceReference(x_vector, torch.randint(0, 2048, (frames, 16), generator=generator), TRANSCRIPT)


def x_vector_only_voice(seed: int = 1) -> VoiceReference:
    return VoiceReference(torch.randn(64, generator=torch.Generator().manual_seed(seed)))


# ---------------------------------------------------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------------------------------------------------


def test_a_voice_round_trips_bit_exact(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    voice = in_context_voice()
    voice.x_vector[3] = float("nan")  # every bit pattern survives, not just ordinary numbers
    store.save("alice", voice, 2.5)
    loaded = store.load("alice")
    assert loaded.x_vector.dtype == torch.float32 and loaded.codes is not None and loaded.codes.dtype == torch.int64
    assert torch.equal(loaded.x_vector.view(torch.int32), voice.x_vector.view(torch.int32))
    assert torch.equal(loaded.codes, voice.codes) and loaded.text == TRANSCRIPT and loaded.in_context

    store.save("bob", x_vector_only_voice(), 1.0)
    bob = store.load("bob")
    assert bob.codes is None and bob.text is None and not bob.in_context
    assert torch.equal(bob.x_vector, x_vector_only_voice().x_vector)


def test_a_voice_is_one_safetensors_file_with_string_metadata(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    store.save("Alice", in_context_voice(frames=7), 0.56)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["alice.safetensors"]
    with safe_open(str(tmp_path / "alice.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == ["codes", "x_vector"]
        metadata = handle.metadata()
    assert metadata["name"] == "Alice" and metadata["text"] == TRANSCRIPT and metadata["in_context"] == "true"
    assert all(isinstance(value, str) for value in metadata.values())


def test_listing_describes_each_voice(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    assert store.list() == []  # the directory need not exist yet
    store.save("Zed", x_vector_only_voice(), 1.25)
    store.save("alice", in_context_voice(frames=30), 2.4)
    entries = store.list()
    assert [e["name"] for e in entries] == ["alice", "Zed"]
    alice, zed = entries
    assert (alice["mode"], alice["frames"], alice["seconds"], alice["text"]) == ("in_context", 30, 2.4, TRANSCRIPT)
    assert (zed["mode"], zed["frames"], zed["seconds"], zed["text"]) == ("x_vector_only", 0, 1.25, None)
    assert alice["created"] <= zed["created"] or abs(alice["created"] - zed["created"]) < 60
    assert store.info("ALICE") == alice


@pytest.mark.parametrize("name", ["", "a" * 65, "../escape", "a/b", "..", ".hidden", "a.b", "with space", "é",
                                  "nul\x00", "back\\slash", "/abs"])
def test_names_outside_the_pattern_are_refused(tmp_path: Path, name: str) -> None:
    store = VoiceStore(tmp_path / "voices")
    for attempt in (lambda: store.save(name, x_vector_only_voice(), 1.0), lambda: store.load(name),
                    lambda: store.delete(name)):
        with pytest.raises(InvalidVoiceNameError):
            attempt()
    assert not (tmp_path / "voices").exists()  # nothing was written anywhere


def test_names_are_unique_without_case(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    store.save("Alice_01-x", in_context_voice(), 1.0)
    with pytest.raises(VoiceExistsError):
        store.save("alice_01-X", x_vector_only_voice(), 1.0)
    assert store.load("ALICE_01-X").in_context  # the first one is kept
    assert store.names() == ["Alice_01-x"]


def test_unknown_voices_are_not_found(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    with pytest.raises(VoiceNotFoundError, match="no voices are stored"):
        store.load("nobody")
    store.save("alice", in_context_voice(), 1.0)
    with pytest.raises(VoiceNotFoundError, match="alice"):
        store.delete("nobody")
    with pytest.raises(VoiceNotFoundError):
        store.info("nobody")


def test_the_errors_are_client_errors_with_their_status() -> None:
    statuses = {InvalidVoiceNameError: 400, VoiceNotFoundError: 404, VoiceExistsError: 409, TooManyVoicesError: 409}
    for error, status in statuses.items():
        assert issubclass(error, InvalidRequestError) and error.status == status


def test_delete_removes_the_voice_and_frees_its_name(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    store.save("alice", in_context_voice(seed=0), 1.0)
    store.delete("ALICE")
    assert store.list() == [] and not store.exists("alice")
    with pytest.raises(VoiceNotFoundError):
        store.load("alice")
    store.save("alice", in_context_voice(seed=5), 1.0)
    assert torch.equal(store.load("alice").codes, in_context_voice(seed=5).codes)


def test_the_cap_refuses_one_more_voice_until_one_is_deleted(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, max_voices=2)
    store.save("a", x_vector_only_voice(), 1.0)
    store.save("b", x_vector_only_voice(), 1.0)
    with pytest.raises(TooManyVoicesError, match="at most 2"):
        store.save("c", x_vector_only_voice(), 1.0)
    with pytest.raises(TooManyVoicesError):
        store.check_can_add("c")
    assert store.names() == ["a", "b"]
    store.delete("a")
    store.save("c", x_vector_only_voice(), 1.0)
    assert store.names() == ["b", "c"]


def test_a_failed_write_leaves_no_voice_and_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = VoiceStore(tmp_path)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.save("alice", in_context_voice(), 1.0)
    monkeypatch.undo()
    assert store.list() == [] and [p.name for p in tmp_path.iterdir()] == [".lock"]
    store.save("alice", in_context_voice(), 1.0)
    assert store.names() == ["alice"]


def test_listing_skips_files_that_are_not_whole_voices(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    store.save("alice", in_context_voice(), 1.0)
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (tmp_path / ".bob.1234.tmp").write_bytes(b"half a voice")  # another replica's write in progress
    (tmp_path / "notes.txt").write_text("not a voice")
    assert store.names() == ["alice"]


def test_replicas_sharing_a_directory_see_each_others_voices_at_once(tmp_path: Path) -> None:
    one, other = VoiceStore(tmp_path), VoiceStore(tmp_path)
    one.save("alice", in_context_voice(), 1.0)
    assert other.names() == ["alice"] and torch.equal(other.load("alice").codes, in_context_voice().codes)
    other.delete("alice")
    assert one.names() == []
    with pytest.raises(VoiceNotFoundError):
        one.load("alice")


def test_concurrent_writers_take_a_name_once_and_listing_never_fails(tmp_path: Path) -> None:
    writers = 8
    stores = [VoiceStore(tmp_path, max_voices=1000) for _ in range(writers)]
    barrier = threading.Barrier(writers)
    outcomes: list[str] = []

    def race(index: int) -> None:
        barrier.wait()
        try:
            stores[index].save("contested", in_context_voice(seed=index), 1.0)
            outcomes.append("saved")
        except VoiceExistsError:
            outcomes.append("exists")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["exists"] * (writers - 1) + ["saved"]
    assert stores[0].names() == ["contested"]

    # one replica stores and deletes voices over and over while another lists and loads them
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        for round_ in range(40):
            for index in range(5):
                stores[1].save(f"v{index}", in_context_voice(frames=10 + index, seed=index), 1.0)
            for index in range(5):
                stores[1].delete(f"v{index}")
        stop.set()

    def read() -> None:
        while not stop.is_set():
            try:
                for entry in stores[2].list():
                    assert entry["name"] == "contested" or entry["frames"] == 10 + int(entry["name"][1:])
                    try:
                        loaded = stores[2].load(entry["name"])
                    except VoiceNotFoundError:
                        continue  # deleted since it was listed
                    assert loaded.codes is not None and loaded.codes.shape[0] == entry["frames"]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    workers = [threading.Thread(target=churn), threading.Thread(target=read), threading.Thread(target=read)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    assert stores[0].names() == ["contested"]
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_each_model_has_its_own_default_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_RAY_CACHE", str(tmp_path / "cache"))
    directories = []
    for name, hidden in (("model-a", 64), ("model-a-copy", 64), ("model-b", 128)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"hidden_size": {hidden}}}')
        directories.append(default_voices_dir(tmp_path / name))
    assert len(set(directories)) == 3
    assert all(d.parent == tmp_path / "cache" / "voices" for d in directories)
    assert default_voices_dir(tmp_path / "model-a") == directories[0]  # stable: the same after a restart


def test_voices_dir_is_a_qwen3_tts_setting() -> None:
    config = PipelineConfig.model_validate({"model": {"family": "qwen3_tts", "variant": "base"},
                                            "voices_dir": "/tmp/voices", "max_voices": 5})
    assert config.voices_dir == Path("/tmp/voices") and config.max_voices == 5
    with pytest.raises(ValueError, match="voices_dir"):
        PipelineConfig.model_validate({"voices_dir": "/tmp/voices"})
    with pytest.raises(ValueError):
        PipelineConfig.model_validate({"model": {"family": "qwen3_tts"}, "max_voices": 0})


def orchestrator_without_stages(variant: str, voices_dir: Path) -> Any:
    from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint
    from omni_ray.models.qwen3_tts.orchestrator import make_orchestrator

    checkpoint = ensure_tiny_checkpoint(variant)
    config = PipelineConfig.model_validate({"model": {"family": "qwen3_tts", "path": str(checkpoint)},
                                            "voices_dir": str(voices_dir)})
    return make_orchestrator({}, config)


def test_only_base_models_store_voices(tmp_path: Path) -> None:
    orchestrator = orchestrator_without_stages("custom_voice", tmp_path)
    assert orchestrator.voice_store is None and asyncio.run(orchestrator.list_voices()) == []
    assert "vivian" in orchestrator.voices  # its own speakers, not stored ones
    with pytest.raises(InvalidRequestError, match="Base model"):
        asyncio.run(orchestrator.add_voice("alice", reference_audio()))
    with pytest.raises(InvalidRequestError, match="Base model"):
        asyncio.run(orchestrator.delete_voice("alice"))


def test_a_voice_of_another_model_is_refused(tmp_path: Path) -> None:
    orchestrator = orchestrator_without_stages("base", tmp_path)
    foreign = VoiceReference(torch.zeros(3), torch.zeros(4, 16, dtype=torch.long), "hi")  # a 3-wide x-vector
    VoiceStore(tmp_path).save("foreign", foreign, 1.0)
    with pytest.raises(InvalidRequestError, match="another model"):
        asyncio.run(orchestrator.stored_voice("foreign"))


# ---------------------------------------------------------------------------------------------------------------------
# End to end: the real Pipeline (Ray actors, the tiny Base checkpoint)
# ---------------------------------------------------------------------------------------------------------------------

GREEDY_TALKER = SamplingParams(temperature=0.0, repetition_penalty=1.05)
GREEDY = SamplingParams(temperature=0.0)
SPEECH = "Hello there, this is a stored voice."
FRAMES = 12


@pytest.fixture(scope="module")
def ray_started() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def base_config(tmp_path_factory: pytest.TempPathFactory) -> PipelineConfig:
    from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint

    checkpoint = ensure_tiny_checkpoint("base", 0)  # made here once, not in each actor
    return PipelineConfig.model_validate({"model": {"family": "qwen3_tts", "path": str(checkpoint)},
                                          "voices_dir": str(tmp_path_factory.mktemp("voices")), "max_voices": 3})


@pytest.fixture(scope="module")
def base_pipeline(ray_started: None, base_config: PipelineConfig) -> Iterator[Any]:
    from omni_ray.pipeline import Pipeline

    pipe = Pipeline(base_config)
    yield pipe
    pipe.shutdown()


def reference_audio(x_vector_only: bool = False) -> Any:
    import soundfile as sf

    from omni_ray.reference_audio import ReferenceAudio

    samples, rate = sf.read(GOLDENS / "reference.wav", dtype="float32")
    return ReferenceAudio(samples, rate, None if x_vector_only else TRANSCRIPT, x_vector_only)


def speak_codes(pipe: Any, **voice: Any) -> torch.Tensor:
    async def run() -> torch.Tensor:
        events = [event async for event in pipe.speak(SPEECH, sampling=GREEDY_TALKER, code_sampling=GREEDY,
                                                      max_audio_frames=FRAMES, return_codes=True, **voice)]
        return events[-1].codes

    return asyncio.run(run())


def reference_encodings(pipe: Any) -> int:
    import ray

    return int(ray.get(pipe.actors["reference"].stats.remote())["completed"])


def test_speech_in_a_stored_voice_equals_speech_from_its_reference(base_pipeline: Any) -> None:
    orchestrator = base_pipeline.orchestrator
    entry = asyncio.run(orchestrator.add_voice("Tea_Voice", reference_audio()))
    assert (entry["name"], entry["mode"], entry["text"]) == ("Tea_Voice", "in_context", TRANSCRIPT)
    assert entry["frames"] > 0 and entry["seconds"] == pytest.approx(entry["frames"] / 12.5, abs=0.1)
    assert orchestrator.voices == ["Tea_Voice"]

    direct = speak_codes(base_pipeline, reference=reference_audio())
    encodings = reference_encodings(base_pipeline)
    stored = speak_codes(base_pipeline, voice="tea_voice")  # any case
    assert reference_encodings(base_pipeline) == encodings  # the stored voice skips the reference stage
    assert stored.shape[1] == FRAMES and torch.equal(stored, direct)


def test_an_x_vector_only_voice_speaks_as_its_reference_does(base_pipeline: Any) -> None:
    orchestrator = base_pipeline.orchestrator
    entry = asyncio.run(orchestrator.add_voice("plain", reference_audio(x_vector_only=True)))
    assert (entry["mode"], entry["frames"], entry["text"]) == ("x_vector_only", 0, None)
    plain = speak_codes(base_pipeline, voice="plain")
    assert torch.equal(plain, speak_codes(base_pipeline, reference=reference_audio(x_vector_only=True)))
    assert not torch.equal(plain, speak_codes(base_pipeline, voice="Tea_Voice"))  # the voice is what differs


def test_voice_requests_that_cannot_be_served_are_refused_before_any_stage(base_pipeline: Any) -> None:
    orchestrator = base_pipeline.orchestrator
    encodings = reference_encodings(base_pipeline)
    with pytest.raises(VoiceNotFoundError, match="Tea_Voice"):
        speak_codes(base_pipeline, voice="nobody")
    with pytest.raises(InvalidVoiceNameError):
        speak_codes(base_pipeline, voice="../nobody")
    with pytest.raises(VoiceExistsError):
        asyncio.run(orchestrator.add_voice("TEA_VOICE", reference_audio()))
    with pytest.raises(InvalidRequestError, match="ref_text"):
        asyncio.run(orchestrator.add_voice("no_text", type(reference_audio())(np.zeros(0, np.float32), 24000, "")))
    asyncio.run(orchestrator.add_voice("third", reference_audio(x_vector_only=True)))
    with pytest.raises(TooManyVoicesError):  # max_voices 3
        asyncio.run(orchestrator.add_voice("fourth", reference_audio()))
    assert reference_encodings(base_pipeline) == encodings + 1  # only "third" was encoded
    asyncio.run(orchestrator.delete_voice("third"))
    with pytest.raises(VoiceNotFoundError):
        asyncio.run(orchestrator.delete_voice("third"))
    assert [entry["name"] for entry in asyncio.run(orchestrator.list_voices())] == ["plain", "Tea_Voice"]


def test_a_stored_voice_survives_a_restart(base_pipeline: Any, base_config: PipelineConfig) -> None:
    from omni_ray.pipeline import Pipeline

    before = speak_codes(base_pipeline, voice="Tea_Voice")
    listed = asyncio.run(base_pipeline.orchestrator.list_voices())
    base_pipeline.shutdown()
    restarted = Pipeline(base_config)
    try:
        assert asyncio.run(restarted.orchestrator.list_voices()) == listed
        assert torch.equal(speak_codes(restarted, voice="Tea_Voice"), before)
        assert reference_encodings(restarted) == 0
    finally:
        restarted.shutdown()
