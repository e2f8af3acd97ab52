"""The S2 Pro results table: workload S's levels (the tables every speech family shares), then the issue's targets with
each number's ratio to its anchors (the peers' figures) and to its floor (`omni_ray.floors.s2_pro_step_floor_ms`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.tts_e2e.report import _ms, _num, _row, level_tables, run_line
from benchmarks.tts_e2e.s2_pro import S2_FRAME_SECONDS, S2_FRAMES, STORED_VOICE
from benchmarks.tts_e2e.workloads import REFERENCE_TEXT, TEXT
from omni_ray.floors import card_bandwidth, s2_pro_step_floor_ms

REFERENCE_SECONDS = 2.58  # tests/goldens/qwen3_tts/reference.wav
# (workload, level, statistic, percentile, goal, anchors as (label, value)): the targets on one H100
TARGETS: tuple[tuple[str, int, str, str, float, tuple[tuple[str, float], ...]], ...] = (
    ("plain", 1, "ttfa_s", "p50", 0.050, (("fish-speech's server, H200", 0.100), ("vllm-omni", 0.133))),
    ("plain", 1, "rtf", "p50", 0.13, (("fish-speech's server, H200", 0.195), ("sglang-omni, H200, batch 1", 0.34))),
    ("plain", 32, "ttfa_s", "p95", 0.200, ()),
    ("plain", 32, "rtf", "p50", 0.2, ()),
    ("stored_reference", 1, "ttfa_s", "p50", 0.050, (("fish-speech's server, H200", 0.100),)),
    ("stored_reference", 1, "rtf", "p50", 0.13, (("fish-speech's server, H200", 0.195),)),
    ("stored_reference", 32, "ttfa_s", "p95", 0.200, ()),
    ("stored_reference", 32, "rtf", "p50", 0.2, ()),
)


def prompt_positions(directory: Path, workload: str) -> int:
    """The Dual-AR prompt's length for workload S with the checkpoint's tokenizer (a stored voice adds the reference's
    frames and transcript)."""
    from omni_ray.models.s2_pro.prompt import Reference, build_prompt, load_encoder

    config = json.loads((directory / "config.json").read_text())
    codebooks = int(config["audio_decoder_config"]["num_codebooks"])
    frames = math.ceil(REFERENCE_SECONDS / S2_FRAME_SECONDS)
    references = [Reference(torch.zeros(codebooks, frames, dtype=torch.long), REFERENCE_TEXT)] \
        if workload == "stored_reference" else []
    return int(build_prompt(TEXT, references, load_encoder(directory), int(config["semantic_start_token_id"]),
                            codebooks).shape[1])


def targets(meta: dict[str, Any], rows: list[dict[str, Any]], directory: Path) -> list[str]:
    """The issue's targets: measured, goal, the anchors and the floor, with the ratios. A level's floor: one Dual-AR
    step at its batch over the prompt and half the reply (first audio: that step in ms; RTF: it over a frame's
    audio)."""
    config = json.loads((directory / "config.json").read_text())
    bandwidth = card_bandwidth(meta["gpu"])
    lines = ["| target | measured | goal | met | anchors | measured / anchor | floor | measured / floor |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, level, stat, percentile, goal, anchors in TARGETS:
        row = _row(rows, workload, "concurrency", level)
        got = row["stats"][stat][percentile] if row else None
        step_ms = s2_pro_step_floor_ms(config, level, prompt_positions(directory, workload) + S2_FRAMES // 2, bandwidth)
        first_audio = stat == "ttfa_s"
        floor = step_ms / 1000 if first_audio else step_ms / (1000 * S2_FRAME_SECONDS)
        show = _ms if first_audio else (lambda v: _num(v, "{:.3f}"))
        what = f"first audio {percentile} (ms)" if first_audio else f"RTF {percentile}"
        ratios = "; ".join(f"{_num(None if got is None else got / value)} ({label})" for label, value in anchors)
        anchor_text = "; ".join(f"{label} {show(value)}" for label, value in anchors)
        lines.append(f"| {workload} {what} at c={level} | {show(got)} | ≤ {show(goal)} | "
                     f"{'–' if got is None else ('yes' if got <= goal else 'no')} | {anchor_text or '–'} | "
                     f"{ratios or '–'} | {_num(floor * 1000 if first_audio else floor, '{:.1f}' if first_audio else '{:.3f}')} "
                     f"({'one step' if first_audio else 'a step over a frame'} at "
                     f"batch {level}) | {_num(None if got is None else got / floor, '{:.1f}')} |")
    for workload in ("plain", "stored_reference"):
        row = _row(rows, workload, "concurrency", 32)
        rate, got = (row["underruns"]["rate"], row["audio_throughput"]) if row else (None, None)
        ceiling = 32 * S2_FRAME_SECONDS * 1000 / s2_pro_step_floor_ms(
            config, 32, prompt_positions(directory, workload) + S2_FRAMES // 2, bandwidth)
        lines.append(f"| {workload} underrun at c=32 | {_num(rate, '{:.1%}')} | 0 % | "
                     f"{'–' if rate is None else ('yes' if rate == 0 else 'no')} | – | – | 0 % | – |")
        lines.append(f"| {workload} audio-s/s at c=32 | {_num(got, '{:.1f}')} | – | – | – | – | {ceiling:.0f} "
                     f"(ceiling) | {_num(None if got is None else got / ceiling, '{:.1%}')} of it |")
    return lines


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], directory: Path) -> str:
    checkpoint = next((r for r in rows if r["phase"] == "checkpoint"), None)
    lines = [f"# Fish Audio S2 Pro end to end through HTTP ({meta['gpu']}, {meta['date']})", "",
             run_line(meta, rows) + (f"; its checkpoint made or found in {checkpoint['seconds']:.0f} s before "
                                     "`serve.run`" if checkpoint else ""), "",
             f"Workload S: \"{TEXT}\" ({len(TEXT.split())} words), {S2_FRAMES} frames "
             f"({S2_FRAMES * S2_FRAME_SECONDS:.1f} s) of speech, EOS ignored (`max_new_tokens` + `ignore_eos`), "
             "streamed raw PCM (24 kHz) from `/v1/audio/speech` (`load_tests`). plain: no voice (the model's own); "
             f"stored_reference: `voice` {STORED_VOICE}, `tests/goldens/qwen3_tts/reference.wav` (2.6 s) and its "
             "transcript stored once through fish-speech's `/v1/references/add`. Concurrency: closed loop. First "
             "audio: request sent → first audio byte, client side. RTF: the reply's time over its audio. Audio-s/s: "
             "audio received over the level's wall time. Underrun: the share of streams that, played in real time "
             "from their first chunk, ran dry before the next one came.", ""]
    lines += level_tables(rows)
    lines += ["", f"## Targets ({meta['gpu']}; floors at {card_bandwidth(meta['gpu']) / 1e12:.2f} TB/s: a Dual-AR "
              "step reads the slow AR's weights with its tied output head once, the fast AR's once per codebook (10 "
              "sequential passes) and each row's KV)", "", *targets(meta, rows, directory)]
    return "\n".join(lines) + "\n"
