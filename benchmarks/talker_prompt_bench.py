"""What building the Talker's prefill prompts costs the host in the step that speaks a burst's first frames: the
torch ops (each a kernel launch on a GPU) and the time of one batch of prompts at a few request counts, each
request with a 100-position user turn from the Thinker (random states, the embedded default's widths, random
weights: the ops do not depend on the values).

    python -m benchmarks.talker_prompt_bench --requests 1,8,32 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from benchmarks.op_counts import count_ops, ops_cell
from omni_ray.bench import _talker_seqs, run_meta, write_results
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.models.qwen3_omni.checkpoint import ensure_default_checkpoint
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker

USER_POSITIONS = 100


def build_prompts(runner: TalkerRunner, seqs: list[TalkerSequence]) -> list[torch.Tensor]:
    if hasattr(runner, "_prompts"):
        return runner._prompts(seqs)
    return [runner._prompt(seq) for seq in seqs]  # a tree from before the batched prompts, for the same measurement


def measure(config: Any, requests: int, repeats: int) -> dict[str, Any]:
    text = config.talker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, requests, 256, text.num_key_value_heads, text.head_dim, torch.float32,
                        "cpu")
    runner = TalkerRunner(load_talker(None, config, "cpu", torch.float32), config, cache, requests)
    seqs = _talker_seqs(config, requests, USER_POSITIONS, steps=1)
    with torch.inference_mode():
        build_prompts(runner, seqs)
        ops = count_ops(lambda: build_prompts(runner, seqs))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            build_prompts(runner, seqs)
            times.append((time.perf_counter() - start) * 1e3)
    return {"requests": requests, "ops": ops, "total_ops": sum(ops.values()), "prompts_ms_p50": statistics.median(times)}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Building the Talker's prefill prompts (CPU, the embedded default's widths)", "",
             f"commit `{meta.get('commit', '')}`, command `{meta.get('command', '')}`", "",
             "| requests | torch ops | of which | prompts p50 (ms) |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['requests']} | {row['total_ops']} | {ops_cell(row['ops'])} | {row['prompts_ms_p50']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.talker_prompt_bench", description=__doc__)
    parser.add_argument("--requests", default="1,8,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="talker_prompt_bench")
    args = parser.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_pretrained(ensure_default_checkpoint())
    rows = [measure(config, int(count), args.repeats) for count in args.requests.split(",")]
    meta = run_meta("benchmarks.talker_prompt_bench", argv)
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, markdown(meta, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
