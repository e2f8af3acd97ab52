"""Streaming vocoders: codec-agnostic chunked decoding plus per-model codec adapters."""

from omni_ray.vocoder.code2wav import Code2WavCodec
from omni_ray.vocoder.schedule import ChunkSchedule, decode_window_lengths, reference_call_sizes, step_shapes
from omni_ray.vocoder.streaming import Codec, StatefulCodec, StatefulStreamingDecoder, StreamingDecoder, measure_trim

__all__ = [
    "ChunkSchedule",
    "Code2WavCodec",
    "Codec",
    "StatefulCodec",
    "StatefulStreamingDecoder",
    "StreamingDecoder",
    "decode_window_lengths",
    "measure_trim",
    "reference_call_sizes",
    "step_shapes",
]
