"""Code2Wav's costly ops made cheap: the SnakeBeta activation and the last convolution as Triton kernels, a dilated
convolution folded into an undilated one where that is faster.

- SnakeBeta, x + sin²(αx) / β per channel: transformers' `Qwen3OmniMoeSnakeBeta` runs it as about nine kernels, five
  of them passes over the whole [B, C, T] activation, each rounding to the model's dtype; the decoder applies it 25
  times per call, mostly at its highest sample rates. `FusedSnake` reads x once and writes once, in fp32 with α =
  exp(alpha) and 1 / (exp(beta) + 1e-9) taken once from the weights: it agrees with the module to the model dtype's
  rounding (as fp32 math would, not op by op).
- `add_and_snake`: what comes around a convolution in the decoder, in the same pass. Torch adds a cuDNN
  convolution's bias in a kernel of its own (a broadcast, so not vectorised), a residual unit adds its input in
  another, the next SnakeBeta reads the sum again, and a causal convolution's carried samples are joined to its
  input by a copy (`torch.cat`): in session 17's op profile of the vocoder (32 streams) the broadcast adds and the
  joins took about a third of its GPU time. One kernel adds the bias and the residual, keeps the sum where it is
  needed later, and writes the SnakeBeta of it after the carried samples of the next convolution's input buffer.
- The decoder's last convolution maps 96 channels at 24 kHz to one sample stream. The costliest kernel of the
  vocoder inside the 1-GPU service was a non-tensor-core cuDNN `implicit_convolve_sgemm`, about 1.4 ms per call
  and 17% of its GPU time (session 14's profile), called about as often as the decoder runs: most likely this
  convolution, which the profile does not name. `single_output_conv1d` reads the input once, each program summing
  channels x taps for a block of samples in fp32.
- The residual units' kernel-7 convolutions dilated by 3 and 9: for one of them, 384 channels at dilation 9, cuDNN
  falls back to the same non-tensor-core `implicit_convolve_sgemm`, 2.91 ms per 8-frame decode of 32 streams against
  0.26 ms undilated, 18% of the vocoder's GPU time (session 16's op profile).
  `dilation_folded_conv1d` gives the same sums as an undilated convolution over the time steps r, r + d, r + 2d, ...
  of each residue r; `dilated_conv1d` takes it for a shape where it ran faster when first met (timed).

Without Triton, or off CUDA outside Triton's interpreter, torch runs the first two as before; the fold (plain torch) is
taken on CUDA only.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.layers.small_batch import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the module's own forward
    triton = None

BLOCK = 1024  # samples per program
# `single_output_conv1d`'s tile: 16 channels x 256 samples per program. At 32 channels x 1,024 samples, reduced over the
# channels at every tap, the kernel took 1.1 ms per call for 32 streams' 8-frame decode (96 MB read: about 85 GB/s),
# 10% of the vocoder's GPU time (session 20's op profile), most likely from the tile spilling out of registers.
CONV_BLOCK, CONV_BLOCK_C = 256, 16
FOLD_DILATION = True  # `conv1d` may fold a dilated convolution (where faster); off: cuDNN's always
FUSE_AROUND_CONVS = True  # `add_and_snake` as one kernel; off: torch's adds, the snake kernel, a copy (A/B runs)


if triton is not None:

    # Lengths and strides vary with every decode shape: not specialized on (one compile per dtype, not per shape)
    @triton.jit(do_not_specialize=["h_batch_stride", "h_channel_stride", "r_batch_stride", "r_channel_stride",
                                   "channels", "length", "snake_offset", "snake_row"])
    def _add_and_snake_kernel(h_ptr, h_batch_stride, h_channel_stride, bias_ptr, r_ptr, r_batch_stride,
                              r_channel_stride, alpha_ptr, inverse_beta_ptr, sum_ptr, snake_ptr, channels, length,
                              snake_offset, snake_row, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                              KEEP_SUM: tl.constexpr, SNAKE: tl.constexpr, BLOCK: tl.constexpr):
        """One (batch, channel) row's block of samples: v = h + bias[channel] + residual in fp32, rounded to the
        output's dtype; v into `sum` ([B, C, length], contiguous), and v + sin(v * alpha)^2 * inverse_beta into
        `snake` at `snake_offset` of rows `snake_row` long. (No annotations in jit functions: Triton reads them as
        its own.)"""
        row = tl.program_id(0)
        channel = row % channels
        batch = row // channels
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < length
        v = tl.load(h_ptr + batch * h_batch_stride + channel * h_channel_stride + at, mask=inside, other=0.0)
        v = v.to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + channel).to(tl.float32)
        if HAS_RESIDUAL:
            v += tl.load(r_ptr + batch * r_batch_stride + channel * r_channel_stride + at, mask=inside,
                         other=0.0).to(tl.float32)
        rounded = v.to(snake_ptr.dtype.element_ty)
        if KEEP_SUM:
            tl.store(sum_ptr + row * length + at, rounded, mask=inside)
        if SNAKE:
            v = rounded.to(tl.float32)  # the snake of the sum as kept (as the module reads it)
            wave = tl.sin(v * tl.load(alpha_ptr + channel))
            out = v + wave * wave * tl.load(inverse_beta_ptr + channel)
            tl.store(snake_ptr + row * snake_row + snake_offset + at, out.to(snake_ptr.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["x_batch_stride", "x_channel_stride", "length"])
    def _single_output_conv_kernel(x_ptr, x_batch_stride, x_channel_stride, w_ptr, bias_ptr, out_ptr, length,
                                   CHANNELS: tl.constexpr, TAPS: tl.constexpr, DILATION: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
        """out[b, t] = bias + sum over c, j of w[c, j] * x[b, c, t + j * DILATION], t in this program's block of
        `length` outputs (x holds length + (TAPS - 1) * DILATION samples per channel)."""
        b = tl.program_id(0)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < length
        partial = tl.zeros([BLOCK_C, BLOCK], dtype=tl.float32)  # summed over channels once, at the end
        for c0 in tl.static_range(0, CHANNELS, BLOCK_C):
            channels = c0 + tl.arange(0, BLOCK_C)
            channel_ok = channels < CHANNELS
            rows = x_ptr + b * x_batch_stride + channels[:, None] * x_channel_stride
            for j in tl.static_range(TAPS):
                x = tl.load(rows + (at + j * DILATION)[None, :], mask=channel_ok[:, None] & inside[None, :], other=0.0)
                w = tl.load(w_ptr + channels * TAPS + j, mask=channel_ok, other=0.0)
                partial += x.to(tl.float32) * w.to(tl.float32)[:, None]
        acc = tl.sum(partial, axis=0)
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
        _single_output_conv_kernel[(batch, triton.cdiv(length, CONV_BLOCK))](
            x, x.stride(0), x.stride(1), conv.weight, conv.bias if conv.bias is not None else conv.weight, out, length,
            CHANNELS=channels, TAPS=taps, DILATION=dilation, HAS_BIAS=conv.bias is not None,
            BLOCK_C=min(CONV_BLOCK_C, triton.next_power_of_2(channels)), BLOCK=CONV_BLOCK,
        )
    return out


def takes_single_output(conv: nn.Module) -> bool:
    """Whether `single_output_conv1d` computes this convolution: a Conv1d to one channel, stride 1, no padding or
    groups."""
    return (isinstance(conv, nn.Conv1d) and conv.out_channels == 1 and conv.groups == 1 and conv.stride == (1,)
            and conv.padding == (0,) and conv.weight.is_contiguous())


def dilation_folded_conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool = True) -> torch.Tensor:
    """`conv(x)` (without its bias if not `bias`) for a dilated Conv1d (stride 1, no padding, no groups) as an
    undilated convolution: x [B, C, L] is padded to a multiple of the dilation d and seen as [B, C, L' / d, d] (time step m * d + r at [m, r]), a Conv2d with
    the (k, 1) kernel runs along m, and its output [B, O, L' / d - k + 1, d] is already in time order. (Folding the
    residues into the batch instead, then running a Conv1d, costs two permuting copies: slower on an H200.)"""
    dilation, taps = conv.dilation[0], conv.kernel_size[0]
    batch, channels, length = x.shape
    out_length = length - (taps - 1) * dilation
    if out_length <= 0:
        return conv(x)
    steps = -(-length // dilation)
    grid = F.pad(x, (0, steps * dilation - length)).reshape(batch, channels, steps, dilation)
    out = F.conv2d(grid, conv.weight[..., None], conv.bias if bias else None)
    return out.reshape(batch, out.shape[1], -1)[..., :out_length]


def takes_dilation_fold(conv: nn.Module) -> bool:
    """Whether `dilation_folded_conv1d` computes this convolution: a dilated Conv1d, stride 1, no padding or groups
    (`FOLD_DILATION` off turns the fold off, for A/B measurements)."""
    return (FOLD_DILATION and isinstance(conv, nn.Conv1d) and conv.dilation[0] > 1 and conv.groups == 1
            and conv.stride == (1,) and conv.padding == (0,) and conv.padding_mode == "zeros")


# per convolution: (input shape, dtype, device) → whether the fold ran faster there
_FOLD_FASTER: weakref.WeakKeyDictionary[nn.Module, dict[tuple[tuple[int, ...], torch.dtype, torch.device], bool]] = (
    weakref.WeakKeyDictionary())


def dilated_conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool = True) -> torch.Tensor:
    """A dilated convolution on CUDA, as cuDNN's own or folded, whichever ran faster the first time this convolution
    met this input shape (both timed then; a decoder's warm-up meets every shape its graphs capture). cuDNN's choice
    varies by shape: on an H200, for 32 streams' 8-frame decode, its kernel at 384 channels and dilation 9 took
    2.96 ms against 0.31 ms folded, while at 96 and 192 channels the fold was slower (session 17's probe). Off CUDA,
    or first met inside a graph capture (no timing there), cuDNN's. Without its bias if not `bias`."""
    chosen = _FOLD_FASTER.setdefault(conv, {})
    key = (tuple(x.shape), x.dtype, x.device)
    fold = chosen.get(key)
    if fold is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return _plain_conv1d(x, conv, bias)
        fold = chosen[key] = _fold_is_faster(x, conv)
    return dilation_folded_conv1d(x, conv, bias) if fold else _plain_conv1d(x, conv, bias)


def _plain_conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool) -> torch.Tensor:
    return conv(x) if bias else conv._conv_forward(x, conv.weight, None)


def _fold_is_faster(x: torch.Tensor, conv: nn.Conv1d, calls: int = 3) -> bool:
    """Both ways timed on the current stream after a first call each (cuDNN picks its algorithm on the first): the
    fold only where it saves a tenth or more."""
    dilated = mean_cuda_ms(lambda: conv(x), calls)
    return mean_cuda_ms(lambda: dilation_folded_conv1d(x, conv), calls) < 0.9 * dilated


def mean_cuda_ms(fn: Callable[[], object], calls: int, warmup: int = 1) -> float:
    """`fn`'s mean GPU time per call on the current stream (CUDA events), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool = True) -> torch.Tensor:
    """`conv(x)`: as `single_output_conv1d` where that takes the convolution, a dilated one as `dilated_conv1d`.
    Without its bias if not `bias` (for `add_and_snake` to add it), except where `single_output_conv1d` runs."""
    if takes_single_output(conv):
        return single_output_conv1d(x, conv)
    return dilated_conv1d(x, conv, bias) if takes_dilation_fold(conv) else _plain_conv1d(x, conv, bias)


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
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _launch_add_and_snake(x, None, None, self, None, out)
        return out


def add_and_snake(h: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  snake: FusedSnake | None = None, keep_sum: bool = False,
                  snake_into: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """v = h + bias (per channel) + residual, for h [B, C, T]: (v if `keep_sum` or without a snake, else None;
    `snake`(v), or None without a snake). The snake's output fills the last T samples of `snake_into`'s rows when given (a
    convolution's input buffer whose head holds its carried samples) and is that buffer, else a tensor of its own.
    One kernel where Triton runs (and `FUSE_AROUND_CONVS`), else torch's adds and the snake on their own."""
    if (FUSE_AROUND_CONVS and (snake is None or snake.applies(h)) and _on_triton(h) and h.dim() == 3
            and h.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
            and (snake_into is None or snake_into.is_contiguous())):
        total = torch.empty(h.shape, dtype=h.dtype, device=h.device) if keep_sum or snake is None else None
        out = None
        if snake is not None:
            out = snake_into if snake_into is not None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
        _launch_add_and_snake(h, bias, residual, snake, total, out)
        return total, out
    v = h if bias is None else h + bias[:, None]
    v = v if residual is None else v + residual
    if snake is None:
        return v, None
    out = snake(v)
    if snake_into is not None:
        snake_into[..., snake_into.shape[-1] - out.shape[-1] :].copy_(out)
        out = snake_into
    return (v if keep_sum else None), out


def _launch_add_and_snake(h: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                          snake: FusedSnake | None, total: torch.Tensor | None, out: torch.Tensor | None) -> None:
    """`_add_and_snake_kernel` over h [B, C, T]; `out` holds the snake in the last T samples of its rows."""
    batch, channels, length = h.shape
    if length == 0:
        return
    either = out if out is not None else total
    assert either is not None
    r = residual if residual is not None else h
    with torch.cuda.device(h.device) if h.is_cuda else nullcontext():
        _add_and_snake_kernel[(batch * channels, triton.cdiv(length, BLOCK))](
            h, h.stride(0), h.stride(1), bias if bias is not None else h, r, r.stride(0), r.stride(1),
            snake.alpha if snake is not None else h, snake.inverse_beta if snake is not None else h,
            total if total is not None else either, out if out is not None else either, channels, length,
            out.shape[-1] - length if out is not None else 0, out.shape[-1] if out is not None else length,
            HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, KEEP_SUM=total is not None,
            SNAKE=out is not None, BLOCK=BLOCK,
        )


def fused_snakes(module: nn.Module, snake_type: type) -> dict[int, FusedSnake]:
    """A `FusedSnake` for every `snake_type` submodule of `module`, by the submodule's id."""
    return {id(sub): FusedSnake(sub) for sub in module.modules() if isinstance(sub, snake_type)}
