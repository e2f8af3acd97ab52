"""Qwen3-TTS's /v1/audio/speech request, in vllm-omni's and sglang-omni's field names, mapped to its orchestrator's speak."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_tts.talker import DEFAULT_CODE_SAMPLING, DEFAULT_SAMPLING
from omni_ray.serve.openai_protocol import ServiceLimits, SpeechRequest, _named_voice, bad_request

# The Talker's draw (the package's names) and the code predictor's (the package's `subtalker_` names).
TALKER_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "repetition_penalty")
CODE_SAMPLING_FIELDS = {"subtalker_temperature": "temperature", "subtalker_top_k": "top_k",
                        "subtalker_top_p": "top_p"}


class SpeechReference(BaseModel):
    """One reference to clone a voice from (sglang-omni's and fish-speech's shape): its speech and transcript."""

    model_config = ConfigDict(extra="forbid")

    audio: str | bytes = Field(min_length=1, description="the reference speech: base64 or a data: URL (http(s): and "
                               "file: where the server allows them); raw bytes in a msgpack body")
    text: str | None = Field(default=None, description="its transcript (in-context cloning)")


class TTSSpeechRequest(SpeechRequest):
    """POST /v1/audio/speech for a Qwen3-TTS model. The fields vllm-omni and sglang-omni take, so their clients work
    unchanged: `voice` (or `speaker`) names a CustomVoice speaker; `instructions` describe the voice (VoiceDesign) or
    its style (CustomVoice); `ref_audio` and `ref_text` clone a voice (Base). What a model's variant cannot do is a
    400 from its orchestrator, before any stage runs."""

    voice: str | None = Field(  # type: ignore[assignment]
        default=None, validation_alias=AliasChoices("voice", "speaker"),
        description="CustomVoice: one of the model's speakers (default: the config's, else vivian); ignored by "
        "VoiceDesign, and by Base when ref_audio is given")
    language: str | None = Field(default=None, description="auto (default) or one of the model's languages, "
                                 "any case (English, chinese, ...)")
    task_type: Literal["Base", "CustomVoice", "VoiceDesign"] | None = Field(
        default=None, description="the model's variant, checked: a request for another variant is a 400")
    ref_audio: str | None = Field(
        default=None, min_length=1,
        description="Base: reference speech to clone, base64 or a data: URL (http(s): and file: where the server "
        "allows them), any rate and channel count")
    ref_text: str | None = Field(default=None, description="Base, in-context cloning: the reference's transcript")
    references: list[SpeechReference] | None = Field(
        default=None, description="references to clone from, each {audio, text}, instead of ref_audio and ref_text; "
        "a family that takes one reference (Qwen3-TTS) refuses more")
    x_vector_only_mode: bool | None = Field(
        default=None, description="Base: clone from the speaker embedding alone (no ref_text needed)")
    non_streaming_mode: bool | None = Field(
        default=None, description="the prompt's form, not the HTTP response's: true puts the whole text in the "
        "prompt, false feeds it one token a step (default: the variant's, as the package's)")
    top_k: int | None = Field(default=None, ge=0, description="the Talker's top-k (0: off)")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    subtalker_temperature: float | None = Field(default=None, ge=0.0, le=2.0,
                                                description="the code predictor's temperature")
    subtalker_top_k: int | None = Field(default=None, ge=0)
    subtalker_top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    ignore_eos: bool = Field(default=False, description="extension (benchmarks): the speech runs to max_new_tokens "
                             "(else the frame cap) whatever the Talker samples")

    @field_validator("voice")
    @classmethod
    def _voice(cls, value: str | None) -> str | None:
        return None if value is None else _named_voice(value, "voice")

    @model_validator(mode="after")
    def _one_way_to_give_references(self) -> TTSSpeechRequest:
        if self.references and (self.ref_audio is not None or self.ref_text is not None):
            raise bad_request("give the reference as ref_audio and ref_text, or as references, not both",
                              "references", "conflicting_references")
        return self

    @property
    def cloning_references(self) -> list[SpeechReference]:
        """The references this request clones from: `references`, else `ref_audio` with `ref_text`, else none."""
        if self.references:
            return list(self.references)
        if self.ref_audio is not None:
            return [SpeechReference(audio=self.ref_audio, text=self.ref_text)]
        return []

    @property
    def speaker(self) -> str | None:  # type: ignore[override]
        return None if self.voice is None else self.voice.strip().lower()

    def check_limits(self, limits: ServiceLimits) -> None:
        super().check_limits(limits)
        texts = [("ref_text", self.ref_text)] + [(f"references.{index}.text", reference.text)
                                                 for index, reference in enumerate(self.references or [])]
        for param, text in texts:
            if text is not None and len(text) > limits.max_speech_input_chars:
                msg = f"{param} is {len(text)} characters, over the limit of {limits.max_speech_input_chars}"
                raise bad_request(msg, param, "string_above_max_length")

    def samplings(self) -> tuple[SamplingParams, SamplingParams]:
        """The Talker's and the code predictor's draws: the package's defaults with the request's fields over them,
        each seeded with `seed`. `temperature: 0` makes both greedy (unless `subtalker_temperature` says otherwise),
        so that a greedy request is deterministic."""
        talker = {name: getattr(self, name) for name in TALKER_SAMPLING_FIELDS if getattr(self, name) is not None}
        code = {own: getattr(self, name) for name, own in CODE_SAMPLING_FIELDS.items() if getattr(self, name) is not None}
        if self.temperature == 0 and "temperature" not in code:
            code["temperature"] = 0.0
        seed = {"seed": self.seed} if self.seed is not None else {}
        return (SamplingParams(**{**DEFAULT_SAMPLING.model_dump(), **talker, **seed}),
                SamplingParams(**{**DEFAULT_CODE_SAMPLING.model_dump(), **code, **seed}))

    def to_speak_kwargs(self) -> dict[str, Any]:
        """SpeechOrchestrator.speak(text, **kwargs) arguments but `reference` (the decoded ref_audio, made on the
        ingress's parsing pool)."""
        sampling, code_sampling = self.samplings()
        streaming_text = None if self.non_streaming_mode is None else not self.non_streaming_mode
        return {
            "voice": self.speaker, "language": (self.language or "auto").strip().lower() or "auto",
            "instructions": self.instructions or None, "task_type": self.task_type, "streaming_text": streaming_text,
            "sampling": sampling, "code_sampling": code_sampling, "max_audio_frames": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
