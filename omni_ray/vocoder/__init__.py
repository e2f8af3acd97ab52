"""Streaming vocoders: codec-agnostic chunked decoding plus per-model codec adapters."""

from omni_ray.vocoder.code2wav import Code2WavCodec
from omni_ray.vocoder.streaming import (
    ChunkSchedule,
    Codec,
    StatefulCodec,
    StatefulStreamingDecoder,
    StreamingDecoder,
    decode_window_lengths,
    measure_trim,
    step_shapes,
)

__all__ = [
    "ChunkSchedule",
    "Code2WavCodec",
    "Codec",
    "StatefulCodec",
    "StatefulStreamingDecoder",
    "StreamingDecoder",
    "decode_window_lengths",
    "measure_trim",
    "step_shapes",
]
