"""The stateful decoder's convolutions in either activation layout: channels last through cuDNN's NHWC kernels, a
dilated convolution folded into an undilated one where that is faster, the one-output-channel one as a Triton kernel.

- Channels last: cuDNN runs an H200's bf16 convolutions in NHWC. For a [B, C, T] activation stored channel by channel
  it converts each convolution's input to channels last and its output back: about 18% of the vocoder's GPU time in
  an op profile at 32 streams. An activation stored time step by time step ([B, T, C] underneath: a
  [B, C, T] view with strides (T * C, 1, C), see `kernels.empty_activation`) runs as a 2-D convolution over
  [B, C, 1, T] with the weight stored channels last as well (`channels_last_weight`), which cuDNN reads and writes as
  it is. Every function here returns its output in its input's layout.
- The residual units' kernel-7 convolutions dilated by 3 and 9: for one of them, 384 channels at dilation 9, cuDNN
  falls back to a non-tensor-core `implicit_convolve_sgemm`, 2.91 ms per 8-frame decode of 32 streams against
  0.26 ms undilated, 18% of the vocoder's GPU time (in an op profile, channel by channel).
  `dilation_folded_conv1d` gives the same sums as an undilated convolution over the time steps r, r + d, r + 2d, ...
  of each residue r; `dilated_conv1d` takes it for a shape where it ran faster when first met (timed). The fold is
  plain torch, taken on CUDA only.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_ray.vocoder.kernels import is_channels_last, single_output_conv1d, takes_single_output

FOLD_DILATION = True  # `conv1d` may fold a dilated convolution (where faster); off: cuDNN's always

# per convolution: (which view, the weight's storage and version) → its weight as a 2-D convolution's, channels last
_CHANNELS_LAST_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, int, torch.Tensor]]] = (
    weakref.WeakKeyDictionary())


def channels_last_weight(conv: nn.Module, folded: bool = False) -> torch.Tensor:
    """`conv`'s weight as a 2-D convolution's, stored channels last: [O, C, 1, k] ([C, O, 1, k] for a transposed
    convolution), or [O, C, k, 1] for the dilation fold. Made once per weight (again if the weight was loaded anew or
    moved); `prepare_channels_last` makes them all before graphs are captured."""
    weight = conv.weight
    views = _CHANNELS_LAST_WEIGHTS.setdefault(conv, {})
    view = "folded" if folded else "plain"
    made = views.get(view)
    if made is None or made[:2] != (weight.data_ptr(), weight._version):
        shaped = weight.detach()[..., None] if folded else weight.detach()[:, :, None]
        made = views[view] = (weight.data_ptr(), weight._version, shaped.contiguous(memory_format=torch.channels_last))
    return made[2]


def prepare_channels_last(module: nn.Module) -> None:
    """Every convolution's channels-last weight under `module`, made now (eagerly: not inside a graph capture). A second
    copy of those weights: 129 MiB in bf16 for the released Code2Wav (whose own forward, the window decoder's, keeps
    reading the originals)."""
    with torch.no_grad():
        for conv in module.modules():
            if isinstance(conv, (nn.Conv1d, nn.ConvTranspose1d)) and not takes_single_output(conv):
                channels_last_weight(conv)
                if takes_dilation_fold(conv):
                    channels_last_weight(conv, folded=True)


def _plain_conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool) -> torch.Tensor:
    """cuDNN's (or the CPU's) convolution of x in its layout, without padding; without the bias if not `bias`."""
    b = conv.bias if bias else None
    if is_channels_last(x):
        out = F.conv2d(x.unsqueeze(2), channels_last_weight(conv), b, (1, conv.stride[0]), 0, (1, conv.dilation[0]),
                       conv.groups)
        return out.squeeze(2)
    return F.conv1d(x, conv.weight, b, conv.stride, 0, conv.dilation, conv.groups)


def conv_transpose1d(x: torch.Tensor, conv: nn.ConvTranspose1d) -> torch.Tensor:
    """`conv`'s transposed convolution of x without its bias and untrimmed: [B, O, (T - 1) * stride + k], in x's
    layout."""
    stride, dilation = conv.stride[0], conv.dilation[0]
    if is_channels_last(x):
        out = F.conv_transpose2d(x.unsqueeze(2), channels_last_weight(conv), None, (1, stride), groups=conv.groups,
                                 dilation=(1, dilation))
        return out.squeeze(2)
    return F.conv_transpose1d(x, conv.weight, None, stride, groups=conv.groups, dilation=dilation)


def dilation_folded_conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool = True) -> torch.Tensor:
    """`conv(x)` (without its bias if not `bias`) for a dilated Conv1d (stride 1, no padding, no groups) as an
    undilated convolution: x [B, C, L] is padded to a multiple of the dilation d and seen as [B, C, L' / d, d] (time
    step m * d + r at [m, r]), a Conv2d with the (k, 1) kernel runs along m, and its output [B, O, L' / d - k + 1, d]
    is already in time order. (Folding the residues into the batch instead, then running a Conv1d, costs two
    permuting copies: slower on an H200.)"""
    dilation, taps = conv.dilation[0], conv.kernel_size[0]
    batch, channels, length = x.shape
    out_length = length - (taps - 1) * dilation
    if out_length <= 0:
        return conv(x)
    steps = -(-length // dilation)
    b = conv.bias if bias else None
    if is_channels_last(x):
        rows = x.new_empty(batch, steps * dilation, channels)
        rows[:, length:].zero_()
        rows[:, :length].copy_(x.transpose(1, 2))
        grid = rows.view(batch, steps, dilation, channels).permute(0, 3, 1, 2)  # [B, C, steps, d], channels last
        out = F.conv2d(grid, channels_last_weight(conv, folded=True), b)  # [B, O, steps - k + 1, d], channels last
        return out.permute(0, 2, 3, 1).reshape(batch, -1, out.shape[1]).transpose(1, 2)[..., :out_length]
    grid = F.pad(x, (0, steps * dilation - length)).reshape(batch, channels, steps, dilation)
    out = F.conv2d(grid, conv.weight[..., None], b)
    return out.reshape(batch, out.shape[1], -1)[..., :out_length]


def takes_dilation_fold(conv: nn.Module) -> bool:
    """Whether `dilation_folded_conv1d` computes this convolution: a dilated Conv1d, stride 1, no padding or groups
    (`FOLD_DILATION` off turns the fold off, for A/B measurements)."""
    return (FOLD_DILATION and isinstance(conv, nn.Conv1d) and conv.dilation[0] > 1 and conv.groups == 1
            and conv.stride == (1,) and conv.padding == (0,) and conv.padding_mode == "zeros")


# per convolution: (input shape, whether channels last, dtype, device) → whether the fold ran faster there
_FOLD_FASTER: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], bool]] = weakref.WeakKeyDictionary()


def dilated_conv1d(x: torch.Tensor, conv: nn.Conv1d, bias: bool = True) -> torch.Tensor:
    """A dilated convolution on CUDA, as cuDNN's own or folded, whichever ran faster the first time this convolution
    met this input shape and layout (both timed then; a decoder's warm-up meets every shape its graphs capture).
    cuDNN's choice varies by shape: on an H200, for 32 streams' 8-frame decode stored channel by channel, its kernel
    at 384 channels and dilation 9 took 2.96 ms against 0.31 ms folded, while at 96 and 192 channels the fold was
    slower. Off CUDA, or first met inside a graph capture (no timing there), cuDNN's. Without
    its bias if not `bias`."""
    chosen = _FOLD_FASTER.setdefault(conv, {})
    key = (tuple(x.shape), is_channels_last(x), x.dtype, x.device)
    fold = chosen.get(key)
    if fold is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return _plain_conv1d(x, conv, bias)
        fold = chosen[key] = _fold_is_faster(x, conv)
    return dilation_folded_conv1d(x, conv, bias) if fold else _plain_conv1d(x, conv, bias)


def _fold_is_faster(x: torch.Tensor, conv: nn.Conv1d, calls: int = 3) -> bool:
    """Both ways timed on the current stream after a first call each (cuDNN picks its algorithm on the first): the
    fold only where it saves a tenth or more."""
    dilated = mean_cuda_ms(lambda: _plain_conv1d(x, conv, True), calls)
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
    """`conv(x)` without padding, in x's layout: as `single_output_conv1d` where that takes the convolution, a dilated
    one as `dilated_conv1d`. Without its bias if not `bias` (for `add_and_snake` to add it), except where
    `single_output_conv1d` runs."""
    if takes_single_output(conv):
        return single_output_conv1d(x, conv)
    return dilated_conv1d(x, conv, bias) if takes_dilation_fold(conv) else _plain_conv1d(x, conv, bias)
