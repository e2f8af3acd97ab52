"""Qwen3-TTS prompts: a request's text, voice and language laid out as the Talker's text and codec tracks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_ray.models.qwen3_tts.talker_model import TTSModelConfig

# Each position adds a text embedding to a codec one; a position whose codec track is empty adds nothing.
NO_CODEC = -1


class SpeechRequestError(ValueError):
    """A speech request this model cannot serve as asked (the HTTP layer answers 400 with the message)."""


@dataclass
class VoiceReference:
    """A cloned voice: the speaker encoder's x-vector, and for in-context cloning the reference speech's codes
    [T, G] with its transcript."""

    x_vector: torch.Tensor  # [enc_dim]
    codes: torch.Tensor | None = None
    text: str | None = None

    @property
    def in_context(self) -> bool:
        return self.codes is not None


@dataclass
class SpeechRequest:
    """What one reply speaks, and in which voice. `streaming_text`: the text enters one token a step after the first
    (the package's `non_streaming_mode=False`), rather than all in the prompt."""

    text: str
    language: str = "auto"
    speaker: str | None = None
    instructions: str | None = None
    reference: VoiceReference | None = None
    streaming_text: bool = False


@dataclass
class TalkerPrompt:
    """The Talker's prompt, position by position: a text id each, and a codec id (`NO_CODEC`: none), the speaker's
    x-vector at `speaker_position`, or the sum of a reference frame's code embeddings from `reference_start` on.
    `trailing_ids` are the text ids the decode steps read, from `text_offset` on (then tts_eos once, then tts_pad)."""

    text_ids: list[int]
    codec_ids: list[int]
    speaker_position: int | None = None
    x_vector: torch.Tensor | None = None
    reference_start: int = 0
    reference_codes: torch.Tensor | None = None  # [R, G]
    trailing_ids: list[int] = field(default_factory=list)
    text_offset: int = 1
    text_tokens: int = 0  # the input text's tokens: what the reply's frame cap is proportional to
    voice_positions: int = 0  # the leading positions that hold only the voice and the language, not the input text

    def shared_prefix(self) -> tuple[str, int] | None:
        """The voice's leading positions as (content key, length): their text and codec ids, the x-vector and the
        reference frames among them, hashed; None when there are none."""
        length = self.voice_positions
        if length <= 0:
            return None
        digest = hashlib.sha256()
        digest.update(np.asarray(self.text_ids[:length] + self.codec_ids[:length], dtype=np.int64).tobytes())
        if self.x_vector is not None and self.speaker_position is not None and self.speaker_position < length:
            digest.update(self.x_vector.detach().float().cpu().numpy().tobytes())
        if self.reference_codes is not None and self.reference_start < length:
            frames = self.reference_codes[: length - self.reference_start]
            digest.update(frames.cpu().numpy().astype(np.int64).tobytes())
        return digest.hexdigest(), length

    def __len__(self) -> int:
        return len(self.text_ids)


def _language_id(config: TTSModelConfig, request: SpeechRequest) -> int | None:
    language = request.language.lower()
    if language == "auto":
        language_id = None
    elif language in config.languages:
        language_id = config.languages[language]
    else:
        raise SpeechRequestError(
            f"language {request.language!r} is not supported: use auto or one of {', '.join(sorted(config.languages))}")
    speaker = (request.speaker or "").lower()
    dialect = config.speaker_dialects.get(speaker, False) if request.reference is None else False
    if language in ("chinese", "auto") and dialect:  # a dialect speaker speaks its dialect where Chinese is asked
        language_id = config.languages[str(dialect)]
    return language_id


def _speaker_codec(config: TTSModelConfig, request: SpeechRequest) -> int | None:
    if request.reference is not None or not request.speaker:
        return None
    speaker_id = config.speakers.get(request.speaker.lower())
    if speaker_id is None:
        raise SpeechRequestError(
            f"voice {request.speaker!r} is not one of this model's speakers: {', '.join(sorted(config.speakers))}")
    return speaker_id


def build_prompt(request: SpeechRequest, tokenize: Any, config: TTSModelConfig) -> TalkerPrompt:
    """The Talker prompt of `request`. `tokenize(text) -> list[int]` is the checkpoint's tokenizer. Layout (the
    official package's): [instructions as a user turn] + the assistant role (3 positions, text only) + the codec
    prefix (think/nothink tags with the language, the speaker, pad) over tts_pad…tts_bos, then either the first text
    token over codec bos (streaming text), all the text over codec pad then tts_pad over codec bos (whole text), or,
    for in-context cloning, the reference transcript and text over the reference's frames."""
    body = tokenize(f"<|im_start|>assistant\n{request.text}<|im_end|>\n<|im_start|>assistant\n")
    role, text = body[:3], body[3:-5]
    if not text:
        raise SpeechRequestError("input has no text to speak")
    language_id = _language_id(config, request)
    tags = [config.codec_id("nothink"), config.codec_id("think_bos"), config.codec_id("think_eos")]
    if language_id is not None:
        tags = [config.codec_id("think"), config.codec_id("think_bos"), language_id, config.codec_id("think_eos")]
    pad, bos = config.codec_id("pad"), config.codec_id("bos")
    tts_pad, tts_bos, tts_eos = config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id
    text_ids: list[int] = []
    codec_ids: list[int] = []
    if request.instructions and config.takes_instructions:
        instruct = tokenize(f"<|im_start|>user\n{request.instructions}<|im_end|>\n")
        text_ids += instruct
        codec_ids += [NO_CODEC] * len(instruct)
    text_ids += role
    codec_ids += [NO_CODEC] * 3
    speaker_codec = _speaker_codec(config, request)
    reference = request.reference
    prefix = tags + ([speaker_codec] if speaker_codec is not None else []) + ([NO_CODEC] if reference else []) + [pad]
    speaker_position = len(codec_ids) + len(tags) if reference is not None else None
    text_ids += [tts_pad] * (len(prefix) - 1) + [tts_bos]
    codec_ids += prefix
    prompt = TalkerPrompt(text_ids, codec_ids, speaker_position, None if reference is None else reference.x_vector,
                          text_tokens=len(text), voice_positions=len(text_ids))
    if reference is not None and reference.in_context:
        return _in_context(prompt, request, reference, tokenize, config, text)
    if request.streaming_text:
        prompt.text_ids.append(text[0])
        prompt.codec_ids.append(bos)
        prompt.trailing_ids, prompt.text_offset = text, 1
    else:
        prompt.text_ids += text + [tts_eos, tts_pad]
        prompt.codec_ids += [pad] * (len(text) + 1) + [bos]
    return prompt


def _in_context(
    prompt: TalkerPrompt, request: SpeechRequest, reference: VoiceReference, tokenize: Any, config: TTSModelConfig,
    text: list[int],
) -> TalkerPrompt:
    """In-context cloning: the reference transcript and the text (then tts_eos) over codec bos and the reference's
    frames. With whole text, the text runs over codec pad first; streaming, the two tracks overlap and the longer
    text's rest trails."""
    assert reference.codes is not None
    if not reference.text:
        raise SpeechRequestError("in-context voice cloning needs the reference audio's transcript (ref_text)")
    ref_text = tokenize(f"<|im_start|>assistant\n{reference.text}<|im_end|>\n")[3:-2]
    words = ref_text + text
    prompt.voice_positions += min(len(ref_text), int(reference.codes.shape[0]) + 1)  # the transcript's positions
    frames = int(reference.codes.shape[0])
    pad, bos, tts_pad, tts_eos = config.codec_id("pad"), config.codec_id("bos"), config.tts_pad_token_id, config.tts_eos_token_id
    prompt.reference_codes = reference.codes
    if not request.streaming_text:
        prompt.text_ids += words + [tts_eos]
        prompt.codec_ids += [pad] * (len(words) + 1)
        prompt.text_ids += [tts_pad] * (frames + 1)
        prompt.codec_ids += [bos] + [NO_CODEC] * frames
        prompt.reference_start = len(prompt.codec_ids) - frames
        return prompt
    texts = words + [tts_eos]
    overlap = frames + 1
    prompt.codec_ids += [bos] + [NO_CODEC] * frames
    prompt.reference_start = len(prompt.codec_ids) - frames
    if len(texts) > overlap:
        prompt.text_ids += texts[:overlap]
        prompt.trailing_ids, prompt.text_offset = words, overlap
    else:
        prompt.text_ids += texts + [tts_pad] * (overlap - len(texts))
    return prompt


def prompt_embeddings(prompts: list[TalkerPrompt], model: Any, device: torch.device) -> list[torch.Tensor]:
    """Each prompt's Talker input [T, h]: its text rows projected (one projection for the batch) plus its codec
    rows."""
    lengths = [len(p) for p in prompts]
    text_ids = torch.tensor([i for p in prompts for i in p.text_ids], device=device)
    codec_ids = torch.tensor([i for p in prompts for i in p.codec_ids], device=device)
    texts = model.text(text_ids)
    codecs = model.model.codec_embedding(codec_ids.clamp_min(0)) * (codec_ids >= 0)[:, None].to(texts.dtype)
    out = []
    for prompt, text, codec in zip(prompts, texts.split(lengths), codecs.split(lengths)):
        codec = codec.clone()
        if prompt.speaker_position is not None and prompt.x_vector is not None:
            codec[prompt.speaker_position] = prompt.x_vector.to(device=device, dtype=codec.dtype)
        if prompt.reference_codes is not None:
            frames = prompt.reference_codes.shape[0]
            start = prompt.reference_start
            codec[start : start + frames] = model.frame_embedding(prompt.reference_codes.to(device))
        out.append(text + codec)
    return out
