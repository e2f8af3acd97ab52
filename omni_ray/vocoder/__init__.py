"""Streaming vocoders: codec-agnostic chunked decoding plus per-model codec adapters."""

from omni_ray.vocoder.code2wav import Code2WavCodec
from omni_ray.vocoder.streaming import (
    ChunkSchedule,
    Codec,
    StreamingDecoder,
    decode_window_lengths,
    measure_trim,
)

__all__ = [
    "ChunkSchedule",
    "Code2WavCodec",
    "Codec",
    "StreamingDecoder",
    "decode_window_lengths",
    "measure_trim",
]
