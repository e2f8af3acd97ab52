"""Qwen3-Omni codec adapter: a transformers ``Qwen3OmniMoeCode2Wav`` as a batched streaming codec."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from omni_ray.engine.cuda_graphs import GraphCache, all_buckets, bucket_pow2
from omni_ray.vocoder.streaming import measure_trim

__all__ = ["Code2WavCodec"]


class Code2WavCodec:
    """``Codec`` and ``BatchDecoder`` over a constructed (and loaded) ``Qwen3OmniMoeCode2Wav`` module.

    Decoding runs on the module's device and dtype, on its own high-priority CUDA stream, replayed from a CUDA graph
    per (batch bucket, window length) when `cuda_graphs` (the chunk schedule makes the set of lengths finite).
    Output is float32 on CPU. ``trim`` (555 samples for the released geometry) is measured once, not hard-coded.
    """

    def __init__(self, module: nn.Module, sample_rate: int = 24000, cuda_graphs: bool = True) -> None:
        self.module = module
        self.num_quantizers: int = int(module.config.num_quantizers)
        self.samples_per_frame: int = int(module.total_upsample)
        self.sample_rate: int = int(sample_rate)
        self.graphs = GraphCache(self.device, cuda_graphs)
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.trim: int = measure_trim(self)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """``[num_quantizers, T]`` int64 codes -> ``T*spf - trim`` float32 CPU samples."""
        if codes.dim() != 2 or codes.shape[0] != self.num_quantizers:
            raise ValueError(
                f"codes must have shape [{self.num_quantizers}, T], got {tuple(codes.shape)}"
            )
        return self.decode_batch(codes[None])[0]

    def decode_batch(self, codes: torch.Tensor) -> torch.Tensor:
        """``[B, num_quantizers, T]`` codes -> ``[B, T*spf - trim]`` float32 CPU samples (rows padded to a bucket)."""
        count, rows = codes.shape[0], bucket_pow2(codes.shape[0])
        padded = torch.zeros(rows, *codes.shape[1:], dtype=torch.long)
        padded[:count] = codes
        with torch.inference_mode(), torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            out = self.graphs.run(("window", rows, codes.shape[-1]), self._forward,
                                  {"codes": padded.to(self.device, non_blocking=True)})
            wav = out["wav"][:count].reshape(count, -1).to(device="cpu", dtype=torch.float32)
        return wav

    def warmup(self, window_lengths: list[int], max_rows: int) -> None:
        """Capture every (batch bucket, window length) graph before serving. No-op without CUDA graphs."""
        if not self.graphs.enabled:
            return
        for length in window_lengths:
            for rows in all_buckets(max_rows):
                self.decode_batch(torch.zeros(rows, self.num_quantizers, length, dtype=torch.long))

    def _forward(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"wav": self.module(codes)}

