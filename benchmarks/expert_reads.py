"""How many distinct experts the Thinker's decode steps really read with random weights, and the floor that gives.

`floors.py` counts the experts a batch reads as if its rows were routed independently (about 112 of 128 at 32 rows).
This probe runs the Thinker's decode steps eagerly, hooks every MoE router, and counts the experts each layer's step
picks, in two workloads: one prompt per row (as the engine benchmark's rows) and one prompt for every row, each row
sampled with its own seed (as the service benchmark's load test sends workload W). The floor at the measured count is
the bound a step can reach with these weights.

    python -m benchmarks.expert_reads --batches 1,8,32 --steps 32 --out results/
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DTYPES, FULL_CONFIG, SERVED_THINKER, benchmark_prompt_ids, run_meta, write_results
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.floors import floor_ms
from omni_ray.layers.moe import Router
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

WORKLOADS = ("a prompt per row", "one prompt, a seed per row")


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


def count_thinker_experts(
    runner: ThinkerRunner, tally: ExpertTally, config: Any, batch: int, prompt: int, steps: int, workload: str,
) -> list[int]:
    """Distinct experts per (layer, decode step) over `steps` decode steps of `batch` rows after their prefill."""
    one_prompt = workload == WORKLOADS[1]
    seqs = [ThinkerSequence(f"e{i}", benchmark_prompt_ids(config, prompt, 0 if one_prompt else i),
                            SERVED_THINKER.model_copy(update={"seed": i}), steps + 2, frozenset(), ignore_eos=True)
            for i in range(batch)]
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


def measure(config: Any, device: str, dtype: torch.dtype, batches: list[int], prompt: int, steps: int) -> list[dict[str, Any]]:
    text = config.thinker_config.text_config
    model = load_thinker(None, config, device, dtype)
    cache = SlotKVCache(text.num_hidden_layers, max(batches), prompt + steps + 8, text.num_key_value_heads,
                        text.head_dim, dtype, device)
    runner = ThinkerRunner(model, config, cache, cuda_graphs=False, moe_kernels=False, moe_layer_kernels=False)
    tally = ExpertTally(model)
    experts = int(text.num_experts)
    rows = []
    for workload in WORKLOADS:
        for batch in batches:
            counts = count_thinker_experts(runner, tally, config, batch, prompt, steps, workload)
            share = statistics.mean(counts) / experts
            rows.append({"workload": workload, "batch": batch, "experts": experts,
                         "distinct_mean": statistics.mean(counts), "distinct_min": min(counts),
                         "distinct_max": max(counts), "steps": steps, "layers": len(tally.routers),
                         "floor_ms_independent": floor_ms(config, "thinker", batch),
                         "floor_ms_measured": floor_ms(config, "thinker", batch, expert_share=share)})
            print(rows[-1], flush=True)
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Experts a Thinker decode step reads, random weights ({meta['device']}, {meta['date']})", "",
             f"commit `{meta['commit']}`, command `{meta['command']}`, dtype {meta['dtype']}, a {meta['prompt']}-token "
             f"prompt, {meta['steps']} decode steps counted after the prefill, each row sampled at temperature 0.7 "
             "with its own seed (the load test's)", "",
             "Distinct experts: per MoE layer and decode step, the experts any of the batch's rows picked (mean, min, "
             "max over every layer and step). Floors (4.3 TB/s): with `floors.py`'s count for independently routed "
             "rows, and with the measured mean.", "",
             f"| workload | batch | distinct experts of {rows[0]['experts']}: mean (min-max) | floor, independent routing (ms) | "
             "floor, measured routing (ms) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['batch']} | {r['distinct_mean']:.1f} ({r['distinct_min']}-{r['distinct_max']})"
                     f" | {r['floor_ms_independent']:.2f} | {r['floor_ms_measured']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(FULL_CONFIG), help="a Qwen3-Omni config.json (default: the full 30B)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=32, help="decode steps counted per batch")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default="expert_reads")
    a = ap.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(a.config)
    batches = [int(b) for b in a.batches.split(",")]
    with torch.inference_mode():
        rows = measure(config, a.device, DTYPES[a.dtype], batches, a.prompt, a.steps)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    meta = run_meta("benchmarks.expert_reads", argv, device=device, dtype=a.dtype, prompt=a.prompt, steps=a.steps)
    write_results(Path(a.out), a.stem, {**meta, "rows": rows}, markdown(meta, rows))


if __name__ == "__main__":
    main()
