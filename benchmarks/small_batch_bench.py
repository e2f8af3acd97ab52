"""The small-batch decode kernels on a GPU, each replayed from a CUDA graph, at full-size Qwen3-Omni-30B shapes (bf16,
random weights). Covers the code predictor's kernels (`layers/small_batch.py`): each GEMM of a layer under several
launch configs against cuBLAS, a whole layer as five kernels against the same layer eager and compiled by inductor,
a whole pass, and the attention kernel's warps. Also covers the MoE expert kernels (`layers/moe_kernels.py`) against
grouped GEMMs, and each expert GEMM's launch configs. Use it when tuning those kernels or their launch configs;
`--sections` picks the parts, `--gemm-stages thinker,talker` sweeps those stages' attention projections and routers.

    python -m benchmarks.small_batch_bench --out DIR [--rows 1,8,32,64] [--sections layers,stack,gemms,attention,moe]

One H100 or H200 (Triton's kernels are tuned for sm_90)."""

from __future__ import annotations

import argparse
import copy
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import FULL_CONFIG, run_meta, write_results
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.floors import H200_BANDWIDTH
from omni_ray.layers import moe_kernels, small_batch
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.layers.moe import ROUTER_ROWS_MULTIPLE, Experts
from omni_ray.layers.picked_experts import COMBINE_BLOCK_N

CONFIGS: list[small_batch.MatmulConfig] = [
    (16, 256, 3, 4, 1), (32, 256, 3, 4, 1), (16, 128, 4, 4, 1), (16, 256, 2, 4, 2), (32, 256, 2, 4, 2),
    (16, 256, 2, 4, 4), (16, 128, 3, 4, 4), (32, 128, 3, 4, 4), (16, 128, 2, 4, 8), (16, 256, 3, 8, 4),
    (16, 256, 3, 8, 1), (32, 256, 3, 8, 1), (16, 256, 4, 4, 1), (32, 256, 4, 4, 1), (16, 512, 2, 4, 1),
    (32, 512, 2, 8, 1), (16, 128, 3, 8, 4), (16, 256, 2, 8, 2), (16, 256, 3, 4, 2), (32, 256, 3, 4, 2),
    (16, 128, 3, 4, 2), (32, 128, 3, 4, 2), (64, 256, 3, 4, 1), (64, 128, 3, 4, 2), (32, 128, 3, 4, 8),
]
WEIGHT_BYTES_IN_FLIGHT = 256 * 2**20  # each GEMM cycles through copies of its weight: more than L2 (50 MB) holds


GemmShape = tuple[int, int, str, int]  # output width, depth, prologue/epilogue kind, partial sums of squares read


def replay_ms(run: Callable[[], torch.Tensor], replays: int = 200) -> tuple[float, torch.Tensor]:
    """The mean time (ms) of one replay of `run` captured as a CUDA graph, and a copy of its output: for timing a
    few kernels as the service replays them, without launch overhead."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, autotune and allocate outside the capture
            run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, out.clone()


def gemm_shapes(config: Any, stages: list[str]) -> dict[str, GemmShape]:
    """The served `rows_matmul` GEMMs of each stage's decode step, full size: the code predictor's five, and the
    Thinker's and the Talker's attention projections and router (their experts are `moe_gemm_rows`'). A norm-fused
    GEMM reads as many partial sums of squares as the kernel ahead of it leaves: 64-column blocks of the MoE
    combine before q/k/v, the o projection's column blocks before the router. A shape swept once is not swept
    again under another stage's name."""
    shapes: dict[str, GemmShape] = {}
    for stage in stages:
        if stage == "code_predictor":
            cfg = config.talker_config.code_predictor_config
            width, inner = cfg.hidden_size, cfg.intermediate_size
            shapes.update({"qkv (norm, own pass)": (4096, width, "norm", 0),
                           "qkv (norm, partial squares)": (4096, width, "norm", width // 16),
                           "o (residual, keeping squares)": (width, 2048, "residual", 0),
                           "gate_up (norm, partial squares, SiLU*up)": (inner, width, "gated", width // 16),
                           "down (residual, keeping squares)": (width, inner, "residual", 0),
                           "code head (final norm, own pass)": (2048, width, "norm", 0)})
            continue
        text = (config.thinker_config if stage == "thinker" else config.talker_config).text_config
        width, heads = text.hidden_size, text.num_attention_heads * text.head_dim
        qkv = heads + 2 * text.num_key_value_heads * text.head_dim
        o_blocks = -(-width // small_batch.matmul_config(width, heads)[0])
        router = text.num_experts  # with a shared expert, folded: its gate column, then zero rows to a multiple
        if getattr(text, "shared_expert_intermediate_size", 0):
            router = -(-(router + 1) // ROUTER_ROWS_MULTIPLE) * ROUTER_ROWS_MULTIPLE
        for name, shape in {f"{stage} qkv (norm, partial squares)": (qkv, width, "norm", width // COMBINE_BLOCK_N),
                            f"{stage} o (residual, keeping squares)": (width, heads, "residual", 0),
                            f"{stage} router (norm, partial squares)": (router, width, "norm", o_blocks)}.items():
            if not any(shape[:3] == seen[:3] for seen in shapes.values()):  # e.g. the Talker's o is the code
                shapes[name] = shape                                          # predictor's when both are swept
    return shapes


def gemm_rows(shapes: dict[str, GemmShape], rows: list[int]) -> list[dict[str, Any]]:
    """Each GEMM (its prologue and epilogue as served) at each row count: cuBLAS `F.linear` without them, and
    `rows_matmul` under each config (us per call). One graph replays a call per copy of the weight, one after the
    other, as a pass runs its layers: every call streams its weight from memory, not from L2, and the time between
    kernels is counted as it is in a pass."""
    out = []
    for name, (n, k, kind, parts) in shapes.items():
        size = (2 * n if kind == "gated" else n, k)
        copies = max(2, WEIGHT_BYTES_IN_FLIGHT // (2 * size[0] * size[1]))
        weights = [torch.randn(size, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        norm = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for count in rows:
            x = torch.randn(count, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(count, n, device="cuda", dtype=torch.bfloat16)
            squares = x.float().pow(2).reshape(count, parts, k // parts).sum(-1).T.contiguous() if parts else None
            row: dict[str, Any] = {"gemm": name, "rows": count, "default": list(small_batch.matmul_config(n, k)),
                                   "weight copies": copies, "floor": 1e6 * 2 * size[0] * size[1] / H200_BANDWIDTH}
            row["cuBLAS"] = 1000 * replay_ms(lambda: [F.linear(x, w) for w in weights][-1])[0] / copies
            for config in CONFIGS:
                def call(weight: torch.Tensor, config: small_batch.MatmulConfig = config) -> torch.Tensor:
                    if kind == "residual":
                        return small_batch.rows_matmul_keeping_squares(x, weight, residual, config)[0]
                    return small_batch.rows_matmul(x, weight, norm, gated=kind == "gated", config=config,
                                                   squares=squares)
                try:
                    row[str(list(config))] = 1000 * replay_ms(lambda: [call(w) for w in weights][-1], 50)[0] / copies
                except Exception as exc:  # e.g. more shared memory than the GPU has
                    row[str(list(config))] = None
                    print(f"{name} rows={count} {config}: {type(exc).__name__}")
            out.append(row)
    return out


ATTENTION_WARPS = (1, 2, 4, 8)


def attention_rows(cfg: Any, rows: list[int]) -> list[dict[str, Any]]:
    """`small_attention` for one new token per row over a 17-position cache, us per call, per num_warps."""
    stack = DecoderStack(DecoderSpec.from_hf(cfg)).cuda().to(torch.bfloat16)
    stack.fuse_projections()
    attn = stack.layers[0].self_attn
    out = []
    for count in rows:
        cache = SlotKVCache(1, 64, 17, cfg.num_key_value_heads, 128, torch.bfloat16, "cuda")
        slots = torch.arange(count, device="cuda")
        batch = AttentionBatch.from_tensors(slots, torch.full_like(slots, 5), 1, 17, rows_are_slots=True)
        qkv = torch.randn(count, attn.qkv.shape[0], device="cuda", dtype=torch.bfloat16)
        cos, sin = stack.rotary(torch.full((count, 1), 5, device="cuda"), torch.bfloat16)
        row: dict[str, Any] = {"rows": count}
        for warps in ATTENTION_WARPS:
            row[f"{warps} warps"] = 1000 * replay_ms(
                lambda warps=warps: small_batch.small_attention(qkv, attn, cos, sin, cache.layers[0], batch, count, warps))[0]
        out.append(row)
    return out


def code_predictor_with_head(cfg: Any) -> tuple[DecoderStack, torch.Tensor]:
    """The code predictor's layers (seed 0, bf16, projections fused) and a random code head [vocab, hidden], on the
    GPU: what the persistent pass's probes run."""
    torch.manual_seed(0)
    stack = DecoderStack(DecoderSpec.from_hf(cfg)).cuda().to(torch.bfloat16)
    stack.fuse_projections()
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.03
    return stack, head


def decode_step_inputs(
    cfg: Any, stack: DecoderStack, count: int, layers: int
) -> tuple[SlotKVCache, AttentionBatch, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One new token per row for `count` rows at position 5 of a 17-position cache of `layers` layers: the cache, the
    batch (its grouped mask built), random bf16 inputs [count, 1, hidden] and their rotary (cos, sin)."""
    cache = SlotKVCache(layers, 64, 17, cfg.num_key_value_heads, 128, torch.bfloat16, "cuda")
    slots = torch.arange(count, device="cuda")
    batch = AttentionBatch.from_tensors(slots, torch.full_like(slots, 5), 1, 17, rows_are_slots=True)
    batch.grouped_mask(cfg.num_attention_heads // cfg.num_key_value_heads)
    x = torch.randn(count, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    return cache, batch, x, stack.rotary(torch.full((count, 1), 5, device="cuda"), torch.bfloat16)


def layer_rows(cfg: Any, rows: list[int]) -> list[dict[str, Any]]:
    """One code-predictor layer step (one new token per row over a 17-position cache), us per call: eager, compiled
    by inductor as `compile_layers` does, and as five kernels (a pass's first layer, whose input norm sums the rows'
    squares itself, and a later one, which reads the previous layer's partial sums)."""
    torch.manual_seed(0)
    eager = DecoderStack(DecoderSpec.from_hf(cfg)).cuda().to(torch.bfloat16)
    eager.fuse_projections()
    compiled, kernels = copy.deepcopy(eager), copy.deepcopy(eager)
    compiled.compile_layers()
    kernels.use_small_batch_kernels()
    out = []
    for count in rows:
        cache, batch, x, (cos, sin) = decode_step_inputs(cfg, eager, count, 1)
        row: dict[str, Any] = {"rows": count}
        fused = kernels.layers[0]
        squares = small_batch.decoder_layer(fused, x, cos, sin, cache.layers[0], batch)[1]  # of another layer's output
        stacks: dict[str, Callable[..., torch.Tensor]] = {
            "eager": eager.layers[0], "inductor": compiled.layers[0],
            "five kernels, first layer": lambda *a: small_batch.decoder_layer(fused, *a)[0],
            "five kernels, later layer": lambda *a: small_batch.decoder_layer(fused, *a, squares)[0],
        }
        for name, layer in stacks.items():
            row[name] = 1000 * replay_ms(lambda layer=layer: layer(x, cos, sin, cache.layers[0], batch))[0]
        out.append(row)
    return out


def stack_rows(cfg: Any, rows: list[int]) -> list[dict[str, Any]]:
    """One code-predictor pass (all its layers, one new token per row over a 17-position cache) as five kernels a
    layer, us per call; with the final norm and a code head (2,048 rows) as `small_batch`'s kernels and as one
    persistent kernel (`persistent_pass`), and how far the persistent logits lie from the kernels'. The layers'
    weights (about 150 MB) do not fit in L2: each replay streams them from memory."""
    torch.manual_seed(0)
    stack = DecoderStack(DecoderSpec.from_hf(cfg)).cuda().to(torch.bfloat16)
    persistent = copy.deepcopy(stack)
    stack.use_small_batch_kernels()
    persistent_failure = None
    try:
        persistent.use_small_batch_kernels()
        if not persistent.use_persistent_pass(cfg.vocab_size):
            persistent_failure = "the persistent pass does not take this stack"
    except Exception as exc:  # reported in the table, not lost with the rest
        persistent_failure = f"{type(exc).__name__}: {exc}"
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.03
    floor_us = sum(p.numel() * p.element_size() for p in stack.layers.parameters()) / H200_BANDWIDTH * 1e6
    head_floor_us = floor_us + head.numel() * head.element_size() / H200_BANDWIDTH * 1e6
    out = []
    for count in rows:
        cache, batch, x, (cos, sin) = decode_step_inputs(cfg, stack, count, len(stack.layers))
        pass_ms = replay_ms(lambda: stack(x, None, cache.layers, batch, rope=(cos, sin), normed=False)[0])[0]
        row: dict[str, Any] = {"rows": count, "pass": 1000 * pass_ms, "floor": floor_us, "head floor": head_floor_us}
        with_head, logits = replay_ms(lambda: stack.last_logits(x, cache.layers, batch, (cos, sin), head))
        row["kernels + head"] = 1000 * with_head
        row["persistent + head"], row["persistent vs kernels"] = None, persistent_failure
        if persistent_failure is None and persistent.persistent.applies(x, batch):
            ms, got = replay_ms(lambda: persistent.last_logits(x, cache.layers, batch, (cos, sin), head))
            row["persistent + head"] = 1000 * ms
            error = ((got.float() - logits.float()).norm() / logits.float().norm()).item()
            row["persistent vs kernels"] = f"{error:.1e}"
        out.append(row)
    return out


def stage_experts(config: Any) -> Iterator[tuple[str, Any, Experts]]:
    """The Thinker's and the Talker's MoE text config, each with one layer's experts at full size (random bf16)."""
    for stage, text in (("thinker", config.thinker_config.text_config), ("talker", config.talker_config.text_config)):
        torch.manual_seed(0)
        experts = Experts(text.num_experts, text.hidden_size, text.moe_intermediate_size).cuda().to(torch.bfloat16)
        torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
        torch.nn.init.normal_(experts.down_proj, std=0.02)
        yield stage, text, experts


def moe_rows(config: Any, rows: list[int]) -> list[dict[str, Any]]:
    """One MoE block's experts (the routing sort, both GEMMs, the weighted sum) per token count, us per call: grouped
    GEMMs (as served) and the Triton expert kernels; each token picks its own random experts."""
    out = []
    for stage, text, experts in stage_experts(config):
        k = text.num_experts_per_tok
        for count in rows:
            x = torch.randn(count, text.hidden_size, device="cuda", dtype=torch.bfloat16)
            chosen = torch.stack([torch.randperm(text.num_experts)[:k] for _ in range(count)]).cuda()
            weights = torch.softmax(torch.randn(count, k, device="cuda"), -1).to(torch.bfloat16)
            grouped_ms, grouped = replay_ms(lambda: experts.grouped(x, chosen, weights))
            kernels_ms, kernels = replay_ms(lambda: experts.with_kernels(x, chosen, weights))
            error = ((kernels.float() - grouped.float()).norm() / grouped.float().norm()).item()
            out.append({"stage": stage, "tokens": count, "grouped GEMMs": 1000 * grouped_ms,
                        "Triton expert kernels": 1000 * kernels_ms, "relative difference": error})
    return out


MOE_CONFIGS: list[moe_kernels.ExpertMatmulConfig] = [
    (32, 128, 3, 4), (16, 128, 3, 4), (16, 256, 3, 4), (64, 128, 3, 4), (32, 64, 4, 4), (32, 256, 2, 4),
    (64, 64, 4, 4), (64, 128, 3, 8), (128, 64, 3, 8), (16, 128, 4, 2),
]


def moe_gemm_rows(config: Any, rows: list[int]) -> list[dict[str, Any]]:
    """Each expert GEMM of a decode batch (gate/up with SiLU*up, and down) alone, per launch config [BLOCK_N,
    BLOCK_K, stages, warps], us per call; each token picks its own random experts."""
    out = []
    for stage, text, experts in stage_experts(config):
        for count in rows:
            x = torch.randn(count, text.hidden_size, device="cuda", dtype=torch.bfloat16)
            chosen = torch.stack([torch.randperm(text.num_experts)[:text.num_experts_per_tok] for _ in range(count)])
            _, _, token_of, counts = Experts._sort_by_expert(chosen.cuda(), text.num_experts)
            block_m = max(16, 1 << (count - 1).bit_length())
            hidden = moe_kernels.expert_matmul(x, experts.gate_up_proj, counts, token_of, True, block_m)
            gemms = {"gate_up (SiLU*up)": (x, experts.gate_up_proj, token_of, True),
                     "down": (hidden, experts.down_proj, None, False)}
            for name, (inputs, weight, token, gated) in gemms.items():
                row: dict[str, Any] = {"stage": stage, "gemm": name, "tokens": count}
                for launch in MOE_CONFIGS:
                    try:
                        row[str(list(launch))] = 1000 * replay_ms(
                            lambda launch=launch: moe_kernels.expert_matmul(
                                inputs, weight, counts, token, gated, block_m, launch))[0]
                    except Exception as exc:  # e.g. more shared memory than the GPU has
                        row[str(list(launch))] = None
                        print(f"{stage} {name} tokens={count} {launch}: {type(exc).__name__}")
                out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--sections", default="layers,stack,gemms,attention,moe",
                        help="which of layers, stack, gemms, attention, moe to measure")
    parser.add_argument("--gemm-stages", default="code_predictor",
                        help="whose GEMMs the gemms section sweeps: code_predictor, thinker, talker (comma-separated)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    cfg = config.talker_config.code_predictor_config
    rows = [int(r) for r in args.rows.split(",")]
    sections = set(args.sections.split(","))
    layers = layer_rows(cfg, rows) if "layers" in sections else []
    stack = stack_rows(cfg, rows) if "stack" in sections else []
    gemms = gemm_rows(gemm_shapes(config, args.gemm_stages.split(",")), rows) if "gemms" in sections else []
    attention = attention_rows(cfg, rows) if "attention" in sections else []
    moe, moe_gemms, moe_failure = [], [], None
    try:  # a failure of the MoE kernels is reported, not lost with the rest
        if "moe" in sections:
            moe = moe_rows(config, [r for r in rows if r <= 32])
            moe_gemms = moe_gemm_rows(config, [r for r in rows if r <= 32])
    except Exception as exc:
        moe_failure = f"{type(exc).__name__}: {exc}"
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.small_batch_bench", argv, gpu=gpu)
    lines = [f"# Small-batch kernels, us per call replayed from a CUDA graph: {gpu}, {meta['date']}, "
             f"commit {meta['commit']}", f"# command: {meta['command']}", "",
             "## One layer, one new token per row", "",
             "| rows | eager | inductor | five kernels, first layer | five kernels, later layer |", "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['eager']:.1f} | {r['inductor']:.1f} | {r['five kernels, first layer']:.1f} | "
              f"{r['five kernels, later layer']:.1f} |" for r in layers]
    lines += ["", "## One pass: every layer, five kernels each (floor: the layers' weights at 4.3 TB/s); with the final "
              "norm and the code head, as those kernels and as one persistent kernel (relative L2 distance of the "
              "logits)", "",
              "| rows | pass | floor | kernels + head | persistent + head | floor with head | persistent vs kernels |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['pass']:.1f} | {r['floor']:.1f} | {r['kernels + head']:.1f} | "
              + ("–" if r["persistent + head"] is None else f"{r['persistent + head']:.1f}")
              + f" | {r['head floor']:.1f} | {r['persistent vs kernels'] or '–'} |" for r in stack]
    warps = [f"{w} warps" for w in ATTENTION_WARPS]
    lines += ["", "## The attention kernel (q/k norm, rotary, KV write, attention), one new token per row", "",
              "| rows | " + " | ".join(warps) + " |", "|---|" + "---|" * len(warps)]
    lines += [f"| {r['rows']} | " + " | ".join(f"{r[w]:.1f}" for w in warps) + " |" for r in attention]
    names = [str(list(c)) for c in CONFIGS]
    lines += ["", "## Each GEMM: cuBLAS alone, and `rows_matmul` with its prologue/epilogue per config "
              "[BLOCK_N, BLOCK_K, stages, warps, SPLIT_K], in a graph of calls on copies of the weight (from memory, "
              "not L2)", "",
              "| GEMM | rows | floor | default | cuBLAS | " + " | ".join(names) + " |",
              "|---|---|---|---|---|" + "---|" * len(names)]
    for r in gemms:
        cells = " | ".join("–" if r[n] is None else f"{r[n]:.1f}" for n in names)
        lines.append(f"| {r['gemm']} | {r['rows']} | {r['floor']:.1f} | {r['default']} | {r['cuBLAS']:.1f} | {cells} |")
    lines += ["", "## One MoE block's experts (routing sort, both GEMMs, weighted sum), us per call", "",
              "| stage | tokens | grouped GEMMs | Triton expert kernels | relative difference |", "|---|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['tokens']} | {r['grouped GEMMs']:.1f} | {r['Triton expert kernels']:.1f} | "
              f"{r['relative difference']:.1e} |" for r in moe]
    moe_names = [str(list(c)) for c in MOE_CONFIGS]
    lines += ["", "## Each MoE expert GEMM alone, per launch config [BLOCK_N, BLOCK_K, stages, warps], us per call", "",
              "| stage | GEMM | tokens | " + " | ".join(moe_names) + " |", "|---|---|---|" + "---|" * len(moe_names)]
    for r in moe_gemms:
        cells = " | ".join("–" if r[n] is None else f"{r[n]:.1f}" for n in moe_names)
        lines.append(f"| {r['stage']} | {r['gemm']} | {r['tokens']} | {cells} |")
    if moe_failure:
        lines.append(f"\nThe MoE kernels failed: {moe_failure}")
    document = {"meta": meta, "layers": layers, "stack": stack, "gemms": gemms, "attention": attention, "moe": moe,
                "moe_gemms": moe_gemms, "moe_failure": moe_failure}
    write_results(args.out, "small_batch_kernels", document, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
