"""Code2Wav's SnakeBeta activation, x + sin²(αx) / β per channel, as one Triton kernel.

transformers' `Qwen3OmniMoeSnakeBeta` runs it as about nine kernels, five of them passes over the whole [B, C, T]
activation, each rounding to the model's dtype; the decoder applies it 25 times per call, mostly at its highest
sample rates. This kernel reads x once and writes once, computing in fp32 with α = exp(alpha) and 1 / (exp(beta) +
1e-9) taken once from the weights: it agrees with the module to the model dtype's rounding (exactly as fp32 math
would, not op by op). Without Triton, or off CUDA outside Triton's interpreter, the module runs as it is.
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module's own forward
    triton = None

BLOCK = 1024  # samples per program


if triton is not None:

    @triton.jit
    def _snake_kernel(x_ptr, x_batch_stride, x_channel_stride, alpha_ptr, inverse_beta_ptr, out_ptr, channels,
                      length, BLOCK: tl.constexpr):  # no annotations in jit functions: Triton reads them as its own
        """One (batch, channel) row's block of samples: out = x + sin(x * alpha)^2 * inverse_beta, in fp32."""
        row = tl.program_id(0)
        channel = row % channels
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < length
        source = x_ptr + (row // channels) * x_batch_stride + channel * x_channel_stride
        x = tl.load(source + at, mask=inside, other=0.0).to(tl.float32)
        wave = tl.sin(x * tl.load(alpha_ptr + channel))
        out = x + wave * wave * tl.load(inverse_beta_ptr + channel)
        tl.store(out_ptr + row * length + at, out.to(out_ptr.dtype.element_ty), mask=inside)


class FusedSnake:
    """A SnakeBeta module's forward as one kernel, its per-channel factors taken once from its weights."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        with torch.no_grad():
            self.alpha = module.alpha.detach().float().exp().contiguous()
            self.inverse_beta = (1.0 / (module.beta.detach().float().exp() + module.no_div_by_zero)).contiguous()

    def applies(self, x: torch.Tensor) -> bool:
        """Triton on a GPU (or its interpreter), x [B, C, T] with unit stride along time."""
        on_device = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        return triton is not None and on_device and x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.applies(x):
            return self.module(x)
        batch, channels, length = x.shape
        out = torch.empty(batch, channels, length, dtype=x.dtype, device=x.device)
        with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
            _snake_kernel[(batch * channels, triton.cdiv(length, BLOCK))](
                x, x.stride(0), x.stride(1), self.alpha, self.inverse_beta, out, channels, length, BLOCK=BLOCK,
            )
        return out


def fused_snakes(module: nn.Module, snake_type: type) -> dict[int, FusedSnake]:
    """A `FusedSnake` for every `snake_type` submodule of `module`, by the submodule's id."""
    return {id(sub): FusedSnake(sub) for sub in module.modules() if isinstance(sub, snake_type)}
