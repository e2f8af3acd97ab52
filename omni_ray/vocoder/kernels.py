"""Two of Code2Wav's ops as Triton kernels: the SnakeBeta activation and the last, one-output-channel convolution.

- SnakeBeta, x + sin²(αx) / β per channel: transformers' `Qwen3OmniMoeSnakeBeta` runs it as about nine kernels, five
  of them passes over the whole [B, C, T] activation, each rounding to the model's dtype; the decoder applies it 25
  times per call, mostly at its highest sample rates. `FusedSnake` reads x once and writes once, in fp32 with α =
  exp(alpha) and 1 / (exp(beta) + 1e-9) taken once from the weights: it agrees with the module to the model dtype's
  rounding (as fp32 math would, not op by op).
- The decoder's last convolution maps 96 channels at 24 kHz to one sample stream. The costliest kernel of the
  vocoder inside the 1-GPU service was a non-tensor-core cuDNN `implicit_convolve_sgemm`, about 1.4 ms per call
  and 17% of its GPU time (session 14's profile), called about as often as the decoder runs: most likely this
  convolution, which the profile does not name. `single_output_conv1d` reads the input once, each program summing
  channels x taps for a block of samples in fp32.

Without Triton, or off CUDA outside Triton's interpreter, torch runs them as before.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from omni_ray.layers.small_batch import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module's own forward
    triton = None

BLOCK = 1024  # samples per program


if triton is not None:

    # Lengths and strides vary with every decode shape: not specialized on (one compile per dtype, not per shape)
    @triton.jit(do_not_specialize=["x_batch_stride", "x_channel_stride", "channels", "length"])
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

    @triton.jit(do_not_specialize=["x_batch_stride", "x_channel_stride", "length"])
    def _single_output_conv_kernel(x_ptr, x_batch_stride, x_channel_stride, w_ptr, bias_ptr, out_ptr, length,
                                   CHANNELS: tl.constexpr, TAPS: tl.constexpr, DILATION: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
        """out[b, t] = bias + sum over c, j of w[c, j] * x[b, c, t + j * DILATION], t in this program's block of
        `length` outputs (x holds length + (TAPS - 1) * DILATION samples per channel)."""
        b = tl.program_id(0)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < length
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in tl.static_range(0, CHANNELS, BLOCK_C):
            channels = c0 + tl.arange(0, BLOCK_C)
            channel_ok = channels < CHANNELS
            rows = x_ptr + b * x_batch_stride + channels[:, None] * x_channel_stride
            for j in tl.static_range(TAPS):
                x = tl.load(rows + (at + j * DILATION)[None, :], mask=channel_ok[:, None] & inside[None, :], other=0.0)
                w = tl.load(w_ptr + channels * TAPS + j, mask=channel_ok, other=0.0)
                acc += tl.sum(x.to(tl.float32) * w.to(tl.float32)[:, None], axis=0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr).to(tl.float32)
        tl.store(out_ptr + b * length + at, acc.to(out_ptr.dtype.element_ty), mask=inside)


def _on_triton(x: torch.Tensor) -> bool:
    """Triton present, and x on a GPU (or Triton's interpreter running)."""
    return triton is not None and (x.is_cuda or interpreting())


def single_output_conv1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv(x)` for a Conv1d with one output channel, stride 1, no padding, no groups: x [B, C, T + (k - 1) * d] →
    [B, 1, T]. One kernel where Triton runs, else the module."""
    taps, dilation = conv.kernel_size[0], conv.dilation[0]
    length = x.shape[-1] - (taps - 1) * dilation
    if not (_on_triton(x) and x.stride(-1) == 1 and length > 0):
        return conv(x)
    batch, channels, _ = x.shape
    out = torch.empty(batch, 1, length, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _single_output_conv_kernel[(batch, triton.cdiv(length, BLOCK))](
            x, x.stride(0), x.stride(1), conv.weight, conv.bias if conv.bias is not None else conv.weight, out, length,
            CHANNELS=channels, TAPS=taps, DILATION=dilation, HAS_BIAS=conv.bias is not None,
            BLOCK_C=min(32, triton.next_power_of_2(channels)), BLOCK=BLOCK,
        )
    return out


def takes_single_output(conv: nn.Module) -> bool:
    """Whether `single_output_conv1d` computes this convolution: a Conv1d to one channel, stride 1, no padding or
    groups."""
    return (isinstance(conv, nn.Conv1d) and conv.out_channels == 1 and conv.groups == 1 and conv.stride == (1,)
            and conv.padding == (0,) and conv.weight.is_contiguous())


def conv1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv(x)`, as `single_output_conv1d` where that takes the convolution."""
    return single_output_conv1d(x, conv) if takes_single_output(conv) else conv(x)


class FusedSnake:
    """A SnakeBeta module's forward as one kernel, its per-channel factors taken once from its weights."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        with torch.no_grad():
            self.alpha = module.alpha.detach().float().exp().contiguous()
            self.inverse_beta = (1.0 / (module.beta.detach().float().exp() + module.no_div_by_zero)).contiguous()

    def applies(self, x: torch.Tensor) -> bool:
        """Triton on a GPU (or its interpreter), x [B, C, T] with unit stride along time."""
        return _on_triton(x) and x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] > 0

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
