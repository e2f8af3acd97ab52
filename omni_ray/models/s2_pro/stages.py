"""S2 Pro's three stage replicas (reference encoding with the codec, the Dual-AR Talker, the codec's streaming decode)
on the shared stage plumbing."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
import torch

from omni_ray.config import ModelSource, StageConfig, TalkerSettings, TalkerStageConfig, VocoderStageConfig
from omni_ray.engine.codec_talker import talker_options
from omni_ray.engine.cuda_graphs import GraphCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.s2_pro.codec import S2ProCodec, load_codec
from omni_ray.models.s2_pro.codec_state import StatefulS2ProCodec
from omni_ray.models.s2_pro.dual_ar_model import load_dual_ar
from omni_ray.models.s2_pro.dual_ar_runner import (
    DEFAULT_MAX_NEW_TOKENS, DEFAULT_SAMPLING, DualARRunner, dual_ar_sequence,
)
from omni_ray.models.s2_pro.model_files import resolve_model
from omni_ray.models.s2_pro.prompt import IM_END, load_encoder
from omni_ray.reference_audio import prepare_reference_audio
from omni_ray.stages.base import StageBase
from omni_ray.stages.codec_stages import DTYPES, CodecTalkerStage, StreamingVocoderStage

# Window decoding (`stateful: false`): every window of a reply up to this many frames (the official API's default cap,
# 1024: 47.6 s) reaches back to its first frame, so the streamed audio equals the one-shot decode (see `VocoderStage`).
DEFAULT_LEFT_CONTEXT = 1024


@dataclass
class S2ProTalkerRequest:
    """One reply for the Talker: its built prompt [1 + codebooks, T], sampling and frame cap."""

    request_id: str
    prompt: torch.Tensor
    sampling: SamplingParams = DEFAULT_SAMPLING
    max_frames: int | None = None
    ignore_eos: bool = False


def voice_prefix(prompt: torch.Tensor, im_end: int) -> tuple[str, int] | None:
    """The prompt's system turn (its references' transcripts and codes: the voice, none of the text to speak) as
    (content key, length) for the Talker's prefix cache: its columns up to its `<|im_end|>`, hashed."""
    ends = (prompt[0] == im_end).nonzero()
    if ends.numel() == 0:
        return None
    length = int(ends[0, 0]) + 1
    return hashlib.sha256(prompt[:, :length].to(torch.int64).contiguous().numpy().tobytes()).hexdigest(), length


def frame_cap(settings: TalkerSettings, max_frames: int | None) -> int:
    """A reply's frame cap: the request's (`max_frames`), else the official API's `max_new_tokens` (1024 frames,
    47.6 s), within the stage's `max_frames`. A reply the cap ends finishes with `length`. The text-proportional cap
    of Qwen3-TTS (`frames_per_text_token`) is not applied: S2 Pro's frames per token vary too much with the text."""
    return max(min(max_frames or DEFAULT_MAX_NEW_TOKENS, settings.max_frames), 1)


class ReferenceStage(StageBase):
    """Reference audio → the codec's codes [10, T] (resampled to the codec's 44.1 kHz first)."""

    stage_name = "reference"

    def __init__(self, model: ModelSource, stage: StageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res = stage.resources
        with self.startup_phase("load"):
            self.codec: S2ProCodec = load_codec(files.directory, res.device, DTYPES[res.dtype])
        self.startup_done(stage.resources)

    def _encode(self, audio: np.ndarray, sample_rate: int) -> dict[str, Any]:
        samples = prepare_reference_audio(audio, sample_rate, target_rate=self.codec.sample_rate)
        with torch.inference_mode():
            codes = self.codec.encode(torch.from_numpy(samples))
        return {"codes": codes.to(device="cpu", dtype=torch.long), "seconds": samples.size / self.codec.sample_rate}

    async def encode(self, audio: np.ndarray, sample_rate: int) -> dict[str, Any]:
        """{codes: [10, T] int64, seconds} on the host. Unusable audio raises `ReferenceAudioError` (a client
        error)."""
        return await self.run_off_loop(self._encode, audio, sample_rate)

    def load_stats(self) -> dict[str, Any]:
        return {**super().load_stats(), "streams": self.off_loop, "load": self.off_loop}


class TalkerStage(CodecTalkerStage):
    """The continuous-batching Dual-AR: the slow AR's batched steps, the fast AR completing each frame's codebooks;
    each frame's ten codes go to the vocoder replica the caller names."""

    def __init__(self, model: ModelSource, stage: TalkerStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res, engine = stage.resources, stage.engine
        config = files.config
        with self.startup_phase("load"):
            dual_ar = load_dual_ar(files.directory, config, res.device, DTYPES[res.dtype])
        eos = load_encoder(files.directory)(IM_END)
        if len(eos) != 1:
            raise ValueError(f"{files.directory}: {IM_END} is not one token of its tokenizer")
        slow = config.slow
        kv_config = {"num_hidden_layers": slow.num_layers, "num_key_value_heads": slow.num_kv_heads,
                     "head_dim": slow.head_dim}
        self.im_end = eos[0]
        self.start_engines(engine, res, kv_config, lambda cache, rows: DualARRunner(
            dual_ar, self.im_end, cache, rows, **talker_options(engine)))
        self.startup_done(stage.resources)

    def frame_for_vocoder(self, codes: list[int]) -> list[int]:
        return codes[1:]  # [token, code 0..9]: the codec takes the codes

    async def speak(self, request: S2ProTalkerRequest) -> AsyncIterator[list[dict[str, Any]]]:
        refused = self.refuse_or_open(request.request_id)
        if refused is not None:
            yield [refused]
            return
        cap = frame_cap(self.settings, request.max_frames)
        seq = dual_ar_sequence(request.request_id, request.prompt, cap, request.sampling, request.ignore_eos)
        shared = voice_prefix(request.prompt, self.im_end)
        if shared is not None:  # a voice prefilled before is read from the prefix cache (`prefix_cache_mb`)
            seq.shared_prefix_key, seq.shared_prefix_len = shared
        async for batch in self.serve_sequence(seq, cap):
            yield batch


class WindowCodec:
    """The shared vocoder's batched window decoder over `S2ProCodec`: [B, 10, T] codes → [B, T × 2048] float32 host
    samples, eager (the windows of a long left context take too many lengths to capture a CUDA graph each)."""

    trim = 0

    def __init__(self, codec: S2ProCodec) -> None:
        self.codec = codec
        self.num_quantizers = codec.num_quantizers
        self.samples_per_frame = codec.samples_per_frame
        self.sample_rate = codec.sample_rate
        device = next(codec.parameters()).device
        self.graphs = GraphCache(device, False)
        self.stream = None

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.decode_batch(codes[None])[0]

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.codec.decode(codes).to(device="cpu", dtype=torch.float32)

    def warmup(self, window_lengths: list[int], max_rows: int, step_shapes: Any = ()) -> None:
        """One short decode: eager decoding has no shapes to capture."""
        self.decode_batch(torch.zeros(1, self.num_quantizers, 1, dtype=torch.long))


class VocoderStage(StreamingVocoderStage):
    """The codec's decoder, streaming on the layout's chunk schedule (the shared ramp, then steady chunks), eager.

    Stateful (`streaming.stateful`, the default): each chunk decodes only its new frames, the stream's attention and
    convolution state carried between chunks (`codec_state.StatefulS2ProCodec`, `max_streams` streams at once): the
    streamed audio equals the one-shot decode of the whole reply, whatever its length. Stateless: each window
    re-decodes up to `left_context` frames before its new ones, and is exact only when it reaches back to the reply's
    first frame (the codec's rotary positions count from a window's start, so a window that starts later differs by
    about 1e-4 to 1e-3 however long its context); the default left context there (1024 frames, unless the layout
    sets one) keeps every window of a reply up to 1024 frames exact, at the cost of re-decoding the reply so far with
    each chunk. A cloned voice's reference codes are not decoded ahead of the reply: the official decode starts at
    the reply."""

    def __init__(self, model: ModelSource, stage: VocoderStageConfig, replica_id: str | None = None) -> None:
        super().__init__(replica_id, stage.resources.device, stage.relay)
        files = resolve_model(model)
        res, streaming = stage.resources, stage.streaming
        own: dict[str, Any] = {"cuda_graphs": False}
        if not streaming.stateful and "left_context" not in streaming.model_fields_set:
            own["left_context"] = DEFAULT_LEFT_CONTEXT
        stage = stage.model_copy(update={"streaming": streaming.model_copy(update=own)})
        with self.startup_phase("load"):
            codec = load_codec(files.directory, res.device, DTYPES[res.dtype])
            adapter = StatefulS2ProCodec(codec, streaming.max_streams) if streaming.stateful else WindowCodec(codec)
        self.start_codec(adapter, stage)
        self.startup_done(stage.resources)


STAGE_CLASSES: dict[str, type] = {"reference": ReferenceStage, "talker": TalkerStage, "vocoder": VocoderStage}
