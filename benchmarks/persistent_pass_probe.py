"""Where the persistent code-predictor pass (`omni_ray/layers/persistent_pass.py`) spends its time, by difference: the
pass and its head replayed from a CUDA graph with plain reads (as `persistent_code_predictor_l2_keep_percent: 0`
serves it; the default, 10%, is "L2 keeps 10%" here), and built with one part left out each (the attention phases,
the GEMMs' products and epilogues, the weights' copies into shared memory, the waits for those copies; with the first
three out, what is left is the grid barriers and the rest) or the weights copied another way (16-byte cp.async copies
by every thread instead of bulk copies) or the activations loaded in bigger batches (more chunk-tiles in flight;
their logits are checked equal to the plain build's), or with every row's activations read from row 0 (the GEMMs' L2
reads of x without the row count), or a share of the weights kept in L2 from pass to pass (evict_last), at a few row
counts. Besides the pass alone, each build's pass in a frame: 15 passes back to back after a read of 400 MB (as a
Talker step's MoE layers stream their experts between frames), less that read alone; with L2 builds, the plain and
those builds in a frame again with L2 set aside for kept lines (the device's most). Also the plain build followed
by the Triton draw kernel (`top_k_draw_and_embed`), against the same pass drawing in its own launch (`draw`); and a
frame's 15 passes in one launch (`PASSES_IN_LAUNCH`; per pass, not drawing and drawing, each pass after the first
reading the codes the one before drew) against the served forms' 15 launches each followed by the Triton draw, or
each drawing in its launch: what the launches' gaps, their first weight copies and the draw kernels cost a frame.
Full-size Qwen3-Omni-30B code predictor, random bf16 weights."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from transformers import Qwen3OmniMoeConfig

from benchmarks.draw_bench import replay_ms
from benchmarks.small_batch_bench import code_predictor_with_head, decode_step_inputs
from omni_ray.bench import FULL_CONFIG, run_meta, write_results
from omni_ray.engine.sampler import CounterNoise, SamplingBatch
from omni_ray.engine.top_k_draw import top_k_draw_and_embed
from omni_ray.layers.persistent_pass import CodeDraw, PersistentPass, set_aside_l2

VARIANTS: dict[str, dict[str, int]] = {
    "plain reads": {},
    # the plain build launched as a plain grid, not a cooperative one (the served launch); the define is unused
    "non-cooperative launch": {"NONCOOPERATIVE_LAUNCH": 1},
    "no attention": {"SKIP_ATTENTION": 1},
    "no GEMM products": {"SKIP_GEMMS": 1},
    "no weight copies": {"SKIP_WEIGHTS": 1},
    "no waiting for the copies": {"NO_WAIT": 1},
    "cp.async copies": {"CP_ASYNC_COPIES": 1},
    "barriers only": {"SKIP_ATTENTION": 1, "SKIP_GEMMS": 1, "SKIP_WEIGHTS": 1},
    # the activations' loads a warp issues together, as 16-row tiles x 32-deep chunks (plain build: 4)
    "8 chunk-tiles in flight": {"CHUNK_TILES_IN_FLIGHT": 8},
    "16 chunk-tiles in flight": {"CHUNK_TILES_IN_FLIGHT": 16},
    "32 chunk-tiles in flight": {"CHUNK_TILES_IN_FLIGHT": 32},
    # every row's activations read from row 0: the GEMMs' reads of x from L2 cut by the row count (wrong products)
    "activations as one row": {"ONE_ROW_LOADS": 1},
    # that share of the weights' lines asked of L2 as evict_last (the rest evict_first)
    "L2 keeps 5%": {"L2_KEEP_PERCENT": 5},
    "L2 keeps 10%": {"L2_KEEP_PERCENT": 10},
    "L2 keeps 20%": {"L2_KEEP_PERCENT": 20},
    "L2 keeps 30%": {"L2_KEEP_PERCENT": 30},
    "L2 keeps none": {"L2_EVICT_FIRST": 1},  # every weight line evict_first
    # the pass drawing in its launch, its draw phase ended early (timed drawing; `persistent_pass_draw.cuh`)
    "draw stops after loads": {"DRAW_STOP_AFTER": 1},
    "draw stops after select": {"DRAW_STOP_AFTER": 2},
    "draw stops after ranking": {"DRAW_STOP_AFTER": 3},
    "draw stops after sampling": {"DRAW_STOP_AFTER": 4},
    # a frame's passes in one launch, each after the last (the next q/k/v share asked for during the draw): per pass
    "15 passes in one launch": {"PASSES_IN_LAUNCH": 15},
    "15 passes in one launch keeping 10% in L2": {"PASSES_IN_LAUNCH": 15, "L2_KEEP_PERCENT": 10},
}
# variants that only reorder loads, hint the cache or repeat the pass (not drawing, over the same inputs) in one
# launch: their logits must equal the plain build's, bit for bit
SAME_AS_PLAIN = [name for name, defines in VARIANTS.items()
                  if defines and set(defines) <= {"CHUNK_TILES_IN_FLIGHT", "L2_KEEP_PERCENT", "L2_EVICT_FIRST",
                                                  "PASSES_IN_LAUNCH", "NONCOOPERATIVE_LAUNCH"}]
FRAME_PASSES = 15  # a frame's code-predictor passes
BETWEEN_FRAMES_BYTES = 400 << 20  # 8x L2: a Talker step's MoE layers read 0.6-5 GB between frames


def variant_key(name: str) -> str:
    """A build's name as `--variants` takes it: lower case, underscores for spaces (no quoting in a shell word)."""
    return name.lower().replace(" ", "_")


def served_draw(cfg: Any, rows: int) -> CodeDraw:
    """The Talker's served code-predictor draw for `rows` rows (top-k 50 / top-p 0.8 at temperature 0.9, cap 64),
    random noise keys, code embeddings and feedback."""
    def full(value: float) -> torch.Tensor:
        return torch.full((rows,), value, device="cuda")

    keys = torch.randint(0, 2**32, (rows, 2), dtype=torch.long, device="cuda")
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    feedback = torch.randn(rows, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    return CodeDraw(full(0.9), full(50).long(), full(0.8), keys, 0, 64, table, feedback)


def probe(rows: list[int], variants: list[str]) -> list[dict[str, Any]]:
    cfg = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG).talker_config.code_predictor_config
    stack, head = code_predictor_with_head(cfg)
    kernels = {}
    between = torch.empty(BETWEEN_FRAMES_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    read_alone_us = 1000 * replay_ms(lambda: between.sum(dtype=torch.float32))[0]
    for name in variants:
        defines = VARIANTS[name]
        kernel = PersistentPass(stack, draws=True,  # `draw` times the draw phase too
                                cooperative="NONCOOPERATIVE_LAUNCH" not in defines)
        kernel.build(cfg.vocab_size, defines)
        kernels[name] = kernel
    plain = kernels["plain reads"]
    keeping = any("L2_KEEP_PERCENT" in VARIANTS[name] for name in variants)
    print("clusters of the plain build resident at once:",
          {size: plain.max_active_clusters(size) for size in (1, 2, 4, 8)}, flush=True)
    kernels_stack = copy.deepcopy(stack)
    kernels_stack.use_small_batch_kernels()
    out = []
    for count in rows:
        cache, batch, x, (cos, sin) = decode_step_inputs(cfg, stack, count, len(stack.layers))
        row: dict[str, Any] = {"rows": count, "Triton kernels": 1000 * replay_ms(
            lambda: kernels_stack.last_logits(x, cache.layers, batch, (cos, sin), head))[0]}
        draw = served_draw(cfg, count)
        params = SamplingBatch(draw.temperature, draw.top_k, draw.top_p, torch.ones_like(draw.top_p))

        def triton_draw(logits: torch.Tensor) -> torch.Tensor:
            """The served draw after a pass: `top_k_draw_and_embed`'s codes from `logits`."""
            return top_k_draw_and_embed(logits, params, CounterNoise(draw.noise_keys), draw.cap, draw.table,
                                        draw.feedback)[0]

        def frame(kernel: PersistentPass, drawing: str = "") -> torch.Tensor:
            """A frame's passes after the read between frames: `kernel`'s launches, each drawing in its launch
            (drawing="in launch") or followed by the Triton draw (drawing="after"), or not drawing."""
            between.sum(dtype=torch.float32)
            for _ in range(FRAME_PASSES // kernel.passes_in_launch):
                if drawing == "in launch":
                    out = kernel.draw(x, cache.layers, batch, cos, sin, head, draw)[0]
                else:
                    out = kernel.logits(x, cache.layers, batch, cos, sin, head)
                    if drawing == "after":
                        out = triton_draw(out)
            return out

        def per_pass_in_a_frame(kernel: PersistentPass, drawing: str = "") -> float:
            return (1000 * replay_ms(lambda: frame(kernel, drawing))[0] - read_alone_us) / FRAME_PASSES

        for name, kernel in kernels.items():
            if any(define.startswith("DRAW_") for define in VARIANTS[name]):
                row[name] = 1000 * replay_ms(
                    lambda kernel=kernel: kernel.draw(x, cache.layers, batch, cos, sin, head, draw)[0])[0]
                continue
            passes = kernel.passes_in_launch  # a launch's passes: the times below are per pass
            row[name] = 1000 * replay_ms(
                lambda kernel=kernel: kernel.logits(x, cache.layers, batch, cos, sin, head))[0] / passes
            row[f"{name}, in a frame"] = per_pass_in_a_frame(kernel)
            if passes > 1:  # drawing too: a later pass reads the codes the pass before drew
                row[f"{name}, drawing"] = 1000 * replay_ms(
                    lambda kernel=kernel: kernel.draw(x, cache.layers, batch, cos, sin, head, draw)[0])[0] / passes
                row[f"{name}, drawing, in a frame"] = per_pass_in_a_frame(kernel, "in launch")
            elif name in ("plain reads", "L2 keeps 10%"):  # the served forms, to set a frame in one launch against
                row[f"{name}, then the Triton draw, in a frame"] = per_pass_in_a_frame(kernel, "after")
                row[f"{name}, drawing in its launch, in a frame"] = per_pass_in_a_frame(kernel, "in launch")
            if keeping and (name == "plain reads" or "L2_KEEP_PERCENT" in VARIANTS[name]):
                set_aside_l2(x.device, 1 << 30)  # as much as the device sets aside (the limit is zero unless set)
                row[f"{name}, in a frame, L2 set aside"] = per_pass_in_a_frame(kernel)
                set_aside_l2(x.device, 0)
        # the served draw: the Triton kernel after the pass, or the pass's own draw phase
        row["plain reads, then the Triton draw"] = 1000 * replay_ms(
            lambda: triton_draw(plain.logits(x, cache.layers, batch, cos, sin, head)))[0]
        row["plain reads, drawing in its launch"] = 1000 * replay_ms(
            lambda: plain.draw(x, cache.layers, batch, cos, sin, head, draw)[0])[0]
        plain_logits = plain.logits(x, cache.layers, batch, cos, sin, head)
        row["max difference from plain reads"] = {
            name: (kernels[name].logits(x, cache.layers, batch, cos, sin, head).float() - plain_logits.float())
            .abs().max().item() for name in SAME_AS_PLAIN if name in kernels}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--variants", default=",".join(map(variant_key, VARIANTS)),
                        help="the builds timed, comma-separated, each named in lower case with underscores for "
                        "spaces (l2_keeps_20%%; 'plain reads' always)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    by_key = {variant_key(name): name for name in VARIANTS}
    asked = [key.strip() for key in args.variants.split(",") if key.strip()]
    unknown = [key for key in asked if key not in by_key]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(by_key)}")
    variants = list(dict.fromkeys(["plain reads", *(by_key[key] for key in asked)]))
    rows = probe([int(r) for r in args.rows.split(",")], variants)
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.persistent_pass_probe", argv, gpu=gpu)
    names = list(dict.fromkeys(name for row in rows for name in row if name not in ("rows", "max difference from plain reads")))
    lines = [f"# The persistent code-predictor pass by difference, us per pass + head replayed from a CUDA graph: {gpu}, "
             f"{meta['date']}, commit {meta['commit']}", f"# command: {meta['command']}", "",
             "| rows | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {r['rows']} | " + " | ".join(f"{r[n]:.1f}" if n in r else "–" for n in names) + " |" for r in rows]
    lines += ["", "Largest logit difference from the plain build (must be 0: those builds only reorder loads or repeat "
              "the pass):"]
    lines += [f"- {r['rows']} rows: {r['max difference from plain reads']}" for r in rows]
    write_results(args.out, "persistent_pass_probe", {"meta": meta, "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
