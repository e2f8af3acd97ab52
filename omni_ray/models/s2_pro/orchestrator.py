"""An S2 Pro request's life across its stages: encode the reference voices, build the official prompt, open the Talker
and vocoder streams, merge."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from omni_ray.config import PipelineConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.events import AudioChunk, Event, Finished
from omni_ray.models.s2_pro.codec import codec_config_for
from omni_ray.models.s2_pro.dual_ar_runner import DEFAULT_SAMPLING
from omni_ray.models.s2_pro.model_files import S2ProModelFiles, resolve_model
from omni_ray.models.s2_pro.prompt import Reference, build_prompt
from omni_ray.models.s2_pro.stages import S2ProTalkerRequest
from omni_ray.reference_audio import ReferenceAudio, ReferenceAudioError, prepare_reference_audio
from omni_ray.relay import RelayLinks
from omni_ray.stages.client import StageClient
from omni_ray.stages.streams import RequestStreams
from omni_ray.voice_store import VoiceStore, default_voices_dir


def make_orchestrator(stages: dict[str, StageClient], config: PipelineConfig,
                      max_prompt_tokens: int | None = None) -> "S2ProOrchestrator":
    """The orchestrator of an S2 Pro pipeline config over its stage clients."""
    return S2ProOrchestrator(stages, resolve_model(config.model), config)


class PcmResampler:
    """One reply's audio from the codec's rate to another, chunk by chunk, as one continuous stream (libsoxr)."""

    def __init__(self, source_rate: int, target_rate: int) -> None:
        import soxr

        self.target_rate = target_rate
        self.stream = soxr.ResampleStream(source_rate, target_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, pcm: np.ndarray, last: bool = False) -> np.ndarray:
        return self.stream.resample_chunk(np.ascontiguousarray(pcm, dtype=np.float32), last=last)


class S2ProOrchestrator:
    """Runs S2 Pro requests over stage clients (Ray actors or Serve deployments); knows nothing of HTTP. Voices are
    cloned from references (audio and transcript, several speakers at once) or from stored voices, whose codes the
    shared voice store keeps so that a request in one encodes nothing."""

    variant = "s2_pro"
    languages = ["auto"]  # the model reads the language from the text

    def __init__(self, stages: dict[str, StageClient], files: S2ProModelFiles, config: PipelineConfig) -> None:
        self.stages = stages
        self.files = files
        self.model_config = files.config
        self.config = config
        self.tokenizer = Tokenizer.from_file(str(files.directory / "tokenizer.json"))
        self.sample_rate = codec_config_for(files.directory).sample_rate
        self.links = RelayLinks()
        self.voice_store = VoiceStore(config.voices_dir or default_voices_dir(files.directory), config.max_voices)

    @property
    def voices(self) -> list[str]:
        return self.voice_store.names()

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as the prompt's pieces are tokenized: special tokens in it become their ids, nothing is
        added around it."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    # ---- references and stored voices --------------------------------------------------------------------------
    def check_reference(self, reference: ReferenceAudio) -> np.ndarray:
        """The reference's samples mono at the codec's rate; a reference S2 Pro cannot use (no transcript, audio too
        short, too long, silent, not finite) is an InvalidRequestError."""
        if reference.x_vector_only or not (reference.text or "").strip():
            raise InvalidRequestError("S2 Pro clones a voice from reference audio with its transcript: give the "
                                      "reference's text")
        try:
            return prepare_reference_audio(reference.samples, reference.sample_rate, target_rate=self.sample_rate)
        except ReferenceAudioError as exc:
            raise InvalidRequestError(f"ref_audio: {exc}") from exc

    async def encode_reference(self, reference: ReferenceAudio) -> Reference:
        """The reference stage's codes [10, T] of a reference, with its transcript."""
        samples = await asyncio.to_thread(self.check_reference, reference)
        encoded = await self.stages["reference"].call("encode", samples, self.sample_rate)
        return Reference(encoded["codes"], str(reference.text))

    async def add_voice(self, name: str, reference: ReferenceAudio) -> dict[str, Any]:
        """Encode `reference` once (reference stage) and store it as voice `name`: its codes and transcript. Returns
        the voice's `list_voices()` entry. Refusals are InvalidRequestError: bad audio or transcript, and the store's
        InvalidVoiceNameError, VoiceExistsError, TooManyVoicesError (checked before encoding, and on writing)."""
        await asyncio.to_thread(self.voice_store.check_can_add, name)
        encoded = await self.encode_reference(reference)
        seconds = np.asarray(reference.samples).shape[0] / int(reference.sample_rate)
        frames = int(encoded.codes.shape[1])
        return await asyncio.to_thread(self.voice_store.save_tensors, name, {"codes": encoded.codes}, encoded.text,
                                       frames, seconds)

    async def list_voices(self) -> list[dict[str, Any]]:
        """The stored voices: {name, mode, frames, seconds, created, text, digest} each, by name."""
        return await asyncio.to_thread(self.voice_store.list)

    async def delete_voice(self, name: str) -> None:
        """Remove stored voice `name` (VoiceNotFoundError if none)."""
        await asyncio.to_thread(self.voice_store.delete, name)

    async def stored_voice(self, name: str) -> Reference:
        """Stored voice `name` as a reference (VoiceNotFoundError if none), checked against this model."""
        stored = await asyncio.to_thread(self.voice_store.load_tensors, name)
        codes = stored.tensors.get("codes")
        if codes is None or codes.ndim != 2 or codes.shape[0] != self.model_config.num_codebooks or not stored.text:
            raise InvalidRequestError(f"voice {name!r} was made by another model: it does not fit this one")
        return Reference(codes.to(torch.long), stored.text)

    # ---- speech -------------------------------------------------------------------------------------------------
    def build_prompt(self, text: str, references: Sequence[Reference]) -> torch.Tensor:
        """The official prompt [1 + codebooks, T] for `text` in the voice of `references` (none: the model's own)."""
        if not text.strip():
            raise InvalidRequestError("input text must not be empty")
        size = self.model_config.codebook_size
        if any(int(ref.codes.max()) >= size or int(ref.codes.min()) < 0 for ref in references if ref.codes.numel()):
            raise InvalidRequestError(f"a voice's codes do not fit this model's codebooks ({size} codes each)")
        try:
            return build_prompt(text, references, self.tokenize, self.model_config.semantic_begin,
                                self.model_config.num_codebooks)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc

    async def speak(
        self,
        text: str,
        *,
        voice: str | None = None,
        references: Sequence[ReferenceAudio] = (),
        reference: ReferenceAudio | None = None,
        sampling: SamplingParams | None = None,
        max_audio_frames: int | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
        return_codes: bool = False,
        sample_rate: int | None = None,
    ) -> AsyncIterator[Event]:
        """Speech for `text`: in the voice of `references` (each audio with its transcript; several are several
        speakers, tagged in order), else of stored voice `voice`, else the model's own. `sampling` is the official
        API's draw by default (temperature 0.8, top-p 0.8, top-k 30, repetition-aware). The reply ends with
        finish reason `stop` on `<|im_end|>`, `length` at `max_audio_frames` (else 1024, within the stage's cap);
        `ignore_eos` (benchmarks) runs it to the cap. Audio comes at the codec's 44.1 kHz, or resampled to `sample_rate`."""
        submitted = time.time()
        if max_audio_frames is not None and max_audio_frames < 1:
            raise InvalidRequestError("max_audio_frames must be at least 1")
        given = [*references, *([reference] if reference is not None else [])]
        if given:
            cloned = list(await asyncio.gather(*(self.encode_reference(ref) for ref in given)))
        elif voice:
            cloned = [await self.stored_voice(voice)]
        else:
            cloned = []
        prompt = self.build_prompt(text, cloned)
        talker = S2ProTalkerRequest(request_id or uuid.uuid4().hex, prompt, sampling or DEFAULT_SAMPLING,
                                    max_audio_frames, ignore_eos)
        resampler = PcmResampler(self.sample_rate, sample_rate) if sample_rate and sample_rate != self.sample_rate \
            else None
        async for event in self._run(talker, return_codes, submitted, resampler):
            yield event

    async def _run(self, talker: S2ProTalkerRequest, return_codes: bool, submitted: float,
                   resampler: PcmResampler | None) -> AsyncIterator[Event]:
        rid = talker.request_id
        timing = {"submitted": submitted}
        streams = RequestStreams(self.stages, self.links)
        try:
            peers = await streams.open({"talker": ("speak", (talker,)), "vocoder": ("decode", (rid, return_codes))})
            await streams.link(peers["talker"], peers["vocoder"], rid)
            timing["streams_open"] = time.time()
            async for _, event in streams.merged(timing):
                if event["type"] != "audio":
                    continue
                if resampler is None:
                    yield AudioChunk(event["pcm"], event["sample_rate"], event["t"])
                    continue
                pcm = resampler(event["pcm"])
                if pcm.size:
                    yield AudioChunk(pcm, resampler.target_rate, event["t"])
            if resampler is not None:
                tail = resampler(np.zeros(0, np.float32), last=True)
                if tail.size:
                    yield AudioChunk(tail, resampler.target_rate, time.time())
            done = streams.finals
            reason = done["talker"]["finish_reason"]
            usage = {"prompt_tokens": int(talker.prompt.shape[1]), "completion_tokens": 0,
                     "audio_frames": int(done["talker"]["frames"])}
            yield Finished(reason, usage, reason, [], time.time(), timing, done["vocoder"].get("codes"))
        finally:
            await streams.close()
