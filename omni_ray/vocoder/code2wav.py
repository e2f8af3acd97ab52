"""Qwen3-Omni codec adapter: a transformers ``Qwen3OmniMoeCode2Wav`` as a batched streaming codec."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from omni_ray.engine.cuda_graphs import GraphCache, all_buckets, bucket_pow2
from omni_ray.vocoder.code2wav_state import StatefulCode2Wav, StateStore
from omni_ray.vocoder.streaming import measure_trim

__all__ = ["Code2WavCodec"]


class Code2WavCodec:
    """``Codec`` and ``BatchDecoder`` over a constructed (and loaded) ``Qwen3OmniMoeCode2Wav`` module.

    Decoding runs on the module's device and dtype, on its own high-priority CUDA stream, replayed from a CUDA graph
    per (batch bucket, window length) when `cuda_graphs` (the chunk schedule makes the set of lengths finite).
    Output is float32 on CPU. ``trim`` (555 samples for the released geometry) is measured once, not hard-coded.
    Another codec of Code2Wav's geometry (Qwen3-TTS's 12 Hz decoder) comes with its own `stateful_class`.
    """

    def __init__(self, module: nn.Module, sample_rate: int = 24000, cuda_graphs: bool = True, max_streams: int = 0,
                 stateful_class: type[StatefulCode2Wav] = StatefulCode2Wav) -> None:
        self.module = module
        self.num_quantizers: int = int(module.config.num_quantizers)
        self.samples_per_frame: int = int(module.total_upsample)
        self.sample_rate: int = int(sample_rate)
        self.graphs = GraphCache(self.device, cuda_graphs)
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self.trim: int = measure_trim(self)
        self.stateful = stateful_class(module)
        self.states = self._state_store(max_streams) if max_streams > 0 else None  # for the stateful path

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
        with self._on_own_stream():
            out = self.graphs.run(("window", rows, codes.shape[-1]), self._forward,
                                  {"codes": _pad_rows(codes.long(), rows).to(self.device, non_blocking=True)})
            wav = out["wav"][:count].reshape(count, -1).to(device="cpu", dtype=torch.float32)
        return wav

    @contextmanager
    def _on_own_stream(self) -> Iterator[None]:
        """Inference on the vocoder's own high-priority stream, after what the calling thread queued on its stream:
        codes relayed on the GPU are stacked there (`batching.stacked`)."""
        if self.stream is None:
            with torch.inference_mode():
                yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            yield

    def open_stream(self) -> int:
        """A state slot for a new stateful stream (`max_streams` at most at once)."""
        if self.states is None:
            raise RuntimeError("this codec was built without stream state (max_streams=0)")
        return self.states.allocate()

    def close_stream(self, slot: int) -> None:
        assert self.states is not None
        self.states.release(slot)

    def copy_state_out(self, slot: int) -> torch.Tensor:
        """A copy of stream `slot`'s state, taken on the vocoder's stream after the steps queued there."""
        assert self.states is not None
        with self._on_own_stream():
            return self.states.buffer[slot].clone()

    def copy_state_in(self, slot: int, state: torch.Tensor) -> None:
        """Overwrite stream `slot`'s state with a `copy_state_out` copy, on the vocoder's stream."""
        assert self.states is not None
        with self._on_own_stream():
            self.states.buffer[slot].copy_(state)

    def step_batch(self, codes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, first: bool) -> torch.Tensor:
        """Stateful decode of ``[B, num_quantizers, n]`` new frames for the streams in `slots` (each at
        `positions[b]` frames decoded so far; `first`: every row's first call) → ``[B, n*spf]`` float32 CPU samples
        (``n*spf - trim`` on first calls). Rows are padded to a bucket with the scratch slot; each (rows, n, first)
        replays one CUDA graph that gathers the rows' state, decodes and scatters the new state back."""
        assert self.states is not None
        count, rows = codes.shape[0], bucket_pow2(codes.shape[0])
        scratch = self.states.scratch_slot
        key = ("step", rows, codes.shape[-1], first)
        fn = lambda **inputs: self._step_forward(first=first, **inputs)  # noqa: E731

        def padded(codes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"codes": _pad_rows(codes, rows).to(self.device, non_blocking=True),
                    "positions": _pad_rows(positions, rows).to(self.device, non_blocking=True),
                    "slots": torch.cat([slots, slots.new_full((rows - count,), scratch)]).to(self.device, non_blocking=True)}

        with self._on_own_stream():
            # the step updates state in place: capture it on scratch rows, never on the real ones
            self.graphs.prepare(key, fn, padded(torch.zeros_like(codes), torch.zeros_like(positions),
                                                torch.full_like(slots, scratch)))
            out = self.graphs.run(key, fn, padded(codes, positions, slots))
            return out["wav"][:count].to(device="cpu", dtype=torch.float32)

    def warmup(self, window_lengths: list[int], max_rows: int, step_shapes: Sequence[tuple[int, bool]] = ()) -> None:
        """Capture every (batch bucket, window length) graph before serving, and every stateful (new frames, first
        call) shape in `step_shapes` (on the scratch slot). No-op without CUDA graphs."""
        if not self.graphs.enabled:
            return
        for length in window_lengths:
            for rows in all_buckets(max_rows):
                self.decode_batch(torch.zeros(rows, self.num_quantizers, length, dtype=torch.long))
        for size, first in step_shapes:
            for rows in all_buckets(max_rows):
                assert self.states is not None
                slots = torch.full((rows,), self.states.scratch_slot, dtype=torch.long)
                self.step_batch(torch.zeros(rows, self.num_quantizers, size, dtype=torch.long),
                                torch.zeros(rows, dtype=torch.long), slots, first)

    def _forward(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"wav": self.module(codes)}

    def _step_forward(self, codes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, first: bool) -> dict[str, torch.Tensor]:
        assert self.states is not None
        wav, state = self.stateful.step(codes, positions, None if first else self.states.gather(slots))
        self.states.scatter(slots, state)
        return {"wav": wav}

    def _state_store(self, capacity: int) -> StateStore:
        """Buffers shaped after one stream's state (learnt from a one-frame step)."""
        codes = torch.zeros(1, self.num_quantizers, 1, dtype=torch.long, device=self.device)
        _, state = self.stateful.step(codes, torch.zeros(1, dtype=torch.long, device=self.device), None)
        dtype = next(self.module.parameters()).dtype
        return StateStore([tuple(t.shape[1:]) for t in state], dtype, self.device, capacity)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to `rows` (padding streams: their outputs are dropped)."""
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])

