"""The stateful vocoder's dilated convolutions, each shape one steady decode of S streams hands them, timed three
ways: cuDNN's dilated convolution as it is, `dilation_folded_conv1d` (the fold: a Conv2d over [B, C, L / d, d] with a
(k, 1) kernel), and `dilated_conv1d` (whichever of the two ran faster when first met, as the vocoder takes them). Each
against the dilated convolution's output. (At 6e0114e the fold's column was the residues folded into the batch with two
permuting copies, and the Conv2d form a column of its own.)"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DTYPES, FULL_CONFIG, run_meta, write_results
from omni_ray.models.qwen3_omni.codecs import load_code2wav
from omni_ray.vocoder import ChunkSchedule, Code2WavCodec
from omni_ray.vocoder import code2wav_state
from omni_ray.vocoder.convolutions import dilated_conv1d, dilation_folded_conv1d, mean_cuda_ms


def dilated_shapes(module: nn.Module, streams: int, schedule: ChunkSchedule,
                   codes_device: str) -> list[tuple[tuple[int, ...], nn.Conv1d]]:
    """(input shape, convolution) of every dilated convolution in one steady stateful decode of `streams` streams."""
    seen: list[tuple[tuple[int, ...], nn.Conv1d]] = []
    original = code2wav_state.conv1d

    def record(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
        if conv.dilation[0] > 1:
            seen.append((tuple(x.shape), conv))
        return original(x, conv)

    codec = Code2WavCodec(module, cuda_graphs=False, max_streams=streams)
    slots = torch.tensor([codec.open_stream() for _ in range(streams)])
    first, steady = schedule.chunk_size(0), schedule.steady
    for frames, position in ((first, 0), (steady, first)):
        if position:
            code2wav_state.conv1d = record
        try:
            codes = torch.randint(0, 2048, (streams, codec.num_quantizers, frames)).to(codes_device)
            codec.step_batch(codes, torch.full((streams,), position), slots, position == 0)
        finally:
            code2wav_state.conv1d = original
    unique: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], nn.Conv1d]] = {}
    for shape, conv in seen:
        unique.setdefault((shape, id(conv)), (shape, conv))
    return list(unique.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dilated_conv_probe", description=__doc__)
    parser.add_argument("--config", default=str(FULL_CONFIG))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(args.config)
    module = load_code2wav(None, config, "cuda", DTYPES[args.dtype])
    schedule = ChunkSchedule((1, 2, 4), 8, 25)
    ways = {"dilated": lambda x, conv: conv(x), "folded": dilation_folded_conv1d, "chosen": dilated_conv1d}
    rows = []
    with torch.no_grad():
        for shape, conv in dilated_shapes(module, args.streams, schedule, "cuda"):
            x = torch.randn(shape, device="cuda", dtype=DTYPES[args.dtype])
            expected = conv(x).float()
            row: dict[str, Any] = {"input": list(shape), "out_channels": conv.out_channels,
                                   "dilation": conv.dilation[0], "taps": conv.kernel_size[0]}
            for name, way in ways.items():
                row[f"{name}_ms"] = mean_cuda_ms(lambda: way(x, conv), args.reps, warmup=3)
                row[f"{name}_max_error"] = (way(x, conv).float() - expected).abs().max().item()
            row["scale"] = expected.abs().max().item()
            rows.append(row)
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.dilated_conv_probe", argv, gpu=gpu, dtype=args.dtype, streams=args.streams)
    lines = [f"# The vocoder's dilated convolutions, three ways ({gpu}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, dtype {args.dtype}: the shapes of one steady "
             f"8-frame stateful decode of {args.streams} streams, eager, mean of {args.reps} calls each; max error "
             "against cuDNN's dilated convolution (output scale in brackets)", "",
             "| input [B, C, L] | dilation | dilated (ms) | folded (ms) | as chosen (ms) | max error folded / "
             "as chosen (scale) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['input']} | {r['dilation']} | {r['dilated_ms']:.3f} | {r['folded_ms']:.3f} | "
              f"{r['chosen_ms']:.3f} | {r['folded_max_error']:.3g} / {r['chosen_max_error']:.3g} "
              f"({r['scale']:.3g}) |" for r in rows]
    totals = {name: sum(r[f"{name}_ms"] for r in rows) for name in ways}
    lines += ["", "Per decode, all dilated convolutions: " + ", ".join(f"{k} {v:.2f} ms" for k, v in totals.items())]
    document = {"meta": meta, "rows": rows, "totals_ms": totals}
    write_results(args.out, "dilated_conv_probe", document, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
