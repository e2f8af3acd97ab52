"""OpenAI-compatible wire protocol: request validation, mapping to Pipeline.generate, response/SSE builders, errors."""

from __future__ import annotations

import math
from typing import Annotated, Any, Callable, Literal, TypeVar, Union

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, field_validator, model_validator,
)

from omni_ray.audio import AudioTooLongError
from omni_ray.engine.sampler import SamplingParams
from omni_ray.errors import InvalidRequestError
from omni_ray.serve.json_body import JSONBodyError, count_json_items, decode_json_object

MiB = 1 << 20
SPEECH_CONTENT_TYPES: dict[str, str] = {
    "wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg",
}


class OpenAIError(Exception):
    """An HTTP error rendered as OpenAI's envelope: {"error": {message, type, param, code}}."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def too_large(message: str, param: str | None = None, code: str | None = "request_too_large") -> OpenAIError:
    return OpenAIError(413, message, "invalid_request_error", param, code)


def unprocessable(message: str, param: str | None = None, code: str | None = "invalid_schema") -> OpenAIError:
    return OpenAIError(422, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model '{model}' does not exist", "invalid_request_error", "model", "model_not_found")


def rate_limited(retry_after_s: float) -> OpenAIError:
    retry = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return OpenAIError(429, "Too many requests; retry later", "rate_limit_error", None, "rate_limit_exceeded", retry)


def overloaded(retry_after_s: float) -> OpenAIError:
    retry = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return OpenAIError(503, "The server is overloaded; retry later", "server_error", None, "overloaded", retry)


def internal_error(message: str = "The server had an error while processing the request") -> OpenAIError:
    return OpenAIError(500, message, "server_error", None, "internal_error")


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """Schema errors → 422 listing every failing path (inputs are never echoed); param is the first path.

    Paths are dotted ("messages.0.content.1.input_audio.data"), without union tags ("part:text") or validator labels."""
    errors = exc.errors(include_url=False, include_input=False)
    paths = [".".join(str(p) for p in e["loc"] if not (isinstance(p, str) and (":" in p or "[" in p))) for e in errors]
    details = "; ".join(f"{p}: {e['msg']}" if p else str(e["msg"]) for p, e in zip(paths[:10], errors))
    more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
    return unprocessable(f"Invalid request: {details}{more}", paths[0] if paths and paths[0] else None)


def invalid_request(exc: InvalidRequestError) -> OpenAIError:
    """A pipeline client error → 400, or 413 when its cause chain holds AudioTooLongError, or the status an error
    class names (`status`, e.g. a voice store's 404)."""
    status = getattr(exc, "status", 400)
    if isinstance(status, int) and 400 <= status < 500 and status != 400:
        return OpenAIError(status, str(exc), "not_found_error" if status == 404 else "invalid_request_error")
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, AudioTooLongError):
            return too_large(str(exc), "messages", "audio_too_long")
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return bad_request(str(exc))


class ServiceLimits(BaseModel):
    """Per-deployment request limits enforced at the ingress."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_bytes: int = Field(default=32 * MiB, ge=1, description="refused as soon as the bytes read pass it")
    max_json_items: int = Field(default=1 << 18, ge=1,
                                description="commas and colons a JSON body may hold (inside its strings too)")
    max_prompt_chars: int = Field(default=1 << 18, ge=1, description="a chat prompt's text, checked before tokenizing")
    max_parsing_concurrency: int = Field(default=4, ge=1, description="requests parsed at once, off the event loop")
    max_parsing_wait_s: float = Field(default=10.0, gt=0, description="a request's wait for a parsing slot, then 503")
    max_audio_seconds: float = Field(default=300.0, gt=0, description="total input audio of one request")
    max_prompt_tokens: int = Field(default=8192, ge=1)
    max_completion_tokens: int = Field(default=2048, ge=1)
    default_max_tokens: int = Field(default=256, ge=1)
    max_speech_input_chars: int = Field(default=4096, ge=1)
    allow_audio_urls: bool = False
    allowed_local_audio_dirs: list[str] = Field(default_factory=list)
    url_fetch_timeout_s: float = Field(default=10.0, gt=0)
    max_url_bytes: int = Field(default=32 * MiB, ge=1)


def check_prompt_tokens(prompt_tokens: int, limits: ServiceLimits) -> None:
    if prompt_tokens > limits.max_prompt_tokens:
        msg = f"prompt is {prompt_tokens} tokens, over the limit of {limits.max_prompt_tokens}"
        raise bad_request(msg, "messages", "context_length_exceeded")


class _Strict(BaseModel):
    """No coercion ("stream": "yes" is a 422), except an int where a float is expected; unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _named_voice(value: str, param: str) -> str:
    """A voice of only whitespace is a 400, not the default voice."""
    if not value.strip():
        raise bad_request("voice must name a voice, not be blank", param, "invalid_voice")
    return value


# Characters a message or a content part adds to the prompt's text (the chat template's markup), for max_prompt_chars.
PROMPT_CHARS_PER_PART = 16


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class InputAudio(_Strict):
    data: str = Field(min_length=1, description="base64; decoded and validated by the prompt builder")
    format: Literal["wav", "mp3", "flac", "ogg"] | None = None


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioUrl(_Strict):
    url: str = Field(min_length=1)


class AudioUrlPart(_Strict):
    type: Literal["audio_url"]
    audio_url: AudioUrl
    _resolved: dict[str, Any] | None = PrivateAttr(default=None)  # prompt-builder part, set by resolve_audio_urls


def _part_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"part:{kind}" if kind in ("text", "input_audio", "audio_url") else None


# Callable discriminators: one clear error per bad part; their tags ("part:…", "content:…") are dropped from paths.
ContentPart = Annotated[
    Union[Annotated[TextPart, Tag("part:text")], Annotated[InputAudioPart, Tag("part:input_audio")],
          Annotated[AudioUrlPart, Tag("part:audio_url")]],
    Discriminator(_part_tag, custom_error_type="invalid_part_type",
                  custom_error_message="unknown content part type; expected 'text', 'input_audio' or 'audio_url'"),
]
Content = Annotated[
    Union[Annotated[str, Tag("content:text")], Annotated[list[ContentPart], Tag("content:parts")]],
    Discriminator(lambda v: "content:text" if isinstance(v, str) else "content:parts" if isinstance(v, list) else None,
                  custom_error_type="invalid_content",
                  custom_error_message="content must be a string or a list of content parts"),
]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Content
    name: str | None = None  # accepted and ignored


class AudioOutput(_Strict):
    voice: str = Field(min_length=1)
    format: Literal["wav", "pcm16", "flac", "mp3", "opus"]

    @field_validator("voice")
    @classmethod
    def _voice(cls, value: str) -> str:
        return _named_voice(value, "audio.voice")


class StreamOptions(_Strict):
    include_usage: bool = False


# Known OpenAI fields accepted only at their no-op value: (field, accepted when, message of the 400 otherwise).
_NO_TOOLS = "this server has no tool/function calling"
_NOOP_ONLY: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("tools", lambda v: v is None, f"'tools' is not supported: {_NO_TOOLS}"),
    ("tool_choice", lambda v: v is None, f"'tool_choice' is not supported: {_NO_TOOLS}"),
    ("stop", lambda v: v in (None, []), "stop sequences are not supported"),
    ("n", lambda v: v in (None, 1), "only n=1 is supported"),
    ("logprobs", lambda v: not v, "logprobs are not supported"),
    ("top_logprobs", lambda v: not v, "logprobs are not supported"),
    ("presence_penalty", lambda v: not v, "presence_penalty is not supported (only 0); use repetition_penalty"),
    ("frequency_penalty", lambda v: not v, "frequency_penalty is not supported (only 0); use repetition_penalty"),
    ("logit_bias", lambda v: not v, "logit_bias is not supported"),
    ("response_format", lambda v: v is None or v.get("type") == "text", "only response_format 'text' is supported"),
)
_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "repetition_penalty", "seed"}


class ChatCompletionRequest(_Strict):
    """POST /v1/chat/completions. Unknown fields → 422; known but unsupported OpenAI features → 400.

    Extensions: top_k, repetition_penalty. Accepted and ignored: user, metadata, store, messages[].name."""

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] = ["text"]  # pydantic copies mutable defaults per instance
    audio: AudioOutput | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1, description="legacy; max_completion_tokens wins if both")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    ignore_eos: bool = Field(default=False, description="extension (benchmarks): run to max tokens / frame cap")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        """Raises OpenAIError (400) itself: pydantic passes exceptions other than ValueError/AssertionError through."""
        for name, accepted, message in _NOOP_ONLY:
            if not accepted(getattr(self, name)):
                raise bad_request(message, name, "unsupported_parameter")
        if "text" not in self.modalities:
            raise bad_request("modalities must include 'text' (audio-only output is not supported)", "modalities")
        if self.wants_audio and self.audio is None:
            raise bad_request("'audio' (voice and format) is required when modalities include 'audio'", "audio")
        if self.stream and self.audio is not None and self.wants_audio and self.audio.format != "pcm16":
            raise bad_request("streamed audio is always pcm16: set audio.format to 'pcm16'", "audio.format")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        return self

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def prompt_chars(self) -> int:
        """The messages' text, plus PROMPT_CHARS_PER_PART for each message and part (audio parts count only that)."""
        total = 0
        for message in self.messages:
            parts = [message.content] if isinstance(message.content, str) else message.content
            total += PROMPT_CHARS_PER_PART * (1 + len(parts))
            total += sum(len(p) if isinstance(p, str) else len(p.text) if isinstance(p, TextPart) else 0 for p in parts)
        return total

    def check_limits(self, limits: ServiceLimits) -> int:
        """The reply's max_tokens: max_completion_tokens, else max_tokens, else the default; 400 over the cap.
        A prompt over max_prompt_chars is a 400 here, before anything tokenizes it."""
        if self.prompt_chars > limits.max_prompt_chars:
            msg = f"prompt is {self.prompt_chars} characters, over the limit of {limits.max_prompt_chars}"
            raise bad_request(msg, "messages", "context_length_exceeded")
        param, requested = "max_completion_tokens", self.max_completion_tokens
        if requested is None and self.max_tokens is not None:
            param, requested = "max_tokens", self.max_tokens
        if requested is None:
            return min(limits.default_max_tokens, limits.max_completion_tokens)
        if requested > limits.max_completion_tokens:
            raise bad_request(f"{param}={requested} exceeds the limit of {limits.max_completion_tokens}", param)
        return requested

    def to_generate_kwargs(self, limits: ServiceLimits) -> dict[str, Any]:
        """Pipeline.generate kwargs plus `audio_format` (how to encode the reply): pop it before calling generate."""
        # Unset fields take SamplingParams' defaults, which are OpenAI's: temperature 1, top_p 1 (0 → greedy).
        sampling = SamplingParams(**self.model_dump(include=_SAMPLING_FIELDS, exclude_none=True))
        audio = self.audio if self.wants_audio else None
        return {
            "sampling": sampling, "max_tokens": self.check_limits(limits), "audio": audio is not None,
            "speaker": audio.voice.strip().lower() if audio else None, "audio_format": audio.format if audio else None,
            "talker_sampling": talker_sampling(self.temperature, self.seed), "ignore_eos": self.ignore_eos,
        }

    def to_pipeline_messages(self) -> list[dict[str, Any]]:
        """Messages as PromptBuilder.build takes them; audio_url parts must have been through resolve_audio_urls."""
        out: list[dict[str, Any]] = []
        for i, message in enumerate(self.messages):
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                if isinstance(part, AudioUrlPart):
                    if part._resolved is None:
                        raise RuntimeError(f"messages.{i}.content.{j}: call resolve_audio_urls first")
                    parts.append(part._resolved)
                else:
                    parts.append(part.model_dump(exclude_none=True))
            out.append({"role": message.role, "content": parts})
        return out


class SpeechRequest(_Strict):
    """POST /v1/audio/speech → Pipeline.speak. Only speed 1.0; streaming only as pcm or wav (the compressed formats
    are encoded whole). `instructions` replaces speak()'s user turn ("Read the following text aloud.")."""

    model: str = Field(min_length=1)
    input: str
    voice: str = Field(min_length=1)
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus"] = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = Field(
        default="audio", description="audio: the audio's bytes (a whole file, or chunked with stream); sse: "
        "speech.audio.delta events with base64 chunks, then speech.audio.done with usage")
    stream: bool = Field(default=False, description="extension: a chunked audio body as the audio is made")
    instructions: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="extension: Talker temperature")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="extension: Talker sampling seed")
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="extension: the speech's frame cap (12.5 frames a second); speech it cuts "
        "short ends with finish reason length")

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("input must not be empty")
        return value

    @field_validator("voice")
    @classmethod
    def _voice(cls, value: str) -> str:
        return _named_voice(value, "voice")

    @model_validator(mode="after")
    def _supported(self) -> SpeechRequest:
        if self.speed != 1.0:
            raise bad_request("only speed 1.0 is supported", "speed")
        if self.streams and self.response_format not in ("pcm", "wav"):
            raise bad_request("streaming speech is available as 'pcm' or 'wav' only", "response_format")
        return self

    @property
    def streams(self) -> bool:
        """Sent as it is made: a chunked audio body (stream) or server-sent events (stream_format sse)."""
        return self.stream or self.stream_format == "sse"

    @property
    def content_type(self) -> str:
        return SPEECH_CONTENT_TYPES[self.response_format]

    @property
    def audio_format(self) -> str:
        """encode_audio's name for the format (OpenAI 'pcm' = raw 24 kHz 16-bit LE = 'pcm16')."""
        return "pcm16" if self.response_format == "pcm" else self.response_format

    @property
    def speaker(self) -> str:
        return self.voice.strip().lower()

    def check_limits(self, limits: ServiceLimits) -> None:
        """400 when input or instructions exceed max_speech_input_chars."""
        for name, value in (("input", self.input), ("instructions", self.instructions or "")):
            if len(value) > limits.max_speech_input_chars:
                msg = f"{name} is {len(value)} characters, over the limit of {limits.max_speech_input_chars}"
                raise bad_request(msg, name, "string_above_max_length")

    def to_speak_kwargs(self) -> dict[str, Any]:
        """Pipeline.speak(text, **kwargs) arguments: the text is `input`."""
        return {
            "speaker": self.speaker, "instructions": self.instructions or None,
            "talker_sampling": talker_sampling(self.temperature, self.seed), "max_audio_frames": self.max_new_tokens,
        }


def talker_sampling(temperature: float | None, seed: int | None) -> SamplingParams:
    """The Talker's sampling for a request: greedy when the request is greedy (temperature 0), so that a greedy
    request is deterministic end to end; otherwise the released model's settings, seeded by the request."""
    if temperature == 0:
        return SamplingParams(temperature=0.0, repetition_penalty=1.05)
    return SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=seed)


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_json_body(raw: bytes, limits: ServiceLimits) -> dict[str, Any]:
    if len(raw) > limits.max_request_bytes:
        raise too_large(f"request body is {len(raw)} bytes, over the limit of {limits.max_request_bytes}")
    items = count_json_items(raw)
    if items > limits.max_json_items:
        msg = f"request body holds {items} commas and colons, over the limit of {limits.max_json_items}"
        raise bad_request(msg, code="too_many_json_items")
    try:
        return decode_json_object(raw)
    except JSONBodyError as exc:
        raise bad_request(str(exc), code="invalid_json") from exc.__cause__


def parse_request(raw: bytes | dict[str, Any], cls: type[RequestT], limits: ServiceLimits) -> RequestT:
    """Body bytes (or decoded JSON) → a validated request within limits; every failure is an OpenAIError."""
    body = parse_json_body(raw, limits) if isinstance(raw, bytes) else raw
    try:
        request = cls.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    request.check_limits(limits)
    return request


# Response builders live in openai_responses; re-exported here so callers have one protocol module.
from omni_ray.serve.openai_responses import (  # noqa: E402,F401
    SSE_DONE,
    audio_delta,
    audio_message,
    chat_chunk,
    chat_completion,
    models_list,
    speech_audio_delta,
    speech_audio_done,
    sse,
    usage_dict,
)
