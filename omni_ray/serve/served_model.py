"""The models one ingress serves: each one's config, orchestrator and stage deployments, and its requests prepared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_ray.config import PipelineConfig
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.models import load_family
from omni_ray.models.qwen3_omni.prompt import Prompt
from omni_ray.models.qwen3_tts.prompt import VoiceReference
from omni_ray.reference_audio import REFERENCE_SAMPLE_RATE, ReferenceAudio, ReferenceAudioError, prepare_reference_audio
from omni_ray.serve import openai_protocol as oai
from omni_ray.serve.audio_urls import decode_reference_bytes, read_reference_audio, resolve_audio_urls_blocking
from omni_ray.serve.openai_responses import OUTPUT_SAMPLE_RATE
from omni_ray.serve.speech_protocol import SpeechReference, TTSSpeechRequest
from omni_ray.stages.client import ServeClient

# Stands for a reference not encoded yet: a request is checked against its model before its reference is encoded.
PENDING_REFERENCE = VoiceReference(torch.zeros(0))


@dataclass
class ServedModel:
    """One model of the application: the id requests name it by, its pipeline config, its family's orchestrator over
    its stage deployments, and those deployments' names (for /ready)."""

    name: str
    config: PipelineConfig
    orchestrator: Any
    deployments: tuple[str, ...]

    @property
    def family(self) -> str:
        return self.config.model.family

    @property
    def chats(self) -> bool:
        """Qwen3-Omni chats; Qwen3-TTS and S2 Pro only speak text they are given."""
        return hasattr(self.orchestrator, "generate")

    @property
    def audio_rate(self) -> int:
        """The rate the model's audio is made at: its orchestrator's `sample_rate` where it has one (S2 Pro's codec:
        44.1 kHz), else the Qwen models' 24 kHz. /v1/tts answers at it; /v1/audio/speech at OpenAI's 24 kHz."""
        return int(getattr(self.orchestrator, "sample_rate", OUTPUT_SAMPLE_RATE))


def served_model(spec: dict[str, Any], limits: oai.ServiceLimits) -> ServedModel:
    """A model from `build_app`'s spec: {model_name, pipeline, stages: {stage: handle}, deployments: {stage: name}}.
    Qwen3-Omni's prompt builder caps input audio at the service's `max_audio_seconds`."""
    config = PipelineConfig.model_validate(spec["pipeline"])
    if config.model.family == "qwen3_omni":
        config = config.model_copy(update={"max_audio_seconds": limits.max_audio_seconds})
    clients = {name: ServeClient(handle) for name, handle in spec["stages"].items()}
    orchestrator = load_family(config.model.family).make_orchestrator(clients, config, limits.max_prompt_tokens)
    return ServedModel(str(spec["model_name"]), config, orchestrator, tuple(spec["deployments"].values()))


# ---- chat ------------------------------------------------------------------------------------------------------------

def prepare_chat(model: ServedModel, body: dict[str, Any], limits: oai.ServiceLimits
                 ) -> tuple[bool, dict[str, Any], list[dict[str, Any]], Prompt]:
    """Everything a chat request needs before any stage sees it (whether it streams, generate's arguments, the
    messages and their prompt); blocking work, run on the parsing pool."""
    if not model.chats:
        raise oai.bad_request(f"'{model.name}' is a text-to-speech model: it serves /v1/audio/speech, not chat",
                              "model", "unsupported_model")
    request = oai.parse_request(body, oai.ChatCompletionRequest, limits)  # max_prompt_chars checked here
    request = resolve_audio_urls_blocking(request, limits)
    kwargs = request.to_generate_kwargs(limits)
    messages = request.to_pipeline_messages()
    prompt = model.orchestrator.prompts.build(messages)  # input audio decoded, the prompt tokenized
    oai.check_prompt_tokens(len(prompt.ids), limits)
    return request.stream, kwargs, messages, prompt


# ---- speech ----------------------------------------------------------------------------------------------------------

def prepare_speech(model: ServedModel, body: dict[str, Any], limits: oai.ServiceLimits
                   ) -> tuple[oai.SpeechRequest, dict[str, Any]]:
    """A speech request parsed by its model's schema, and its orchestrator's `speak(request.input, **kwargs)`
    arguments; blocking work (tokenizing, reference audio decoding), run on the parsing pool."""
    if model.family == "qwen3_tts":
        return _prepare_tts_speech(model, body, limits)
    if model.family == "s2_pro":
        return prepare_s2_pro_speech(model, body, limits)
    request = oai.parse_request(body, oai.SpeechRequest, limits)
    kwargs = request.to_speak_kwargs()
    kwargs["prepared"] = model.orchestrator.speech_prompt(request.input, request.instructions)
    return request, kwargs


def _prepare_tts_speech(model: ServedModel, body: dict[str, Any], limits: oai.ServiceLimits
                        ) -> tuple[TTSSpeechRequest, dict[str, Any]]:
    request = oai.parse_request(body, TTSSpeechRequest, limits)
    kwargs = request.to_speak_kwargs()
    references = request.cloning_references
    if len(references) > 1:
        raise oai.bad_request(f"'{model.name}' clones a voice from one reference; this request gives "
                              f"{len(references)}", "references", "too_many_references")
    check_tts_request(model.orchestrator, request.input, kwargs, cloning=bool(references))
    if references:
        kwargs["reference"] = reference_audio(request, references[0], limits)
    return request, kwargs


def check_tts_request(orchestrator: Any, text: str, kwargs: dict[str, Any], cloning: bool) -> None:
    """A Qwen3-TTS request's mistakes, each a 400 naming it, before any stage runs: an unsupported language, a
    task_type or voice the model lacks, a feature its variant lacks (ref_audio but for Base, instructions to Base,
    VoiceDesign without instructions). A Base request without ref_audio names a stored voice: the orchestrator
    looks it up."""
    language, voice, task_type = kwargs["language"], kwargs["voice"], kwargs["task_type"]
    if language not in orchestrator.languages:
        raise oai.bad_request(f"language {language!r} is not supported by this model: use one of "
                              f"{', '.join(orchestrator.languages)}", "language", "unsupported_language")
    own_task = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}[orchestrator.variant]
    if task_type is not None and task_type != own_task:
        raise oai.bad_request(f"task_type {task_type!r}: this model is a {own_task} model", "task_type",
                              "unsupported_task_type")
    if orchestrator.variant == "custom_voice" and voice is not None and voice not in orchestrator.voices:
        raise oai.bad_request(f"unknown voice {voice!r}; this model's voices: {', '.join(orchestrator.voices)}",
                              "voice", "invalid_voice")
    if orchestrator.variant == "base" and not cloning and voice is not None:
        return  # a stored voice, looked up (and the request checked) by the orchestrator before any stage runs
    try:
        orchestrator.speech_request(text, voice, language, kwargs["instructions"],
                                    PENDING_REFERENCE if cloning else None, kwargs["streaming_text"], task_type)
    except InvalidRequestError as exc:
        raise oai.bad_request(str(exc), None, "unsupported_for_model") from exc


def reference_audio(request: TTSSpeechRequest, reference: SpeechReference, limits: oai.ServiceLimits
                    ) -> ReferenceAudio:
    """A reference (`ref_audio`, or one of `references`) fetched, decoded, checked (length, silence, finite samples)
    and resampled to the encoder's rate, with its transcript; in-context cloning (no `x_vector_only_mode`) needs
    the transcript."""
    audio_param, text_param = ("references.0.audio", "references.0.text") if request.references else (
        "ref_audio", "ref_text")
    x_vector_only = bool(request.x_vector_only_mode)
    if not x_vector_only and not (reference.text or "").strip():
        raise oai.bad_request(f"in-context voice cloning needs {text_param}, the reference audio's transcript (or "
                              "set x_vector_only_mode)", text_param, "missing_ref_text")
    if isinstance(reference.audio, bytes):
        samples, rate = decode_reference_bytes(reference.audio, limits, audio_param)
    else:
        samples, rate = read_reference_audio(reference.audio, limits, audio_param)
    return cloning_reference(samples, rate, reference.text, x_vector_only, audio_param)


def reference_rate(model: ServedModel) -> int:
    """The sample rate a model's reference encoder takes: S2 Pro's codec's (44.1 kHz), else Qwen3-TTS's (24 kHz)."""
    return int(model.orchestrator.sample_rate) if model.family == "s2_pro" else REFERENCE_SAMPLE_RATE


def cloning_reference(samples: np.ndarray, rate: int, text: str | None, x_vector_only: bool,
                      param: str = "ref_audio", target_rate: int = REFERENCE_SAMPLE_RATE) -> ReferenceAudio:
    """Decoded reference audio checked (length, silence, finite samples: a 400 `ref_audio_<reason>`) and resampled to
    the encoder's rate (`target_rate`: `reference_rate` of the model), with its transcript."""
    try:
        prepared = prepare_reference_audio(samples, rate, target_rate=target_rate)
    except ReferenceAudioError as exc:
        raise oai.bad_request(f"{param}: {exc}", param, f"ref_audio_{exc.reason}") from exc
    return ReferenceAudio(prepared, target_rate, text, x_vector_only)


# ---- S2 Pro speech ---------------------------------------------------------------------------------------------------

def prepare_s2_pro_speech(model: ServedModel, body: dict[str, Any], limits: oai.ServiceLimits
                          ) -> tuple[TTSSpeechRequest, dict[str, Any]]:
    """An S2 Pro speech request: the voice of `references` (or `ref_audio` and `ref_text`: one), else of a stored
    voice (`voice`), else the model's own; the official API's sampling with the request's temperature, top-p, top-k
    and seed over it (temperature 0: greedy). Fields S2 Pro has no use for are refused with a 400 naming them."""
    request = oai.parse_request(body, TTSSpeechRequest, limits)
    for name in ("instructions", "task_type", "x_vector_only_mode"):
        if getattr(request, name):
            raise oai.bad_request(f"'{model.name}' (S2 Pro) takes no {name}: it clones a voice from references with "
                                  "their transcripts", name, "unsupported_for_model")
    if (request.language or "auto").strip().lower() not in ("", "auto"):
        raise oai.bad_request(f"language {request.language!r}: S2 Pro reads the language from the text (use auto)",
                              "language", "unsupported_language")
    given = request.cloning_references
    kwargs: dict[str, Any] = {
        "voice": None if given else request.voice, "sampling": s2_pro_sampling(request),
        "max_audio_frames": request.max_new_tokens, "ignore_eos": request.ignore_eos,
        "sample_rate": OUTPUT_SAMPLE_RATE,
    }
    kwargs["references"] = [s2_pro_reference(request, reference, index, limits, reference_rate(model))
                            for index, reference in enumerate(given)]
    return request, kwargs


def s2_pro_sampling(request: TTSSpeechRequest) -> SamplingParams:
    """The official API's draw (temperature 0.8, top-p 0.8, top-k 30) with the request's fields over it."""
    from omni_ray.models.s2_pro.dual_ar_runner import DEFAULT_SAMPLING

    fields = {name: getattr(request, name) for name in ("temperature", "top_p", "top_k", "seed")
              if getattr(request, name) is not None}
    return DEFAULT_SAMPLING.model_copy(update=fields)


def s2_pro_reference(request: TTSSpeechRequest, reference: SpeechReference, index: int, limits: oai.ServiceLimits,
                     sample_rate: int) -> ReferenceAudio:
    """One reference fetched, decoded, checked and resampled to the codec's rate, with its transcript (needed)."""
    audio_param, text_param = ((f"references.{index}.audio", f"references.{index}.text") if request.references
                               else ("ref_audio", "ref_text"))
    if not (reference.text or "").strip():
        raise oai.bad_request(f"S2 Pro clones a voice from reference audio with its transcript: give {text_param}",
                              text_param, "missing_ref_text")
    if isinstance(reference.audio, bytes):
        samples, rate = decode_reference_bytes(reference.audio, limits, audio_param)
    else:
        samples, rate = read_reference_audio(reference.audio, limits, audio_param)
    return cloning_reference(samples, rate, reference.text, False, audio_param, sample_rate)
