"""The served decode kernels at full size (random bf16 weights), each step run once inside a CUDA profiler range so
that Nsight Compute reads its hardware counters. Steps, per row count: a code-predictor pass (five kernels a layer),
the same pass and its head as the persistent kernel (`persistent_pass`; `persistent_pass_draw` also draws the codes
in the same launch), and one eight-kernel MoE layer of the Talker and of the Thinker. The steps' names are printed
between ncu's own lines, in launch order. Use it to see why a kernel is slow: memory throughput, occupancy, warp
stalls, per source line.

    ncu --clock-control none --profile-from-start off --cache-control all --section WarpStateStats \
        --export DIR/counters python -m benchmarks.kernel_counters [--rows 1,32] \
        [--stages code_predictor,talker,thinker,persistent_pass,persistent_pass_draw]

One H100 or H200 with Nsight Compute. The suite's `ncu` step (`benchmarks/gpu_suite.sh ncu`) collects more sections
and prints them, and per source line."""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from transformers import Qwen3OmniMoeConfig

from benchmarks.moe_layer_bench import KEYS, Step as LayerInputs, stage_stack, step_inputs
from benchmarks.small_batch_bench import code_predictor_with_head, decode_step_inputs
from omni_ray.bench import FULL_CONFIG
from omni_ray.layers import small_batch_moe
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.layers.persistent_pass import CodeDraw, PersistentPass

Step = Callable[[], object]


def served_draw(cfg: Any, rows: int) -> CodeDraw:
    """The Talker's served code-predictor draw for `rows` rows (top-k 50 / top-p 0.8 at temperature 0.9, cap 64),
    random noise keys, code embeddings and feedback."""
    def full(value: float) -> torch.Tensor:
        return torch.full((rows,), value, device="cuda")

    keys = torch.randint(0, 2**32, (rows, 2), dtype=torch.long, device="cuda")
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    feedback = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    return CodeDraw(full(0.9), full(50).long(), full(0.8), keys, 0, 64, table, feedback)


def code_predictor_passes(config: Qwen3OmniMoeConfig, rows: list[int]) -> list[tuple[str, Step]]:
    """One pass of the code predictor's layers (one new token per row over a 17-position cache), per row count."""
    cfg = config.talker_config.code_predictor_config
    torch.manual_seed(0)
    stack = DecoderStack(DecoderSpec.from_hf(cfg)).cuda().to(torch.bfloat16)
    assert stack.use_small_batch_kernels()
    steps: list[tuple[str, Step]] = []
    for count in rows:
        cache, batch, x, rope = decode_step_inputs(cfg, stack, count, len(stack.layers))
        steps.append((f"code predictor pass, {count} rows",
                      lambda cache=cache, batch=batch, x=x, rope=rope: stack(x, None, cache.layers, batch, rope=rope,
                                                                             normed=False)))
    return steps


def persistent_passes(config: Qwen3OmniMoeConfig, rows: list[int], draws: bool) -> list[tuple[str, Step]]:
    """The code predictor's pass and its head as one persistent kernel, per row count; `draws`: the same launch
    drawing the served codes too (`engine.persistent_code_predictor_draws`)."""
    cfg = config.talker_config.code_predictor_config
    stack, head = code_predictor_with_head(cfg)
    kernel = PersistentPass(stack, draws=draws)
    kernel.build(cfg.vocab_size)
    steps: list[tuple[str, Step]] = []
    for count in rows:
        cache, batch, x, (cos, sin) = decode_step_inputs(cfg, stack, count, len(stack.layers))
        if draws:
            draw = served_draw(cfg, count)
            steps.append((f"persistent pass + head + draw, {count} rows",
                          lambda cache=cache, batch=batch, x=x, cos=cos, sin=sin, draw=draw: kernel.draw(
                              x, cache.layers, batch, cos, sin, head, draw)))
            continue
        steps.append((f"persistent pass + head, {count} rows",
                      lambda cache=cache, batch=batch, x=x, cos=cos, sin=sin: kernel.logits(
                          x, cache.layers, batch, cos, sin, head)))
    return steps


def moe_layer_steps(config: Qwen3OmniMoeConfig, stage: str, rows: list[int]) -> list[tuple[str, Step]]:
    """One MoE layer's decode step of the stage (random routers, keys in the speech workload's range), per row count."""
    stack = stage_stack(config, stage)
    layer = stack.layers[0]
    steps: list[tuple[str, Step]] = []
    for count in rows:
        step = step_inputs(stack, count, KEYS[stage])

        def run(step: LayerInputs = step) -> object:
            arrivals = small_batch_moe.new_arrivals(step.x, 1, stack.spec.num_kv_heads)
            return small_batch_moe.decoder_layer(layer, step.x, step.cos, step.sin, step.cache.layers[0], step.batch,
                                                 None, arrivals[0])

        steps.append((f"{stage} MoE layer, {count} rows", run))
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--stages", default="code_predictor,talker,thinker")
    args = parser.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    rows = [int(r) for r in args.rows.split(",")]
    steps: list[tuple[str, Step]] = []
    for stage in args.stages.split(","):
        if stage == "code_predictor":
            steps += code_predictor_passes(config, rows)
        elif stage in ("persistent_pass", "persistent_pass_draw"):
            steps += persistent_passes(config, rows, draws=stage == "persistent_pass_draw")
        else:
            steps += moe_layer_steps(config, stage, rows)
    with torch.no_grad():
        for _, step in steps:  # compiled and warm before any range
            step()
            step()
        torch.cuda.synchronize()
        for name, step in steps:
            print(f"== step: {name}", flush=True)
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
