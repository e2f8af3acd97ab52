"""Code2Wav's costly ops made cheap: the SnakeBeta activation, the adds around the convolutions and the last
convolution as Triton kernels.

- SnakeBeta, x + sin²(αx) / β per channel: transformers' `Qwen3OmniMoeSnakeBeta` runs it as about nine kernels, five
  of them passes over the whole [B, C, T] activation, each rounding to the model's dtype; the decoder applies it 25
  times per call, mostly at its highest sample rates. `FusedSnake` reads x once and writes once, in fp32 with α =
  exp(alpha) and 1 / (exp(beta) + 1e-9) taken once from the weights: it agrees with the module to the model dtype's
  rounding (as fp32 math would, not op by op).
- `add_and_snake`: what comes around a convolution in the decoder, in the same pass. Torch adds a cuDNN
  convolution's bias in a kernel of its own (a broadcast, so not vectorised), a residual unit adds its input in
  another, the next SnakeBeta reads the sum again, and a causal convolution's carried samples are joined to its
  input by a copy (`torch.cat`): in an op profile of the vocoder (32 streams) the broadcast adds and the
  joins took about a third of its GPU time. One kernel adds the bias and the residual, keeps the sum where it is
  needed later, and writes the SnakeBeta of it after the carried samples of the next convolution's input buffer.
- The decoder's last convolution maps 96 channels at 24 kHz to one sample stream. The costliest kernel of the
  vocoder inside the 1-GPU service was a non-tensor-core cuDNN `implicit_convolve_sgemm`, about 1.4 ms per call
  and 17% of its GPU time (in a profile), called about as often as the decoder runs: most likely this
  convolution, which the profile does not name. `single_output_conv1d` reads the input once, each program summing
  channels x taps for a block of samples in fp32.
- Either activation layout: a [B, C, T] activation stored channel by channel, or channels last ([B, T, C]
  underneath, `is_channels_last`: what the stateful decoder runs in, see `convolutions.py`). Each kernel writes its
  outputs in its input's layout (`empty_activation`).

Without Triton, or off CUDA outside Triton's interpreter, torch's ops and the modules run instead.
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
# `single_output_conv1d`'s tile: 16 channels x 256 samples per program. At 32 channels x 1,024 samples, reduced over the
# channels at every tap, the kernel took 1.1 ms per call for 32 streams' 8-frame decode (96 MB read: about 85 GB/s),
# 10% of the vocoder's GPU time (in an op profile), most likely from the tile spilling out of registers.
CONV_BLOCK, CONV_BLOCK_C = 256, 16
CONV_BLOCK_CHANNELS_LAST, CONV_BLOCK_C_CHANNELS_LAST = 128, 32  # the same tile over a strided channels-last input
# `_single_output_conv_channels_last_kernel`'s time steps per program (x every channel). The tile above took 0.44 ms
# per call over a channels-last input (in an op profile), against 0.23 ms channel by channel.
CONV_BLOCK_DENSE = 32
ADD_TILE = 2048  # `_add_and_snake_channels_last_kernel`'s time steps x channels per program
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

    @triton.jit(do_not_specialize=["length", "snake_offset", "snake_row"])
    def _add_and_snake_channels_last_kernel(h_ptr, h_batch_stride, h_time_stride, bias_ptr, r_ptr, r_batch_stride,
                                            r_time_stride, alpha_ptr, inverse_beta_ptr, sum_ptr, snake_ptr, channels,
                                            length, snake_offset, snake_row, HAS_BIAS: tl.constexpr,
                                            HAS_RESIDUAL: tl.constexpr, KEEP_SUM: tl.constexpr, SNAKE: tl.constexpr,
                                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        """`_add_and_snake_kernel` for activations stored channels last (channel stride 1): one batch row's tile of
        BLOCK_T time steps x BLOCK_C channels; `sum` is [B, length, C] underneath, `snake` [B, snake_row, C] with the
        output from time step `snake_offset` on. (The channel count and strides stay specialized on: multiples of 16
        in the released geometry, so one compile, with vector loads and stores.)"""
        batch = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        channel_ok = c < channels
        inside = (t < length)[:, None] & channel_ok[None, :]
        v = tl.load(h_ptr + batch * h_batch_stride + t[:, None] * h_time_stride + c[None, :], mask=inside, other=0.0)
        v = v.to(tl.float32)
        if HAS_BIAS:
            v += tl.load(bias_ptr + c, mask=channel_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_RESIDUAL:
            v += tl.load(r_ptr + batch * r_batch_stride + t[:, None] * r_time_stride + c[None, :], mask=inside,
                         other=0.0).to(tl.float32)
        rounded = v.to(snake_ptr.dtype.element_ty)
        if KEEP_SUM:
            tl.store(sum_ptr + (batch * length + t[:, None]) * channels + c[None, :], rounded, mask=inside)
        if SNAKE:
            v = rounded.to(tl.float32)
            wave = tl.sin(v * tl.load(alpha_ptr + c, mask=channel_ok, other=0.0)[None, :])
            out = v + wave * wave * tl.load(inverse_beta_ptr + c, mask=channel_ok, other=0.0)[None, :]
            tl.store(snake_ptr + (batch * snake_row + snake_offset + t[:, None]) * channels + c[None, :],
                     out.to(snake_ptr.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["x_batch_stride", "length"])
    def _single_output_conv_kernel(x_ptr, x_batch_stride, x_channel_stride, x_time_stride, w_ptr, bias_ptr, out_ptr,
                                   length,
                                   CHANNELS: tl.constexpr, TAPS: tl.constexpr, DILATION: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
        """out[b, t] = bias + sum over c, j of w[c, j] * x[b, c, t + j * DILATION], t in this program's block of
        `length` outputs (x holds length + (TAPS - 1) * DILATION samples per channel). One of x's channel and time
        strides is 1 (specialized on, so the loads run along it)."""
        b = tl.program_id(0)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < length
        partial = tl.zeros([BLOCK_C, BLOCK], dtype=tl.float32)  # summed over channels once, at the end
        for c0 in tl.static_range(0, CHANNELS, BLOCK_C):
            channels = c0 + tl.arange(0, BLOCK_C)
            channel_ok = channels < CHANNELS
            rows = x_ptr + b * x_batch_stride + channels[:, None] * x_channel_stride
            for j in tl.static_range(TAPS):
                x = tl.load(rows + (at + j * DILATION)[None, :] * x_time_stride,
                            mask=channel_ok[:, None] & inside[None, :], other=0.0)
                w = tl.load(w_ptr + channels * TAPS + j, mask=channel_ok, other=0.0)
                partial += x.to(tl.float32) * w.to(tl.float32)[:, None]
        acc = tl.sum(partial, axis=0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr).to(tl.float32)
        tl.store(out_ptr + b * length + at, acc.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit(do_not_specialize=["length"])
    def _single_output_conv_channels_last_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, length, CHANNELS: tl.constexpr,
                                                 TAPS: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                                                 BLOCK_C: tl.constexpr, BLOCK: tl.constexpr):
        """`_single_output_conv_kernel` over a dense channels-last x ([B, length + (TAPS - 1) * DILATION, CHANNELS]
        underneath): a tile of BLOCK time steps x every channel per tap, each time step's channels one contiguous run.
        Its offsets are multiples of the constant CHANNELS, so Triton can prove them aligned and load in vectors."""
        b = tl.program_id(0)
        at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = at < length
        c = tl.arange(0, BLOCK_C)
        channel_ok = c < CHANNELS
        steps = length + (TAPS - 1) * DILATION  # x's time steps per batch row
        partial = tl.zeros([BLOCK, BLOCK_C], dtype=tl.float32)  # summed over channels once, at the end
        for j in tl.static_range(TAPS):
            x = tl.load(x_ptr + (b * steps + at + j * DILATION)[:, None] * CHANNELS + c[None, :],
                        mask=inside[:, None] & channel_ok[None, :], other=0.0)
            w = tl.load(w_ptr + c * TAPS + j, mask=channel_ok, other=0.0)
            partial += x.to(tl.float32) * w.to(tl.float32)[None, :]
        acc = tl.sum(partial, axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr).to(tl.float32)
        tl.store(out_ptr + b * length + at, acc.to(out_ptr.dtype.element_ty), mask=inside)


def _on_triton(x: torch.Tensor) -> bool:
    """Triton present, and x on a GPU (or Triton's interpreter running)."""
    return triton is not None and (x.is_cuda or interpreting())


def is_channels_last(x: torch.Tensor) -> bool:
    """x [B, C, T] (C > 1) stored time step by time step: channel stride 1, time stride C (any batch stride, so a
    slice of a longer activation along time counts)."""
    return x.dim() == 3 and x.shape[1] > 1 and x.stride(1) == 1 and x.stride(2) == x.shape[1]


def empty_activation(batch: int, channels: int, length: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B, C, T] activation in `like`'s layout, dtype and device (channels last: a [B, T, C] tensor
    seen through a transpose)."""
    if is_channels_last(like):
        return torch.empty(batch, length, channels, dtype=like.dtype, device=like.device).transpose(1, 2)
    return torch.empty(batch, channels, length, dtype=like.dtype, device=like.device)


def _time_contiguous(x: torch.Tensor) -> bool:
    """x [B, C, T] with unit stride along time, or stored channels last: the kernels' two layouts."""
    return x.dim() == 3 and (x.stride(-1) == 1 or is_channels_last(x))


def single_output_conv1d(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv(x)` for a Conv1d with one output channel, stride 1, no padding, no groups: x [B, C, T + (k - 1) * d] →
    [B, 1, T], x in either layout. One kernel where Triton runs, else the module."""
    taps, dilation = conv.kernel_size[0], conv.dilation[0]
    length = x.shape[-1] - (taps - 1) * dilation
    if not (_on_triton(x) and _time_contiguous(x) and length > 0):
        return conv(x)
    batch, channels, steps = x.shape
    out = torch.empty(batch, 1, length, dtype=x.dtype, device=x.device)
    bias = conv.bias if conv.bias is not None else conv.weight
    if is_channels_last(x) and x.stride(0) == channels * steps and channels <= 256:  # an input buffer, dense
        with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
            _single_output_conv_channels_last_kernel[(batch, triton.cdiv(length, CONV_BLOCK_DENSE))](
                x, conv.weight, bias, out, length, CHANNELS=channels, TAPS=taps, DILATION=dilation,
                HAS_BIAS=conv.bias is not None, BLOCK_C=triton.next_power_of_2(channels), BLOCK=CONV_BLOCK_DENSE,
            )
        return out
    block, block_c = ((CONV_BLOCK_CHANNELS_LAST, CONV_BLOCK_C_CHANNELS_LAST) if is_channels_last(x)
                      else (CONV_BLOCK, CONV_BLOCK_C))
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _single_output_conv_kernel[(batch, triton.cdiv(length, block))](
            x, x.stride(0), x.stride(1), x.stride(2), conv.weight, bias, out, length,
            CHANNELS=channels, TAPS=taps, DILATION=dilation, HAS_BIAS=conv.bias is not None,
            BLOCK_C=min(block_c, triton.next_power_of_2(channels)), BLOCK=block,
        )
    return out


def takes_single_output(conv: nn.Module) -> bool:
    """Whether `single_output_conv1d` computes this convolution: a Conv1d to one channel, stride 1, no padding or
    groups."""
    return (isinstance(conv, nn.Conv1d) and conv.out_channels == 1 and conv.groups == 1 and conv.stride == (1,)
            and conv.padding == (0,) and conv.weight.is_contiguous())


class FusedSnake:
    """A SnakeBeta module's forward as one kernel, its per-channel factors taken once from its weights."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        with torch.no_grad():
            self.alpha = module.alpha.detach().float().exp().contiguous()
            self.inverse_beta = (1.0 / (module.beta.detach().float().exp() + module.no_div_by_zero)).contiguous()

    def applies(self, x: torch.Tensor) -> bool:
        """Triton on a GPU (or its interpreter), x [B, C, T] with unit stride along time or stored channels last."""
        return _on_triton(x) and _time_contiguous(x) and x.shape[-1] > 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.applies(x):
            return self.module(x)
        out = empty_activation(*x.shape, like=x)
        _launch_add_and_snake(x, None, None, self, None, out)
        return out


def add_and_snake(h: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  snake: FusedSnake | None = None, keep_sum: bool = False,
                  snake_into: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """v = h + bias (per channel) + residual, for h [B, C, T]: (v if `keep_sum` or without a snake, else None;
    `snake`(v), or None without a snake). The snake's output fills the last T samples of `snake_into`'s rows when given (a
    convolution's input buffer whose head holds its carried samples) and is that buffer, else a tensor of its own.
    Outputs in h's layout. One kernel where Triton runs (and `FUSE_AROUND_CONVS`, with h, the residual and
    `snake_into` in one layout), else torch's adds and the snake on their own."""
    if FUSE_AROUND_CONVS and (snake is None or snake.applies(h)) and _on_triton(h) and _fusable(h, residual, snake_into):
        total = empty_activation(*h.shape, like=h) if keep_sum or snake is None else None
        out = None
        if snake is not None:
            out = snake_into if snake_into is not None else empty_activation(*h.shape, like=h)
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


def _fusable(h: torch.Tensor, residual: torch.Tensor | None, snake_into: torch.Tensor | None) -> bool:
    """h, the residual and the snake's buffer (whole) all in one of the kernels' layouts."""
    if h.dim() != 3:
        return False
    if is_channels_last(h):
        return ((residual is None or is_channels_last(residual))
                and (snake_into is None or (is_channels_last(snake_into) and snake_into.transpose(1, 2).is_contiguous())))
    return (h.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
            and (snake_into is None or snake_into.is_contiguous()))


def _launch_add_and_snake(h: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                          snake: FusedSnake | None, total: torch.Tensor | None, out: torch.Tensor | None) -> None:
    """The add-and-snake kernel of h's layout over h [B, C, T]; `out` holds the snake in the last T samples of its
    rows."""
    batch, channels, length = h.shape
    if length == 0:
        return
    either = out if out is not None else total
    assert either is not None
    r = residual if residual is not None else h
    with torch.cuda.device(h.device) if h.is_cuda else nullcontext():
        if is_channels_last(h):
            block_c = 64 if channels % 64 == 0 else 32 if channels % 32 == 0 else min(64, triton.next_power_of_2(channels))
            block_t = ADD_TILE // block_c
            _add_and_snake_channels_last_kernel[(batch, triton.cdiv(length, block_t), triton.cdiv(channels, block_c))](
                h, h.stride(0), h.stride(2), bias if bias is not None else h, r, r.stride(0), r.stride(2),
                snake.alpha if snake is not None else h, snake.inverse_beta if snake is not None else h,
                total if total is not None else either, out if out is not None else either, channels, length,
                out.shape[-1] - length if out is not None else 0, out.shape[-1] if out is not None else length,
                HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, KEEP_SUM=total is not None,
                SNAKE=out is not None, BLOCK_T=block_t, BLOCK_C=block_c,
            )
            return
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
