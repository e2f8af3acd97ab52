"""Qwen3-Omni codec adapter: a transformers ``Qwen3OmniMoeCode2Wav`` as a streaming ``Codec``."""

from __future__ import annotations

import torch
from torch import nn

from omni_ray.vocoder.streaming import measure_trim

__all__ = ["Code2WavCodec"]


class Code2WavCodec:
    """``Codec`` over a constructed (and loaded) ``Qwen3OmniMoeCode2Wav`` module.

    Decoding runs on the module's device and dtype; output is returned as float32 on CPU.
    ``trim`` (555 samples for the released geometry) is measured once here, not hard-coded.
    """

    def __init__(self, module: nn.Module, sample_rate: int = 24000) -> None:
        self.module = module
        self.num_quantizers: int = int(module.config.num_quantizers)
        self.samples_per_frame: int = int(module.total_upsample)
        self.sample_rate: int = int(sample_rate)
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
        with torch.inference_mode():
            wav = self.module(codes.to(device=self.device, dtype=torch.long)[None])
        return wav.reshape(-1).to(device="cpu", dtype=torch.float32)
