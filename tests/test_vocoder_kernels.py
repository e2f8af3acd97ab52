"""The vocoder's Triton kernels (`vocoder/kernels.py`): the fused SnakeBeta against transformers' module, the adds
around a convolution with the next SnakeBeta (`add_and_snake`) against torch's ops, and the one-output-channel
convolution against torch's, under Triton's interpreter on strided inputs with random weights; a stateful stream
running them against the one-shot decode (with the adds fused and not); each compiled for the H200 without a GPU."""

from __future__ import annotations

import pytest
from _triton import compile_for_h200, run_interpreted

SNAKE = r"""
import copy, json, torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta
from omni_ray.vocoder.kernels import BLOCK, FusedSnake, is_channels_last

torch.manual_seed(0)
results = {}
for dtype in (torch.float32, torch.bfloat16):
    module = Qwen3OmniMoeSnakeBeta(5)
    with torch.no_grad():  # distinct frequencies and magnitudes per channel (the checkpoint's init is all zeros)
        module.alpha.copy_(torch.randn(5) * 0.5)
        module.beta.copy_(torch.randn(5) * 0.5)
    module = module.to(dtype)
    in_fp32 = copy.deepcopy(module).float()
    for layout in ("channel by channel", "channels last"):
        x = (torch.randn(2, 5, BLOCK + 40) * 2).to(dtype)[..., 3:]  # past one block, and not contiguous
        if layout == "channels last":  # [B, T, C] underneath, a slice along time
            x = (torch.randn(2, BLOCK + 40, 5) * 2).to(dtype)[:, 3:].transpose(1, 2)
        fused = FusedSnake(module)
        got, expected = fused(x), module(x)
        reference = in_fp32(x.float())  # the same math in fp32
        results[f"{dtype} {layout}"] = {
            "applies": fused.applies(x), "shape": list(got.shape) == list(x.shape), "dtype": str(got.dtype),
            "same layout": is_channels_last(got) == is_channels_last(x) == (layout == "channels last"),
            "error": (got.float() - reference).abs().max().item(),
            "module error": (expected.float() - reference).abs().max().item(),
        }
print(json.dumps(results))
"""


def test_the_fused_snake_equals_the_module_under_the_triton_interpreter() -> None:
    """In either layout, its output in its input's: fp32 equal to the module to float rounding. bf16: within the
    module's own distance from fp32 math (it rounds after each of its ops; the kernel once)."""
    results = run_interpreted(SNAKE)
    for layout in ("channel by channel", "channels last"):
        fp32, bf16 = results[f"torch.float32 {layout}"], results[f"torch.bfloat16 {layout}"]
        assert fp32["applies"] and fp32["shape"] and fp32["same layout"] and fp32["dtype"] == "torch.float32"
        assert fp32["error"] < 1e-5
        assert bf16["applies"] and bf16["shape"] and bf16["same layout"] and bf16["dtype"] == "torch.bfloat16"
        assert bf16["error"] <= bf16["module error"] and bf16["module error"] > 0


CONV = r"""
import json, torch
from omni_ray.vocoder import kernels
from omni_ray.vocoder.kernels import BLOCK, single_output_conv1d, takes_single_output


class Refused:  # a kernel that must not run for this input
    def __getitem__(self, grid):
        raise AssertionError("the strided kernel ran for a dense channels-last input")


strided_kernel = kernels._single_output_conv_kernel

torch.manual_seed(0)
results = {}
for dtype, channels, taps, dilation, bias in ((torch.float32, 96, 7, 1, True), (torch.float32, 40, 3, 2, False),
                                              (torch.bfloat16, 96, 7, 1, True)):
    conv = torch.nn.Conv1d(channels, 1, taps, dilation=dilation, bias=bias).to(dtype)
    for layout in ("channel by channel", "channels last", "channels last, dense"):
        x = torch.randn(3, channels, BLOCK + 50, dtype=dtype)[..., 5:]  # past one block, not contiguous
        if layout == "channels last":  # [B, T, C] underneath, a slice along time
            x = torch.randn(3, BLOCK + 50, channels, dtype=dtype)[:, 5:].transpose(1, 2)
        kernels._single_output_conv_kernel = strided_kernel
        if layout == "channels last, dense":  # a whole [B, T, C] tensor: its own kernel
            x = torch.randn(3, BLOCK + 45, channels, dtype=dtype).transpose(1, 2)
            kernels._single_output_conv_kernel = Refused()
        got, expected = single_output_conv1d(x, conv), conv(x)
        reference = torch.nn.functional.conv1d(x.float(), conv.weight.float(),
                                               None if conv.bias is None else conv.bias.float(), dilation=dilation)
        results[f"{dtype} {channels} {taps} {dilation} {bias} {layout}"] = {
            "taken": takes_single_output(conv), "shape": list(got.shape) == list(expected.shape),
            "error": (got.float() - reference).abs().max().item(),
            "torch error": (expected.float() - reference).abs().max().item(), "scale": reference.abs().max().item()}
results["two outputs taken"] = takes_single_output(torch.nn.Conv1d(8, 2, 3))
print(json.dumps(results))
"""


def test_the_single_output_convolution_equals_torch_under_the_triton_interpreter() -> None:
    """The decoder's last convolution's shape (96 channels, 7 taps), a dilated one without bias, and bf16, on inputs
    stored either way: equal to fp32 math to float rounding (bf16: within one rounding of the output, as torch's
    own)."""
    results = run_interpreted(CONV)
    assert results.pop("two outputs taken") is False
    for case, result in results.items():
        assert result["taken"] and result["shape"], case
        tolerance = 1e-4 * result["scale"] if "float32" in case else max(result["torch error"], 1e-2 * result["scale"])
        assert result["error"] <= tolerance, (case, result)


ADD_AND_SNAKE = r"""
import copy, json, torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta
from omni_ray.vocoder.kernels import BLOCK, FusedSnake, add_and_snake, is_channels_last

torch.manual_seed(0)
results = {}


def activation(channels, length, cut, layout, dtype):  # [2, channels, length - cut]: a slice along time
    if layout == "channels last":
        return torch.randn(2, length, channels, dtype=dtype)[:, cut:].transpose(1, 2)
    return torch.randn(2, channels, length, dtype=dtype)[..., cut:]


for layout, channels in (("channel by channel", 6), ("channels last", 70)):  # 70: a part-filled block of channels
  for dtype in (torch.float32, torch.bfloat16):
    module = Qwen3OmniMoeSnakeBeta(channels)
    with torch.no_grad():
        module.alpha.copy_(torch.randn(channels) * 0.5)
        module.beta.copy_(torch.randn(channels) * 0.5)
    module = module.to(dtype)
    in_fp32 = copy.deepcopy(module).float()
    snake = FusedSnake(module)
    h = activation(channels, BLOCK + 60, 7, layout, dtype)  # past one block, not contiguous
    bias = torch.randn(channels, dtype=dtype)
    residual = activation(channels, BLOCK + 70, 17, layout, dtype)
    carried = torch.randn(2, channels, 12, dtype=dtype)
    for case in ("bias residual sum snake into", "bias snake", "residual snake", "bias sum", "snake into"):
        b = bias if "bias" in case else None
        r = residual if "residual" in case else None
        into, error = None, {}
        if "into" in case:
            into = activation(channels, 12 + h.shape[-1], 0, layout, dtype)
            into[..., :12] = carried
        total, out = add_and_snake(h, b, r, snake if "snake" in case else None, "sum" in case, into)
        v = h.float() + (b.float()[:, None] if b is not None else 0) + (r.float() if r is not None else 0)
        # the snake of the sum as the kernel rounds it (the interpreter truncates where a GPU rounds to nearest, and
        # the snake's slope, up to 1 + alpha / beta, would magnify that one unit)
        kept, _ = add_and_snake(h, b, r, None, True)
        error["kept sum"] = (kept.float() - v).abs().max().item()
        expected = in_fp32(kept.float())
        if "sum" in case:
            error["sum"] = (total.float() - kept.float()).abs().max().item()
            error["same layout"] = is_channels_last(total) == is_channels_last(kept) == (layout == "channels last")
        else:
            error["no sum"] = total is None
        if "snake" in case:
            got = out[..., 12:] if into is not None else out
            error["snake"] = (got.float() - expected).abs().max().item()
            error["shape"] = list(got.shape) == list(h.shape) and is_channels_last(got) == (layout == "channels last")
            error["scale"] = expected.abs().max().item()
        if into is not None:
            error["into"] = out.data_ptr() == into.data_ptr() and torch.equal(out[..., :12], carried)
        results[f"{layout} {dtype} {case}"] = error
print(json.dumps(results))
"""


def test_the_adds_and_the_snake_in_one_pass_equal_torch_under_the_triton_interpreter() -> None:
    """Bias, residual (strided), the sum kept or not, the snake written after carried samples of another buffer
    (left as they were) or into one of its own, each stored channel by channel and channels last (outputs in the
    input's layout): fp32 equal to torch's ops to float rounding; bf16: the sum within one
    unit of its rounding, the snake within one of its largest value's (its fp32 math on the sum as kept)."""
    results = run_interpreted(ADD_AND_SNAKE)
    for case, result in results.items():
        fp32 = "float32" in case
        assert result["kept sum"] <= (1e-5 if fp32 else 0.0625), (case, result)  # bf16: one unit at 8-16
        if "sum" in result:
            assert result["sum"] == 0, (case, result)  # the same kernel's sum, whatever else it wrote
            assert result["same layout"], case
        else:
            assert result["no sum"], case
        if "snake" in result:
            assert result["shape"], case
            assert result["snake"] <= (1e-5 if fp32 else result["scale"] * 2**-7), (case, result)
        if "into" in result:
            assert result["into"], case


def test_the_add_and_snake_kernel_compiles_for_the_h200_without_a_gpu() -> None:
    from omni_ray.vocoder.kernels import BLOCK, _add_and_snake_channels_last_kernel, _add_and_snake_kernel

    types = {"h_ptr": "*bf16", "h_batch_stride": "i32", "h_channel_stride": "i32", "bias_ptr": "*bf16", "r_ptr": "*bf16",
             "r_batch_stride": "i32", "r_channel_stride": "i32", "alpha_ptr": "*fp32", "inverse_beta_ptr": "*fp32",
             "sum_ptr": "*bf16", "snake_ptr": "*bf16", "channels": "i32", "length": "i32", "snake_offset": "i32",
             "snake_row": "i32"}
    channels_last_types = {name.replace("channel_stride", "time_stride"): kind for name, kind in types.items()}
    for flags in ((True, True, True, True), (False, False, False, True), (True, True, True, False)):
        constants = dict(zip(("HAS_BIAS", "HAS_RESIDUAL", "KEEP_SUM", "SNAKE"), flags), BLOCK=BLOCK)
        compile_for_h200(_add_and_snake_kernel, types, constants)
        constants = dict(zip(("HAS_BIAS", "HAS_RESIDUAL", "KEEP_SUM", "SNAKE"), flags), BLOCK_T=32, BLOCK_C=64)
        compile_for_h200(_add_and_snake_channels_last_kernel, channels_last_types, constants)


@pytest.mark.parametrize("layout", ["channel by channel", "channels last", "channels last, dense"])
def test_the_single_output_conv_kernel_compiles_for_the_h200_without_a_gpu(layout: str) -> None:
    """Each layout as it is launched: the strided kernel with its unit stride specialized on (Triton makes an argument
    of 1 a constant), the dense channels-last one at the decoder's 96 channels."""
    from omni_ray.vocoder.kernels import (CONV_BLOCK, CONV_BLOCK_C, CONV_BLOCK_C_CHANNELS_LAST, CONV_BLOCK_CHANNELS_LAST,
                                          CONV_BLOCK_DENSE, _single_output_conv_channels_last_kernel,
                                          _single_output_conv_kernel)

    if layout == "channels last, dense":
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "length": "i32"}
        constants = {"CHANNELS": 96, "TAPS": 7, "DILATION": 1, "HAS_BIAS": True, "BLOCK_C": 128, "BLOCK": CONV_BLOCK_DENSE}
        compile_for_h200(_single_output_conv_channels_last_kernel, types, constants)
        return

    unit = "x_time_stride" if layout == "channel by channel" else "x_channel_stride"
    types = {"x_ptr": "*bf16", "x_batch_stride": "i32", "x_channel_stride": "i32", "x_time_stride": "i32",
             "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "length": "i32"}
    del types[unit]
    block, block_c = ((CONV_BLOCK, CONV_BLOCK_C) if layout == "channel by channel"
                      else (CONV_BLOCK_CHANNELS_LAST, CONV_BLOCK_C_CHANNELS_LAST))
    constants = {unit: 1, "CHANNELS": 96, "TAPS": 7, "DILATION": 1, "HAS_BIAS": True, "BLOCK_C": block_c, "BLOCK": block}
    compile_for_h200(_single_output_conv_kernel, types, constants)


STREAM = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from test_streaming_vocoder import SPF, TRIM, _codes, _tiny_code2wav
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta
from omni_ray.vocoder import code2wav_state, kernels
from omni_ray.vocoder.code2wav_state import StatefulCode2Wav

kernels.FUSE_AROUND_CONVS = sys.argv[1] == "fused"
code2wav_state.CHANNELS_LAST = sys.argv[2] == "channels-last"
module = _tiny_code2wav()
snakes = [m for m in module.modules() if isinstance(m, Qwen3OmniMoeSnakeBeta)]
with torch.no_grad():
    for snake in snakes:
        snake.alpha.copy_(torch.randn_like(snake.alpha) * 0.3)
        snake.beta.copy_(torch.randn_like(snake.beta) * 0.3)
codes = _codes(40)
with torch.inference_mode():
    whole = module(codes[None]).flatten()
stateful = StatefulCode2Wav(module)

def refuse(x):
    raise AssertionError("the module's own SnakeBeta ran")

for snake in snakes:
    snake.forward = refuse
last = module.decoder[-1].conv  # the one-output-channel convolution
assert last.out_channels == 1
last.forward = refuse
if code2wav_state.CHANNELS_LAST:  # every other convolution as a 2-D one over activations stored channels last

    def refuse_1d(*args, **kwargs):
        raise AssertionError("a convolution ran over [B, C, T] as stored channel by channel")

    torch.nn.functional.conv1d = torch.nn.functional.conv_transpose1d = refuse_1d
pieces, state, position = [], None, 0
for size in (1, 2, 4, 8, 8, 8, 8, 1):
    wav, state = stateful.step(codes[None, :, position : position + size], torch.tensor([position]), state)
    pieces.append(wav[0])
    position += size
streamed = torch.cat(pieces)
print(json.dumps({"snakes": len(snakes), "fused": len(stateful.snakes), "same shape": streamed.shape == whole.shape,
                  "error": (streamed - whole).abs().max().item(), "scale": whole.std().item()}))
"""


@pytest.mark.parametrize("adds, layout", [("fused", "channels-last"), ("apart", "channels-last"),
                                          ("fused", "channel-by-channel")])
def test_a_stateful_stream_with_fused_snakes_equals_the_one_shot_decode_under_the_triton_interpreter(
        adds: str, layout: str) -> None:
    """Every SnakeBeta of the stateful decoder and its last convolution run as the kernels (the modules' own forwards
    refuse), with random weights, and the streamed samples equal transformers' one-shot decode: with the adds around
    the convolutions in the snakes' pass and the snakes written into the convolutions' input buffers (`fused`), and
    as torch's adds and joins (`apart`, the A/B setting); with the activations stored channels last (no 1-D
    convolution runs: they would take them channel by channel) and channel by channel (the A/B setting)."""
    result = run_interpreted(STREAM, adds, layout)
    assert result["snakes"] == result["fused"] > 0 and result["same shape"]
    assert result["error"] < 1e-5 and result["scale"] > 0.01


def test_a_dilated_convolution_folded_into_the_batch_equals_torch() -> None:
    """Dilations 3 and 9 of kernel 7 with and without bias, on inputs whose length is and is not a multiple of the
    dilation, one not contiguous, and one too short for any output: the fold gives torch's dilated convolution."""
    import pytest
    import torch

    from omni_ray.vocoder.convolutions import conv1d, dilation_folded_conv1d, takes_dilation_fold

    torch.manual_seed(0)
    for dilation in (3, 9):
        for bias in (True, False):
            conv = torch.nn.Conv1d(6, 5, 7, dilation=dilation, bias=bias).double()
            for length in (6 * dilation + 1, 6 * dilation + 4, 9 * dilation, 100):
                x = torch.randn(3, 6, length + 2, dtype=torch.float64)[..., 2:]
                expected = conv(x)
                assert takes_dilation_fold(conv)
                for got in (dilation_folded_conv1d(x, conv), conv1d(x, conv)):
                    assert got.shape == expected.shape, (dilation, bias, length)
                    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    short = torch.randn(2, 6, 6 * 9, dtype=torch.float64)  # one sample short of an output: torch's own error
    with pytest.raises(RuntimeError):
        conv(short)
    with pytest.raises(RuntimeError):
        dilation_folded_conv1d(short, conv)
    assert not takes_dilation_fold(torch.nn.Conv1d(6, 5, 7))
    assert not takes_dilation_fold(torch.nn.Conv1d(6, 6, 7, dilation=3, groups=6))
