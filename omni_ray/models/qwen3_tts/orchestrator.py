"""A Qwen3-TTS request's life across its stages: encode a reference voice, open the Talker and vocoder streams, merge."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

import numpy as np

from omni_ray.config import PipelineConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.events import AudioChunk, Event, Finished
from omni_ray.models.qwen3_tts.model_files import TTSModelFiles, load_tokenizer, resolve_model
from omni_ray.models.qwen3_tts.prompt import (
    SpeechRequest, SpeechRequestError, TalkerPrompt, VoiceReference, build_prompt,
)
from omni_ray.models.qwen3_tts.stages import SpeechTalkerRequest
from omni_ray.models.qwen3_tts.talker import DEFAULT_CODE_SAMPLING, DEFAULT_SAMPLING
from omni_ray.models.qwen3_tts.voices import VoiceStore, default_voices_dir
from omni_ray.reference_audio import ReferenceAudio, ReferenceAudioError, prepare_reference_audio
from omni_ray.relay import RelayLinks
from omni_ray.stages.client import StageClient
from omni_ray.stages.streams import RequestStreams

DEFAULT_SPEAKER = "vivian"  # CustomVoice's voice when a request and the config name none
TASK_TYPES = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
# The package's prompt form by variant: CustomVoice and VoiceDesign put the whole text in the prompt, Base streams it.
STREAMING_TEXT_BY_DEFAULT = {"base": True, "custom_voice": False, "voice_design": False}


def make_orchestrator(stages: dict[str, StageClient], config: PipelineConfig,
                      max_prompt_tokens: int | None = None) -> "SpeechOrchestrator":
    """The orchestrator of a Qwen3-TTS pipeline config over its stage clients."""
    return SpeechOrchestrator(stages, resolve_model(config.model), config)


class SpeechOrchestrator:
    """Runs Qwen3-TTS requests over stage clients (Ray actors or Serve deployments); knows nothing of HTTP."""

    def __init__(self, stages: dict[str, StageClient], files: TTSModelFiles, config: PipelineConfig) -> None:
        self.stages = stages
        self.files = files
        self.model_config = files.config
        self.config = config
        self.tokenizer = load_tokenizer(files.directory)
        self.links = RelayLinks()
        self.voice_store: VoiceStore | None = None  # Base: uploaded voices, used by name
        if self.variant == "base":
            self.voice_store = VoiceStore(config.voices_dir or default_voices_dir(files.directory), config.max_voices)

    @property
    def variant(self) -> str:
        return self.model_config.variant

    @property
    def voices(self) -> list[str]:
        """CustomVoice's named speakers, or a Base model's stored voices (VoiceDesign makes its voice from
        instructions)."""
        if self.voice_store is not None:
            return self.voice_store.names()
        return sorted(self.model_config.speakers) if self.variant == "custom_voice" else []

    @property
    def languages(self) -> list[str]:
        return ["auto", *sorted(self.model_config.languages)]

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def speech_request(
        self, text: str, voice: str | None = None, language: str = "auto", instructions: str | None = None,
        reference: VoiceReference | None = None, streaming_text: bool | None = None, task_type: str | None = None,
    ) -> SpeechRequest:
        """Check a request against this model's variant (each mistake an InvalidRequestError naming it)."""
        if not text.strip():
            raise InvalidRequestError("input text must not be empty")
        if task_type is not None and task_type != TASK_TYPES[self.variant]:
            raise InvalidRequestError(f"task_type {task_type!r}: this model is a {TASK_TYPES[self.variant]} model")
        if self.variant == "custom_voice":
            voice = voice or self.config.default_speaker or DEFAULT_SPEAKER
            if voice.lower() not in self.model_config.speakers:
                raise InvalidRequestError(f"unknown voice {voice!r}; available: {', '.join(self.voices)}")
        elif self.variant == "voice_design":
            if not (instructions or "").strip():
                raise InvalidRequestError("a VoiceDesign model makes its voice from instructions: give instructions")
            voice = None
        elif reference is None:
            raise InvalidRequestError("a Base model clones a voice: give ref_audio (and ref_text for in-context "
                                      "cloning, or x_vector_only_mode), or name a stored voice")
        if reference is not None and self.variant != "base":
            raise InvalidRequestError(f"voice cloning (ref_audio) needs a Base model; this one is "
                                      f"{TASK_TYPES[self.variant]}")
        if self.variant == "base" and instructions:
            raise InvalidRequestError("a Base model takes no instructions")
        if streaming_text is None:
            streaming_text = STREAMING_TEXT_BY_DEFAULT[self.variant]
        return SpeechRequest(text, language, voice if self.variant == "custom_voice" else None, instructions,
                             reference, streaming_text)

    def build_prompt(self, request: SpeechRequest) -> TalkerPrompt:
        try:
            return build_prompt(request, self.tokenize, self.model_config)
        except SpeechRequestError as exc:
            raise InvalidRequestError(str(exc)) from exc

    async def encode_reference(self, reference: ReferenceAudio) -> VoiceReference:
        """The reference stage's x-vector (and codes, for in-context cloning) of reference audio. Audio it cannot use
        (too short, too long, silent, not finite) is a client error, found before any stage sees it."""
        if self.variant != "base":
            raise InvalidRequestError(f"voice cloning (ref_audio) needs a Base model; this one is "
                                      f"{TASK_TYPES[self.variant]}")
        x_vector_only = reference.x_vector_only or not reference.text
        if not reference.x_vector_only and not (reference.text or "").strip():
            raise InvalidRequestError("in-context voice cloning needs ref_text, the reference audio's transcript "
                                      "(or set x_vector_only_mode)")
        try:
            prepare_reference_audio(reference.samples, reference.sample_rate)
        except ReferenceAudioError as exc:
            raise InvalidRequestError(f"ref_audio: {exc}") from exc
        encoded = await self.stages["reference"].call("encode", reference.samples, reference.sample_rate, x_vector_only)
        return VoiceReference(encoded["x_vector"], encoded["codes"], None if x_vector_only else reference.text)

    def _store(self) -> VoiceStore:
        if self.voice_store is None:
            raise InvalidRequestError(f"stored voices are cloned voices: they need a Base model; this one is "
                                      f"{TASK_TYPES[self.variant]}")
        return self.voice_store

    async def add_voice(self, name: str, reference: ReferenceAudio) -> dict[str, Any]:
        """Encode `reference` once (reference stage) and store it as voice `name`: its codes, x-vector and
        transcript (in context), or its x-vector alone (`x_vector_only`, or no transcript). Returns the voice's
        `list_voices()` entry. Refusals are InvalidRequestError: bad audio or transcript, and the store's
        InvalidVoiceNameError, VoiceExistsError, TooManyVoicesError (checked before encoding, and again on
        writing)."""
        store = self._store()
        await asyncio.to_thread(store.check_can_add, name)
        encoded = await self.encode_reference(reference)
        seconds = np.asarray(reference.samples).shape[0] / int(reference.sample_rate)
        return await asyncio.to_thread(store.save, name, encoded, seconds)

    async def list_voices(self) -> list[dict[str, Any]]:
        """The stored voices: {name, mode (in_context or x_vector_only), frames, seconds, created, text, digest}
        each, by name (none for a model that is not Base)."""
        return [] if self.voice_store is None else await asyncio.to_thread(self.voice_store.list)

    async def delete_voice(self, name: str) -> None:
        """Remove stored voice `name` (VoiceNotFoundError if none; InvalidVoiceNameError for a name no voice can
        have)."""
        await asyncio.to_thread(self._store().delete, name)

    async def stored_voice(self, name: str) -> VoiceReference:
        """Stored voice `name`, checked against this model (VoiceNotFoundError if none)."""
        voice = await asyncio.to_thread(self._store().load, name)
        x_vector_dim = self.model_config.speaker_encoder.get("enc_dim")
        groups = self.model_config.num_groups
        if (x_vector_dim is not None and tuple(voice.x_vector.shape) != (int(x_vector_dim),)) or (
                voice.codes is not None and (voice.codes.ndim != 2 or voice.codes.shape[1] != groups)):
            raise InvalidRequestError(f"voice {name!r} was made by another model: it does not fit this one")
        return voice

    async def speak(
        self,
        text: str,
        *,
        voice: str | None = None,
        language: str = "auto",
        instructions: str | None = None,
        reference: ReferenceAudio | None = None,
        streaming_text: bool | None = None,
        task_type: str | None = None,
        sampling: SamplingParams | None = None,
        code_sampling: SamplingParams | None = None,
        max_audio_frames: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        return_codes: bool = False,
    ) -> AsyncIterator[Event]:
        """Speech for `text` in a named voice (CustomVoice), a described one (VoiceDesign: `instructions`) or a
        cloned one (Base: `reference`, or `voice` naming a stored voice: no reference encoding then; a `reference`
        wins over `voice`). `sampling` is the Talker's draw (default: the package's, temperature 0.9,
        top-k 50, repetition penalty 1.05), `code_sampling` the code predictor's. `ignore_eos` (benchmarks): the
        speech runs to its frame cap."""
        submitted = time.time()
        if max_audio_frames is not None and max_audio_frames < 1:
            raise InvalidRequestError("max_audio_frames must be at least 1")
        if reference is not None:
            cloned: VoiceReference | None = await self.encode_reference(reference)
        elif self.variant == "base" and voice:
            cloned = await self.stored_voice(voice)
        else:
            cloned = None
        if self.variant == "base" and cloned is None:
            self.speech_request(text, voice, language, instructions, None, streaming_text, task_type)  # says why
        request = self.speech_request(text, voice, language, instructions, cloned, streaming_text, task_type)
        prompt = self.build_prompt(request)
        async for event in self._run(request_id or uuid.uuid4().hex, prompt, cloned, sampling, code_sampling,
                                     max_audio_frames, ignore_eos, return_codes, submitted):
            yield event

    async def _run(
        self, rid: str, prompt: TalkerPrompt, cloned: VoiceReference | None, sampling: SamplingParams | None,
        code_sampling: SamplingParams | None, max_audio_frames: int | None, ignore_eos: bool, return_codes: bool,
        submitted: float,
    ) -> AsyncIterator[Event]:
        timing = {"submitted": submitted}
        streams = RequestStreams(self.stages, self.links)
        talker = SpeechTalkerRequest(rid, prompt, sampling or DEFAULT_SAMPLING, code_sampling or DEFAULT_CODE_SAMPLING,
                                     max_audio_frames, ignore_eos)
        context = None if cloned is None or cloned.codes is None else cloned.codes.T.contiguous()
        try:
            peers = await streams.open({"talker": ("speak", (talker,)),
                                        "vocoder": ("decode", (rid, return_codes, context))})
            await streams.link(peers["talker"], peers["vocoder"], rid)
            timing["streams_open"] = time.time()
            async for _, event in streams.merged(timing):
                if event["type"] == "audio":
                    yield AudioChunk(event["pcm"], event["sample_rate"], event["t"])
            done = streams.finals
            reason = done["talker"]["finish_reason"]
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 0, "audio_frames": int(done["talker"]["frames"])}
            yield Finished(reason, usage, reason, [], time.time(), timing, done["vocoder"].get("codes"))
        finally:
            await streams.close()
