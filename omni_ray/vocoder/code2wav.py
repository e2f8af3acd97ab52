"""Qwen3-Omni codec adapter: a transformers ``Qwen3OmniMoeCode2Wav`` as a batched streaming codec."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch
from torch import nn

from omni_ray.engine.cuda_graphs import GraphCache, all_buckets, bucket_pow2
from omni_ray.vocoder.code2wav_state import State, StatefulCode2Wav
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
        self.stateful = StatefulCode2Wav(module)

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

    def step_batch(self, codes: torch.Tensor, positions: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        """Stateful decode of ``[B, num_quantizers, n]`` new frames per stream: ``[B, n*spf]`` float32 CPU samples
        (``n*spf - trim`` on streams' first calls, where `state` is None) and the state to carry (on the device).
        Rows are padded to a bucket (zero state); each (rows, n, first call) shape replays one CUDA graph."""
        count, rows = codes.shape[0], bucket_pow2(codes.shape[0])
        first = state is None
        inputs = {"codes": _pad_rows(codes.to(self.device, non_blocking=True), rows),
                  "positions": _pad_rows(positions.to(self.device, non_blocking=True), rows)}
        if state is not None:
            inputs.update({f"s{i}": _pad_rows(t, rows) for i, t in enumerate(state)})
        with torch.inference_mode(), torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            out = self.graphs.run(("step", rows, codes.shape[-1], first), self._step_forward, inputs)
            wav = out["wav"][:count].to(device="cpu", dtype=torch.float32)
            carried = [out[f"s{i}"][:count].clone() for i in range(len(out) - 1)]
        return wav, carried

    def warmup(self, window_lengths: list[int], max_rows: int, step_shapes: Sequence[tuple[int, bool]] = ()) -> None:
        """Capture every (batch bucket, window length) graph before serving, and every stateful (new frames, first
        call) shape in `step_shapes`. No-op without CUDA graphs."""
        if not self.graphs.enabled:
            return
        for length in window_lengths:
            for rows in all_buckets(max_rows):
                self.decode_batch(torch.zeros(rows, self.num_quantizers, length, dtype=torch.long))
        for size, first in step_shapes:
            for rows in all_buckets(max_rows):
                codes = torch.zeros(rows, self.num_quantizers, size, dtype=torch.long)
                positions = torch.zeros(rows, dtype=torch.long)
                state = None if first else self.step_batch(codes[..., :1], positions, None)[1]
                self.step_batch(codes, positions + (0 if first else 1), state)

    def _forward(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"wav": self.module(codes)}

    def _step_forward(self, codes: torch.Tensor, positions: torch.Tensor, **state: torch.Tensor) -> dict[str, torch.Tensor]:
        carried = [state[f"s{i}"] for i in range(len(state))] if state else None
        wav, new_state = self.stateful.step(codes, positions, carried)
        return {"wav": wav, **{f"s{i}": t for i, t in enumerate(new_state)}}


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows` (padding streams: their outputs are dropped)."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])

