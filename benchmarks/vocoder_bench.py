"""The vocoder's cost per Talker step. S streams each receive one frame per tick, as from a batched Talker step, and
stream audio on the chunk schedule. Compares the window decoder (left context decoded again) with the stateful one:
wall and decode time per step, frames decoded, decode calls. Full-size Code2Wav with random weights, or any
config's. Use it for changes to `omni_ray/vocoder` (kernels, batching, chunk alignment, graphs).
`--call-costs` and `--profile-ops N` go further into one decode call.

    python -m benchmarks.vocoder_bench --out DIR                  # one GPU (any CUDA GPU; the results name it)
    python -m benchmarks.vocoder_bench --config CONFIG --device cpu --dtype float32 --out DIR   # a config on the CPU"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DTYPES, FULL_CONFIG, run_meta, write_results
from omni_ray.config import VocoderSettings
from omni_ray.engine.cuda_graphs import all_buckets
from omni_ray.models.qwen3_omni.codecs import load_code2wav
from omni_ray.vocoder import ChunkSchedule, Code2WavCodec, StatefulStreamingDecoder, StreamingDecoder
from omni_ray.vocoder import code2wav_state, convolutions
from omni_ray.vocoder import kernels as vocoder_kernels
from omni_ray.vocoder.batching import BatchingCodec, BatchingStatefulCodec
from omni_ray.vocoder.schedule import decode_window_lengths, step_shapes


def run_streams(codec: BatchingCodec | BatchingStatefulCodec, schedule: ChunkSchedule, streams: int, ticks: int,
                device: str, codes_device: str = "cpu", phases: int = 1) -> dict[str, Any]:
    """Talker steps: every stream pushes one frame per step (`ticks` in all, with the step count as the clock), all
    streams at once, each a coroutine on one event loop that submits its decode calls to the batching worker (as
    the vocoder stage's streams do); the step waits for the chunks it completes. With `phases`, stream s starts
    s mod `phases` steps late (in the service, streams start at different steps). The frames are pushed from
    `codes_device`."""
    decoders = [StatefulStreamingDecoder(codec, schedule) if isinstance(codec, BatchingStatefulCodec)
                else StreamingDecoder(codec, schedule) for _ in range(streams)]
    codes = torch.randint(0, 2048, (streams, codec.num_quantizers, ticks), generator=torch.Generator().manual_seed(0))
    codes = codes.to(codes_device)
    worker = codec.worker
    busy, frames, calls = worker.busy_s, worker.frames, worker.batches
    steps = ticks + phases - 1

    async def push(stream: int, tick: int) -> list[torch.Tensor]:
        frame = tick - stream % phases
        if not 0 <= frame < ticks:
            return []
        return await decoders[stream].push_async(codes[stream, :, frame : frame + 1], tick, worker.submit_nowait)

    async def run() -> int:
        pushed = 0
        for tick in range(steps):
            chunks = await asyncio.gather(*(push(stream, tick) for stream in range(streams)))
            pushed += sum(int(c.numel()) for per_stream in chunks for c in per_stream)
        return pushed

    start = time.perf_counter()
    samples = asyncio.run(run())
    torch.cuda.synchronize() if device.startswith("cuda") else None
    wall = time.perf_counter() - start
    row = {"streams": streams, "ticks": steps, "phases": phases, "aligned": schedule.aligned,
           "wall_ms_per_tick": 1000 * wall / steps, "busy_ms_per_tick": 1000 * (worker.busy_s - busy) / steps,
           "frames_decoded_per_tick": (worker.frames - frames) / steps,
           "decode_calls_per_tick": (worker.batches - calls) / steps,
           "audio_s": samples / codec.sample_rate}
    for decoder in decoders:
        decoder.finish()  # not timed: frees the state slots
    return row


def call_costs(codec: Code2WavCodec, schedule: ChunkSchedule, max_rows: int, calls: int = 20) -> list[dict[str, Any]]:
    """Wall time of one stateful decode call (graph replay, codes up, samples back), by rows and new frames, on the
    scratch slot: what a decode call costs the decode thread whatever its rows."""
    assert codec.states is not None
    rows_list = list(all_buckets(max_rows))
    out = []
    for size, first in step_shapes(schedule):
        for rows in rows_list:
            codes = torch.zeros(rows, codec.num_quantizers, size, dtype=torch.long)
            slots = torch.full((rows,), codec.states.scratch_slot, dtype=torch.long)
            positions = torch.full((rows,), 0 if first else 16, dtype=torch.long)
            codec.step_batch(codes, positions, slots, first)
            torch.cuda.synchronize() if codec.device.type == "cuda" else None
            start = time.perf_counter()
            for _ in range(calls):
                codec.step_batch(codes, positions, slots, first)
            out.append({"rows": rows, "frames": size, "first": first,
                        "ms_per_call": 1000 * (time.perf_counter() - start) / calls})
    return out


def profile_ops(module: torch.nn.Module, schedule: ChunkSchedule, streams: int, calls: int, device: str,
                codes_device: str) -> str:
    """`calls` stateful decodes of a steady chunk for `streams` streams at once, run eagerly on this thread (inside a
    graph replay the profiler cannot tell which op launched a kernel, and it records only the thread it runs on),
    by self CUDA time with the ops' input shapes: which convolutions take the time, with which cuDNN kernels."""
    from torch.profiler import ProfilerActivity, profile

    codec = Code2WavCodec(module, cuda_graphs=False, max_streams=streams)
    slots = torch.tensor([codec.open_stream() for _ in range(streams)])
    first, steady = schedule.chunk_size(0), schedule.steady

    def decode(frames: int, position: int) -> None:
        codes = torch.randint(0, 2048, (streams, codec.num_quantizers, frames)).to(codes_device)
        codec.step_batch(codes, torch.full((streams,), position), slots, position == 0)

    decode(first, 0)
    decode(steady, first)  # the steady shape's first call picks its algorithms
    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for call in range(calls):
            decode(steady, first + (call + 1) * steady)
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=30, max_name_column_width=60,
                                                              max_shapes_column_width=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vocoder_bench", description=__doc__)
    parser.add_argument("--config", default=str(FULL_CONFIG))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--ticks", type=int, default=80, help="Talker steps (frames per stream)")
    parser.add_argument("--decoders", default="window,stateful", help="which decoders to run (comma-separated)")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--gather-ms", type=float, default=VocoderSettings().batch_gather_ms,
                        help="as `streaming.batch_gather_ms` (0: decode whatever has arrived at once)")
    parser.add_argument("--cudnn-autotune", action="store_true", help="as `streaming.cudnn_autotune: true`")
    parser.add_argument("--cudnn-last-conv", action="store_true",
                        help="the last (one output channel) convolution by cuDNN, not `single_output_conv1d`")
    parser.add_argument("--no-dilation-fold", action="store_true",
                        help="the dilated convolutions always by cuDNN as they are, never folded")
    parser.add_argument("--no-fused-adds", action="store_true",
                        help="torch's bias and residual adds and joins around the convolutions, the snake apart "
                        "(`kernels.FUSE_AROUND_CONVS` off), not `add_and_snake`")
    parser.add_argument("--channel-by-channel", action="store_true",
                        help="the stateful decoder's activations stored channel by channel, not channels last "
                        "(`code2wav_state.CHANNELS_LAST` off): cuDNN converts around each convolution")
    parser.add_argument("--codes-on-device", action="store_true",
                        help="push the frames from the device, as the same-GPU relay hands them to the vocoder stage")
    parser.add_argument("--phases", type=int, default=1,
                        help="stream s starts s mod PHASES steps late (the service's streams start at different steps)")
    parser.add_argument("--aligned", default="off", choices=["off", "on", "both"],
                        help="chunks aligned to the step clock (`streaming.aligned_chunks`); both: a row each")
    parser.add_argument("--call-costs", action="store_true",
                        help="then time one stateful decode call by rows and new frames (into the results)")
    parser.add_argument("--profile-ops", type=int, default=0, metavar="CALLS",
                        help="then profile CALLS eager stateful decodes of a steady chunk for the most streams at once: "
                        "ops by CUDA time with their input shapes, into vocoder_ops.txt")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    codes_device = args.device if args.codes_on_device else "cpu"
    if args.cudnn_last_conv:  # `convolutions.conv1d` asks this for every convolution it is handed
        convolutions.takes_single_output = lambda conv: False
    convolutions.FOLD_DILATION = not args.no_dilation_fold
    code2wav_state.CHANNELS_LAST = not args.channel_by_channel
    vocoder_kernels.FUSE_AROUND_CONVS = not args.no_fused_adds
    config = Qwen3OmniMoeConfig.from_json_file(args.config)
    streams = [int(s) for s in args.streams.split(",")]
    alignments = {"off": [False], "on": [True], "both": [False, True]}[args.aligned]
    schedule = ChunkSchedule((1, 2, 4), 8, 25, aligned=True in alignments)  # its shapes cover both
    module = load_code2wav(None, config, args.device, DTYPES[args.dtype])
    torch.backends.cudnn.benchmark = args.cudnn_autotune
    codec = Code2WavCodec(module, cuda_graphs=not args.no_graphs, max_streams=max(streams))
    decoders = args.decoders.split(",")
    codec.warmup(decode_window_lengths(schedule) if "window" in decoders else [], max(streams), step_shapes(schedule))
    rows = []
    gather_s = args.gather_ms / 1000
    codecs = (("window", BatchingCodec(codec, 64, gather_s)), ("stateful", BatchingStatefulCodec(codec, 64, gather_s)))
    for mode, batching in [(mode, batching) for mode, batching in codecs if mode in decoders]:
        for count in streams:
            for aligned in alignments:
                rows.append({"mode": mode, **run_streams(batching, replace(schedule, aligned=aligned), count,
                                                         args.ticks, args.device, codes_device, args.phases)})
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    meta = run_meta("benchmarks.vocoder_bench", argv, gpu=gpu, dtype=args.dtype, schedule="ramp 1,2,4; steady 8; left context 25")
    lines = [f"# Vocoder cost per Talker step ({gpu}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, dtype {args.dtype}, {meta['schedule']}", "",
             "| decoder | streams | start phases | chunks aligned | wall per step (ms) | decode busy per step (ms) | "
             "frames decoded per step | decode calls per step |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['streams']} | {r['phases']} | {'yes' if r['aligned'] else 'no'} | "
              f"{r['wall_ms_per_tick']:.2f} | {r['busy_ms_per_tick']:.2f} | "
              f"{r['frames_decoded_per_tick']:.1f} | {r['decode_calls_per_tick']:.2f} |" for r in rows]
    costs = call_costs(codec, schedule, max(streams)) if args.call_costs and "stateful" in decoders else []
    if costs:
        lines += ["", "One stateful decode call (ms, wall: graph replay, codes up, samples back), by rows and new frames:",
                  "", "| rows | " + " | ".join(f"{s} new{' (first)' if f else ''}" for s, f in step_shapes(schedule)) + " |",
                  "|---|" + "---|" * len(step_shapes(schedule))]
        for rows_count in sorted({c["rows"] for c in costs}):
            lines.append(f"| {rows_count} | " + " | ".join(f"{c['ms_per_call']:.2f}" for c in costs
                                                         if c["rows"] == rows_count) + " |")
    write_results(args.out, "vocoder_steps", {"meta": meta, "rows": rows, "call_costs": costs}, "\n".join(lines) + "\n")
    if args.profile_ops:
        table = profile_ops(module, schedule, max(streams), args.profile_ops, args.device, codes_device)
        header = (f"# The stateful vocoder's ops, eager: {args.profile_ops} decodes of {schedule.steady} frames for "
                  f"{max(streams)} streams at once: {gpu}, "
                  f"{meta['date']}, commit {meta['commit']}\n# command: {meta['command']}\n\n")
        (Path(args.out) / "vocoder_ops.txt").write_text(header + table)
        print(header + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
