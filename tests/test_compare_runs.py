"""`benchmarks.compare_runs`: an A/B's runs side by side at one concurrency, read from their `e2e.json` rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.compare_runs import compare_table, main


def _result(rtf: float, talker_p90: float, last_frame: float, concurrency: int = 32) -> dict[str, Any]:
    level = {
        "phase": "measure", "concurrency": concurrency, "requests": 64, "ok": 63, "talker_frames_past_text": 272,
        "stats": {"ttfa_s": {"p50": 0.2301, "p90": 0.3189}, "rtf": {"p50": rtf}, "latency_s": {"mean": 3.7994}},
        "server": {"talker_step_ms_p50": 5.6, "talker_step_ms_mean": 6.4, "talker_step_ms_p90": talker_p90,
                   "thinker_step_ms_p50": 13.0, "thinker_step_ms_mean": 13.9, "vocoder_busy_s_per_s": 0.204,
                   "mean_text_read_ms": 1961.0, "mean_last_frame_ms": last_frame, "mean_last_audio_ms": last_frame + 28},
    }
    return {"meta": {}, "rows": [{"phase": "startup", "seconds": 90.0}, {"phase": "warmup", "concurrency": concurrency},
                                 level, {"phase": "end"}]}


def test_each_run_is_one_row_of_its_level_in_the_order_given() -> None:
    table = compare_table([("a", _result(0.119, 12.1, 3721.0)), ("b", _result(0.116, 7.7, 3620.6))], 32).splitlines()
    assert len(table) == 4 and table[0].startswith("| run | requests ok | TTFA p50 (p90) ms | RTF p50 |")
    a, b = ([cell.strip() for cell in line.strip("|").split("|")] for line in table[2:])
    # TTFA in ms, RTF, the Talker's steps, its pace past the text ((last frame - text read) / 272), the Thinker's
    # steps, the vocoder's busy share and tail (last audio - last frame), the client's mean last chunk
    assert a == ["a", "63/64", "230 (319)", "0.119", "5.6 / 6.4 / 12.1", "6.47", "13.0 (13.9)", "20%, 28", "3799"]
    assert b[:6] == ["b", "63/64", "230 (319)", "0.116", "5.6 / 6.4 / 7.7", "6.10"]


def test_a_run_without_that_level_shows_dashes(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(_result(0.058, 4.4, 1848.0, concurrency=1)))
    assert main([f"one={path}", "--concurrency", "32"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.startswith("| one | –") and line.count("–") == 8
