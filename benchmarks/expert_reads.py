"""How many distinct experts the Thinker's and Talker's decode steps really read with random weights, and the
bandwidth floor that gives.

`omni_ray/floors.py` counts the experts a batch reads as if its rows were routed independently (about 112 of the
Thinker's 128 at 32 rows). This benchmark runs a stage's decode steps eagerly, hooks every MoE router, and counts
the experts each layer's step picks, in two workloads:
- one prompt per row, as the engine benchmark's rows and the service benchmark's default prompts;
- one prompt for every row, each row sampled with its own seed
  (`e2e_serve --prompt-file benchmarks/prompt_100_tokens.txt`).

The floor at the measured count is the bound a step can reach with these weights.
`benchmarks/e2e_serve.py --expert-reads` reads the measured shares from its results file (`LATEST`) into
`omni_ray.floors.rtf_floor`. Rerun it when the routers, the workload or the floors' model change.

    python -m benchmarks.expert_reads --batches 1,8,32 --steps 32 --out DIR   # one H100 or H200 (full size)
    python -m benchmarks.expert_reads --config CONFIG --device cpu --dtype float32 --out DIR  # a config on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DTYPES, FULL_CONFIG, SERVED_THINKER, _talker_seqs, benchmark_prompt_ids, run_meta, write_results
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.floors import floor_ms
from omni_ray.layers.moe import Router
from omni_ray.models.qwen3_omni.orchestrator import DEFAULT_TALKER_SAMPLING
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

WORKLOADS = ("a prompt per row", "one prompt, a seed per row")
LATEST = Path(__file__).resolve().parent / "results" / "expert_reads" / "2026-12-04_h200_a72599d.json"  # both stages


def measured_shares(path: Path, workload: str) -> dict[int, dict[str, float]]:
    """From this probe's results file: for each batch it measured, each stage's share of its experts a decode step
    read in `workload` (the mean distinct count over the experts), as `floors.rtf_floor` takes them."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: one of {WORKLOADS}")
    shares: dict[int, dict[str, float]] = {}
    for row in json.loads(Path(path).read_text())["rows"]:
        if row["workload"] == workload:
            shares.setdefault(int(row["batch"]), {})[row["stage"]] = row["distinct_mean"] / row["experts"]
    return shares


class ExpertTally:
    """Forward hooks on every router of a model: while `counting`, each router call's distinct expert ids (a decode
    step's rows, all of them) are counted, per layer in call order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counting = False
        self.counts: list[list[int]] = [[] for _ in self.routers]
        for index, router in enumerate(self.routers):
            router.register_forward_hook(lambda _m, _i, out, index=index: self._count(index, out))

    def _count(self, index: int, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.counting:
            self.counts[index].append(int(torch.unique(out[1]).numel()))

    def take(self) -> list[int]:
        """Every counted (layer, step), then cleared."""
        counts = [c for per_layer in self.counts for c in per_layer]
        self.counts = [[] for _ in self.routers]
        return counts


def count_experts(runner: Any, tally: ExpertTally, seqs: list[Any], steps: int) -> list[int]:
    """Distinct experts per (layer, decode step) over `steps` decode steps of `seqs` after their prefill."""
    for seq in seqs:
        runner.admit(seq)
    runner.step(seqs)  # prefill, not counted
    tally.counting = True
    for _ in range(steps):
        runner.step(seqs)
    tally.counting = False
    for seq in seqs:
        runner.release(seq)
    return tally.take()


def thinker_rows(config: Any, batch: int, prompt: int, steps: int, workload: str) -> list[ThinkerSequence]:
    one_prompt = workload == WORKLOADS[1]
    return [ThinkerSequence(f"e{i}", benchmark_prompt_ids(config, prompt, 0 if one_prompt else i),
                            SERVED_THINKER.model_copy(update={"seed": i}), steps + 2, frozenset(), ignore_eos=True)
            for i in range(batch)]


def talker_rows(config: Any, batch: int, prompt: int, steps: int, workload: str, device: str,
                dtype: torch.dtype) -> list[TalkerSequence]:
    """Talker requests fed as `omni_ray.bench` feeds them (random Thinker states, a prompt's and reply's worth per
    row), sampled as served with a seed per row; one prompt: every row gets the first row's Thinker states."""
    seqs = _talker_seqs(config, batch, prompt, steps, DEFAULT_TALKER_SAMPLING, device, dtype)
    for i, seq in enumerate(seqs):
        seq.sampling = DEFAULT_TALKER_SAMPLING.model_copy(update={"seed": i})
        if workload == WORKLOADS[1]:
            seq.prefix, seq.text_embeds = seqs[0].prefix, seqs[0].text_embeds
    return seqs


def stage_runner(config: Any, stage: str, device: str, dtype: torch.dtype, rows: int, positions: int) -> Any:
    """The stage's runner, eager (no graphs, no MoE kernels: every router runs as a module the tally hooks)."""
    if stage == "thinker":
        text = config.thinker_config.text_config
        cache = SlotKVCache(text.num_hidden_layers, rows, positions, text.num_key_value_heads, text.head_dim, dtype,
                            device)
        return ThinkerRunner(load_thinker(None, config, device, dtype), config, cache, cuda_graphs=False,
                             moe_kernels=False, moe_layer_kernels=False)
    text = config.talker_config.text_config
    cache = SlotKVCache(text.num_hidden_layers, rows, positions, text.num_key_value_heads, text.head_dim, dtype, device)
    return TalkerRunner(load_talker(None, config, device, dtype), config, cache, rows, cuda_graphs=False,
                        moe_kernels=False, moe_layer_kernels=False)


def measure(config: Any, device: str, dtype: torch.dtype, stages: list[str], batches: list[int], prompt: int,
            steps: int) -> list[dict[str, Any]]:
    rows = []
    for stage in stages:
        runner = stage_runner(config, stage, device, dtype, max(batches), prompt + 2 * steps + 24)
        tally = ExpertTally(runner.model)
        experts = int(tally.routers[0].weight.shape[0])
        for workload in WORKLOADS:
            for batch in batches:
                seqs = (thinker_rows(config, batch, prompt, steps, workload) if stage == "thinker"
                        else talker_rows(config, batch, prompt, steps, workload, device, dtype))
                counts = count_experts(runner, tally, seqs, steps)
                share = statistics.mean(counts) / experts
                rows.append({"stage": stage, "workload": workload, "batch": batch, "experts": experts,
                             "distinct_mean": statistics.mean(counts), "distinct_min": min(counts),
                             "distinct_max": max(counts), "steps": steps, "layers": len(tally.routers),
                             "floor_ms_independent": floor_ms(config, stage, batch),
                             "floor_ms_measured": floor_ms(config, stage, batch, expert_share=share)})
                print(rows[-1], flush=True)
        del runner, tally
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Experts a decode step reads, random weights ({meta['device']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, dtype {meta['dtype']}, a {meta['prompt']}-token "
             f"prompt, {meta['steps']} decode steps counted after the prefill, each row sampled with its own seed: the "
             "Thinker at temperature 0.7 (the load test's), the Talker as served, fed random Thinker states as the "
             "engine benchmark feeds it (one prompt: the same states for every row)", "",
             "Distinct experts: per MoE layer and decode step, the experts any of the batch's rows picked (mean, min, "
             "max over every layer and step). Floors (4.3 TB/s): with `floors.py`'s count for independently routed "
             "rows, and with the measured mean.", "",
             "| stage | workload | batch | distinct experts: mean (min-max) of all | floor, independent routing (ms) | "
             "floor, measured routing (ms) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stage']} | {r['workload']} | {r['batch']} | {r['distinct_mean']:.1f} ({r['distinct_min']}-"
                     f"{r['distinct_max']}) of {r['experts']} | {r['floor_ms_independent']:.2f} | "
                     f"{r['floor_ms_measured']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(FULL_CONFIG), help="a Qwen3-Omni config.json (default: the full 30B)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--stages", default="thinker,talker")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=32, help="decode steps counted per batch")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default="expert_reads")
    a = ap.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(a.config)
    batches = [int(b) for b in a.batches.split(",")]
    with torch.inference_mode():
        rows = measure(config, a.device, DTYPES[a.dtype], a.stages.split(","), batches, a.prompt, a.steps)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    meta = run_meta("benchmarks.expert_reads", argv, device=device, dtype=a.dtype, prompt=a.prompt, steps=a.steps)
    write_results(Path(a.out), a.stem, {**meta, "rows": rows}, markdown(meta, rows))


if __name__ == "__main__":
    main()
