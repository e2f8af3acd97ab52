"""The Qwen3-TTS results table: every workload's levels, then the issue's targets with each number's ratio to its
anchor (the peers' figures) and to its floor (`omni_ray.floors.tts_step_floor_ms`)."""

from __future__ import annotations

from typing import Any

from omni_ray.floors import card_bandwidth, tts_step_floor_ms, tts_throughput_ceiling

from benchmarks.tts_e2e.workloads import FRAMES, REFERENCE_TEXT, TEXT

PROMPT_POSITIONS = 12  # the Talker prompt's positions besides the text: role, codec tags, speaker, pad/bos
REFERENCE_FRAMES = 33  # reference.wav: 2.58 s at 12.5 frames a second


def context_positions(workload: str) -> int:
    """The Talker positions a step of workload T attends to, on average over its 75 frames (text as about 1.3
    tokens a word; Base in context adds the reference's frames and transcript)."""
    text = round(1.3 * len(TEXT.split()))
    reference = REFERENCE_FRAMES + round(1.3 * len(REFERENCE_TEXT.split())) if workload.startswith("base") else 0
    return PROMPT_POSITIONS + text + reference + FRAMES // 2


def variant_of(workload: str) -> str:
    """The model variant a workload runs on (base_cached, base_fresh: base)."""
    return "base" if workload.startswith("base") else workload


def _row(rows: list[dict[str, Any]], workload: str, key: str, value: float) -> dict[str, Any] | None:
    return next((r for r in rows if r["phase"] == "measure" and r["workload"] == workload and r.get(key) == value), None)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def way_row(row: dict[str, Any]) -> str:
    """A level's row of the first audio's way: client mean, way in, the server's points, way out (ms)."""
    server = row.get("server", {})
    point = {name: server.get(f"mean_time_to_{name}_seconds_ms") for name in
             ("streams_open", "first_frame_launch", "first_frame", "first_audio", "first_audio_sent")}
    way_in, mean = server.get("mean_request_path_seconds_ms"), row["stats"]["ttfa_s"].get("mean")
    sent = point["first_audio_sent"]
    way_out = None if None in (way_in, mean, sent) else 1000 * mean - way_in - sent
    level = f"{row['rate']:g} req/s" if "rate" in row else f"c={row['concurrency']}"
    cells = [_num(v, "{:.1f}") for v in (None if mean is None else 1000 * mean, way_in, *point.values(), way_out)]
    return f"| {row['workload']} | {level} | " + " | ".join(cells) + " |"


def targets(meta: dict[str, Any], rows: list[dict[str, Any]], configs: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's targets: measured, goal, the anchor and the floor, with the ratios."""
    bandwidth = card_bandwidth(meta["gpu"])
    lines = ["| target | measured | goal | met | anchor | measured / anchor | floor | measured / floor |",
             "|---|---|---|---|---|---|---|---|"]
    for workload, goal_ms, anchor_ms, anchor in (("custom_voice", 30, 38, "Nari 38 ms (sglang-omni 49 ms)"),
                                                 ("base_cached", 50, 185, "sglang-omni 185 ms")):
        row, config = _row(rows, workload, "rate", 20), configs.get(variant_of(workload))
        p95 = row["stats"]["ttfa_s"]["p95"] if row else None
        floor = tts_step_floor_ms(config, 1, context_positions(workload), bandwidth) if config else None
        lines.append(f"| {workload} first audio p95 at 20 req/s (ms) | {_ms(p95)} | ≤ {goal_ms} | "
                     f"{'–' if p95 is None else ('yes' if p95 * 1000 <= goal_ms else 'no')} | {anchor} | "
                     f"{_num(None if p95 is None else p95 * 1000 / anchor_ms)} | {_num(floor, '{:.2f}')} ms (one frame "
                     f"at batch 1) | {_num(None if p95 is None or not floor else p95 * 1000 / floor, '{:.1f}')} |")
        if workload == "custom_voice":
            rate = row["underruns"]["rate"] if row else None
            lines.append(f"| custom_voice underrun at 20 req/s | {_num(rate, '{:.1%}')} | 0 % | "
                         f"{'–' if rate is None else ('yes' if rate == 0 else 'no')} | – | – | 0 % | – |")
    for workload in ("custom_voice", "base_cached"):
        row, config = _row(rows, workload, "concurrency", 64), configs.get(variant_of(workload))
        got = row["audio_throughput"] if row else None
        ceiling = tts_throughput_ceiling(config, 64, context_positions(workload), bandwidth) if config else None
        lines.append(f"| {workload} audio-s/s at c=64 | {_num(got, '{:.1f}')} | ≥ 150 | "
                     f"{'–' if got is None else ('yes' if got >= 150 else 'no')} | vllm-omni 68.7 (H100; 89.2 H200) | "
                     f"{_num(None if got is None else got / 68.7)} | {_num(ceiling, '{:.0f}')} (ceiling) | "
                     f"{_num(None if got is None or not ceiling else got / ceiling, '{:.1%}')} of it |")
    return lines


def run_line(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The run's commit, command, layout, MPS, HTTP front and startup time."""
    return (f"commit `{meta['commit']}`, command `{meta['command']}`, layout `{meta['serve_config']}`"
            + (", under the MPS daemon" if meta.get("mps") else ", no MPS")
            + (", HTTP through Serve's HAProxy front" if "--haproxy" in meta["command"].split() else
               ", HTTP through Serve's proxy")
            + "".join(f"; service ready {r['seconds']:.0f} s after `serve.run`" for r in rows if r["phase"] == "startup"))


def level_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Any workload's notes, its levels' table (first audio, RTF, audio-s/s, underrun, frames, finish reasons), where
    the first audio goes, and the failed requests: the parts every speech family's report shares."""
    lines: list[str] = []
    lines += [f"Note: {r['workload']}: {r['note']}" for r in rows if r["phase"] == "warmup" and r.get("note")]
    lines += ["| workload | level | ok | first audio p50 / p95 (ms) | RTF p50 / p95 | audio-s/s | underrun | frames | "
              "finish reasons |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] != "measure":
            continue
        s = r["stats"]
        level = f"{r['rate']:g} req/s" if "rate" in r else f"c={r['concurrency']}"
        lines.append(f"| {r['workload']} | {level} | {r['ok']}/{r['requests']} | {_ms(s['ttfa_s']['p50'])} / "
                     f"{_ms(s['ttfa_s']['p95'])} | {_num(s['rtf']['p50'], '{:.3f}')} / {_num(s['rtf']['p95'], '{:.3f}')} | "
                     f"{r['audio_throughput']:.1f} | {_num(r['underruns']['rate'], '{:.1%}')} | "
                     f"{','.join(str(f) for f in r['frames_seen']) or '–'} | "
                     + ", ".join(f"{k} {v}" for k, v in r["finish_reasons"].items()) + " |")
    lines += ["", "Where the first audio goes (means over the level, ms): the client's way in (its X-Request-Start to the "
              "ingress handler); then, from the ingress submitting the request, the server's points; then the way "
              "out (the client's mean first audio less the way in and the server's first audio handed on).", "",
              "| workload | level | client first audio, mean | way in | streams open | first frame launched | "
              "first frame | first audio (vocoder) | first audio handed on | way out |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [way_row(r) for r in rows if r["phase"] == "measure"]
    failed = [r for r in rows if r["phase"] in ("warmup", "measure") and r.get("error_samples")]
    lines += [""] + [f"Failed requests, {r['workload']} {r['phase']}: " + "; ".join(r["error_samples"]) for r in failed]
    return lines


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], configs: dict[str, dict[str, Any]],
             baseline: list[dict[str, Any]] | None) -> str:
    lines = [f"# Qwen3-TTS end to end through HTTP ({meta['gpu']}, {meta['date']})", "", run_line(meta, rows), "",
             f"Workload T: \"{TEXT}\" ({len(TEXT.split())} words), {FRAMES} frames (6 s) of speech, EOS ignored "
             "(`max_new_tokens` + `ignore_eos`), streamed raw PCM from `/v1/audio/speech` (`load_tests`). "
             "custom_voice: speaker vivian; base_cached: a voice uploaded once through `/v1/audio/voices`; base_fresh: "
             "`tests/goldens/qwen3_tts/reference.wav` (2.6 s) and its transcript as `ref_audio` + `ref_text` in every "
             "request. Poisson: open-loop arrivals at the rate (seeded); concurrency: closed loop. First audio: request "
             "sent → first audio byte, client side. RTF: the reply's time over its audio. Audio-s/s: audio received "
             "over the level's wall time. Underrun: the share of streams that, played in real time from their first "
             "chunk, ran dry before the next one came.", ""]
    lines += level_tables(rows)
    lines += ["", f"## Targets ({meta['gpu']}; floors at {card_bandwidth(meta['gpu']) / 1e12:.2f} TB/s: a Talker "
              "step reads the backbone once, the code predictor 15 times and each row's KV)", "",
              *targets(meta, rows, configs)]
    if baseline:
        lines += ["", "Official `qwen-tts` `generate_*` on the same GPU (batch 1, whole audio: its first audio is the "
                      "whole generate time):", "", "| variant | first audio = total (s) | audio (s) | audio-s/s | RTF |",
                  "|---|---|---|---|---|"]
        lines += [f"| {b['variant']} | {b['total_s']:.2f} | {b['audio_s']:.2f} | {b['audio_s'] / b['total_s']:.2f} | "
                  f"{b['rtf']:.3f} |" for b in baseline]
    return "\n".join(lines) + "\n"
