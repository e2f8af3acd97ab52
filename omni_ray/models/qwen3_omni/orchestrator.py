"""A Qwen3-Omni request's life across the four stages: open the streams, link the relay peers, merge the events."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from omni_ray.config import PipelineConfig
from omni_ray.detokenizer import IncrementalDetokenizer
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.events import AudioChunk, Event, Finished, TextDelta
from omni_ray.models.qwen3_omni.model_files import resolve_model
from omni_ray.models.qwen3_omni.prompt import Prompt, PromptBuilder
from omni_ray.models.qwen3_omni.speech_budget import (
    MIN_SPEECH_FRAMES, context_room, frame_budget, talker_prompt_length,
)
from omni_ray.models.qwen3_omni.stages import TalkerRequest, ThinkerRequest
from omni_ray.relay import RelayLinks
from omni_ray.stages.client import StageClient
from omni_ray.stages.streams import RequestStreams

# Talker defaults of the released model (transformers' generate()).
DEFAULT_TALKER_SAMPLING = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05)
SPEECH_INSTRUCTION = "Read the following text aloud."
DEFAULT_SPEAKER = "ethan"  # the voice a request gets when it and the config name none


def make_orchestrator(stages: dict[str, StageClient], config: PipelineConfig,
                      max_prompt_tokens: int | None = None) -> "Orchestrator":
    """The orchestrator of a Qwen3-Omni pipeline config over its stage clients (its prompts from the model's files)."""
    files = resolve_model(config.model)
    prompts = PromptBuilder(str(files.tokenizer_dir), files.config.thinker_config.audio_token_id,
                            config.max_audio_seconds)
    orchestrator = Orchestrator(stages, prompts, config, files.config, max_prompt_tokens)
    orchestrator.checkpoint = str(files.tokenizer_dir)
    return orchestrator


class Orchestrator:
    """Runs requests over stage clients (Ray actors or Serve deployments); knows nothing of HTTP."""

    checkpoint = ""  # the tokenizer and processor configs' directory

    def __init__(
        self,
        stages: dict[str, StageClient],
        prompts: PromptBuilder,
        config: PipelineConfig,
        model_config: Any,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.stages = stages
        self.max_prompt_tokens = max_prompt_tokens
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer
        self.config = config
        self.model_config = model_config
        self.stop_ids = [model_config.im_end_token_id, self.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        self.links = RelayLinks()

    @property
    def voices(self) -> list[str]:
        return sorted(self.model_config.talker_config.speaker_id)

    def check_request(
        self, prompt_len: int, max_tokens: int, audio: bool, speaker: str | None, max_audio_frames: int | None,
        talker_prompt_len: int | None = None,
    ) -> str:
        """Client errors are caught here, before any stage sees the request. Returns the voice. With
        `talker_prompt_len` (the Talker's prompt positions, `talker_prompt_length`), a spoken reply whose prompt
        leaves the Talker's context too little room for speech is refused too (`check_talker_room`)."""
        if max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1")
        if self.max_prompt_tokens is not None and prompt_len > self.max_prompt_tokens:
            raise InvalidRequestError(f"prompt is {prompt_len} tokens, over the limit of {self.max_prompt_tokens}")
        limit = self.config.stages.thinker.engine.max_seq_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context of {limit} tokens"
            )
        voice = (speaker or self.config.default_speaker or DEFAULT_SPEAKER).lower()
        if audio and voice not in self.model_config.talker_config.speaker_id:
            raise InvalidRequestError(f"unknown voice '{speaker}'; available: {', '.join(self.voices)}")
        if max_audio_frames is not None and max_audio_frames < 1:
            raise InvalidRequestError("max_audio_frames must be at least 1")
        if audio and talker_prompt_len is not None:
            self.check_talker_room(talker_prompt_len, max_tokens, max_audio_frames)
        return voice

    def check_talker_room(self, talker_prompt_len: int, max_tokens: int, max_audio_frames: int | None) -> None:
        """Refuse (400) a spoken reply whose Talker prompt leaves its context room for fewer frames than the least
        worth speaking (`MIN_SPEECH_FRAMES`, or the request's whole frame budget when that is smaller). A request
        with more room than that but less than its budget is admitted: its speech may stop early, and the reply's
        `audio_finish_reason` then says `length`."""
        talker = self.config.stages.talker.engine
        budget = frame_budget(talker, max_audio_frames, max_tokens)
        room = context_room(talker, talker_prompt_len)
        needed = min(budget, MIN_SPEECH_FRAMES)
        if room < needed:
            raise InvalidRequestError(
                f"the prompt takes {talker_prompt_len} of the Talker's {talker.max_seq_len} positions, leaving room "
                f"for {max(room, 0)} frames of speech; at least {needed} are needed: shorten the input, or ask for "
                f"text only"
            )

    async def generate(
        self,
        messages: list[dict[str, Any]],
        *,
        sampling: SamplingParams | None = None,
        max_tokens: int = 256,
        audio: bool = True,
        speaker: str | None = None,
        talker_sampling: SamplingParams | None = None,
        max_audio_frames: int | None = None,
        stop_token_ids: list[int] | None = None,
        request_id: str | None = None,
        return_codes: bool = False,
        ignore_eos: bool = False,
        prompt: Prompt | None = None,
    ) -> AsyncIterator[Event]:
        """A chat reply: streamed text and (unless audio=False) streamed speech. `ignore_eos` (benchmarks): the
        reply runs to max_tokens and the speech to its frame cap (max_audio_frames when given). `prompt`: the
        messages' prompt built already (`self.prompts.build`; the ingress builds it off its event loop)."""
        submitted = time.time()
        prompt = prompt if prompt is not None else self.prompts.build(messages)
        voice = self.check_request(len(prompt.ids), max_tokens, audio, speaker, max_audio_frames,
                                   talker_prompt_length(prompt.ids, self.model_config) if audio else None)
        thinker = ThinkerRequest(
            request_id or uuid.uuid4().hex, prompt.ids, sampling or SamplingParams(), max_tokens,
            stop_token_ids or self.stop_ids, expects_audio=bool(prompt.clips), ignore_eos=ignore_eos,
        )
        async for event in self._run(prompt, thinker, audio, voice, talker_sampling, max_audio_frames, return_codes, submitted):
            yield event

    async def speak(
        self,
        text: str,
        *,
        speaker: str | None = None,
        instructions: str | None = None,
        talker_sampling: SamplingParams | None = None,
        max_audio_frames: int | None = None,
        request_id: str | None = None,
        return_codes: bool = False,
        prepared: tuple[Prompt, list[int]] | None = None,
    ) -> AsyncIterator[Event]:
        """Speech for `text` verbatim: it is the assistant's reply, teacher-forced through the Thinker. `prepared`:
        `speech_prompt(text, instructions)` made already (the ingress makes it off its event loop)."""
        submitted = time.time()
        if not text.strip():
            raise InvalidRequestError("input text must not be empty")
        prompt, forced = prepared if prepared is not None else self.speech_prompt(text, instructions)
        voice = self.check_request(len(prompt.ids), len(forced), True, speaker, max_audio_frames,
                                   talker_prompt_length(prompt.ids, self.model_config))
        thinker = ThinkerRequest(
            request_id or uuid.uuid4().hex, prompt.ids, SamplingParams(temperature=0.0), len(forced),
            self.stop_ids, forced_ids=forced,
        )
        async for event in self._run(prompt, thinker, True, voice, talker_sampling, max_audio_frames, return_codes, submitted):
            yield event

    def speech_prompt(self, text: str, instructions: str | None = None) -> tuple[Prompt, list[int]]:
        """speak()'s prompt (the user turn) and the ids it forces through the Thinker (`text`, then <|im_end|>)."""
        prompt = self.prompts.build([{"role": "user", "content": instructions or SPEECH_INSTRUCTION}])
        forced = self.tokenizer.encode(text, add_special_tokens=False) + [self.model_config.im_end_token_id]
        return prompt, forced

    async def _run(
        self,
        prompt: Prompt,
        thinker: ThinkerRequest,
        audio: bool,
        voice: str,
        talker_sampling: SamplingParams | None,
        max_audio_frames: int | None,
        return_codes: bool,
        submitted: float,
    ) -> AsyncIterator[Event]:
        rid = thinker.request_id
        timing = {"submitted": submitted}
        streams = RequestStreams(self.stages, self.links)
        token_ids: list[int] = []
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        try:
            # Every stream opens at once (the Talker can prefill while the Thinker does); then each producer is told
            # its consumer's replica. A producer holds what it makes for the request until then.
            thinker.speaks = audio
            opening: dict[str, tuple[str, tuple[Any, ...]]] = {"thinker": ("generate", (thinker,))}
            if audio:
                talker = TalkerRequest(
                    rid, talker_sampling or DEFAULT_TALKER_SAMPLING, voice, max_audio_frames, thinker.ignore_eos,
                    prompt_ids=None if prompt.clips else prompt.ids, max_text_tokens=thinker.max_tokens,
                )
                opening["talker"] = ("speak", (talker,))
                opening["vocoder"] = ("decode", (rid, return_codes))
            peers = await streams.open(opening)
            if prompt.clips:
                streams.run_beside("encoder", self.stages["encoder"].call("encode", rid, prompt.clips, peers["thinker"]))
            if audio:
                await asyncio.gather(streams.link(peers["thinker"], peers["talker"], rid),
                                     streams.link(peers["talker"], peers["vocoder"], rid))
            timing["streams_open"] = time.time()  # every stage holds the request
            async for _, event in streams.merged(timing):
                kind = event["type"]
                if kind == "token":
                    timing.setdefault("first_token", event["t"])
                    if "prefill_launched" in event:
                        timing.setdefault("prefill_launched", event["prefill_launched"])
                    timing["last_token"] = event["t"]
                    token_ids.append(event["token"])
                    held = detokenizer.pending  # tokens whose text was held back until this one
                    delta = detokenizer.push(event["token"])
                    if delta:
                        yield TextDelta(delta, [*held, event["token"]], event["t"])
                elif kind == "audio":
                    yield AudioChunk(event["pcm"], event["sample_rate"], event["t"])
            done = streams.finals
            held = detokenizer.pending
            rest = detokenizer.flush()  # a reply cut off mid-character: its held-back bytes, as U+FFFD
            if rest:
                yield TextDelta(rest, held, time.time())
            usage = {"prompt_tokens": len(prompt.ids), "completion_tokens": len(token_ids)}
            if "talker" in done:
                usage["audio_frames"] = int(done["talker"].get("frames", 0))
            yield Finished(
                done["thinker"]["finish_reason"], usage, done["talker"]["finish_reason"] if "talker" in done else None,
                token_ids, time.time(), timing, done.get("vocoder", {}).get("codes"),
                detokenizer.text,  # the streamed deltas' concatenation: the whole reply's decode
            )
        finally:
            await streams.close()
