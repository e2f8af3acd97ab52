"""The eight-kernel MoE layer's decode step (`layers/small_batch_moe.py`), each kernel replayed from a CUDA graph at
full-size Qwen3-Omni-30B Thinker and Talker shapes (random bf16 weights). Measures the attention kernel per key
split and key block, the routing kernel, and each expert GEMM per launch config. Also measures the whole layer
against its bytes: eight kernels, and seven or six with the folds of `engine.moe_layer_folds`. Use it when tuning
the MoE decode kernels or their launch configs. `--distinct-inputs 8` makes 32 rows hit about as many experts as
the service's rows do.

    python -m benchmarks.moe_layer_bench --out DIR [--rows 1,8,32] [--stages thinker,talker]
        [--sections layer,attention,route,experts] [--distinct-inputs 8]

One H100 or H200 (the bandwidth floor it reports is the H200's)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

import torch
from transformers import Qwen3OmniMoeConfig

from benchmarks.small_batch_bench import replay_ms
from omni_ray.bench import FULL_CONFIG, run_meta, write_results
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers import picked_experts, small_batch_moe
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack
from omni_ray.layers.moe_kernels import ExpertMatmulConfig
from omni_ray.layers.small_batch import rows_matmul

COPIES = 4  # a graph calls each kernel once per layer copy, each reading its own weights and cache, as a pass does
KEYS = {"thinker": 256, "talker": 512}  # the key range (a power-of-two bucket) of the speech workload's decode steps
SPLITS = (1, 2, 4, 8, 16)
KEY_BLOCKS = (64, 128)
EXPERT_CONFIGS: list[ExpertMatmulConfig] = [(64, 128, 3, 4), (32, 256, 3, 4), (64, 64, 4, 4), (32, 256, 4, 4),
                                            (16, 256, 3, 4), (32, 512, 2, 4), (64, 256, 3, 8), (64, 64, 5, 4)]
BANDWIDTH = 4.3e12  # bytes/s, the H200's measured copy bandwidth
# a layer's kernels: eight; the combine in the down GEMM's kernel; the routing in the router GEMM's; both (six)
LAYER_VARIANTS = (("layer", False, False), ("combine in down", True, False), ("routing in router", False, True),
                  ("both (6 kernels)", True, True))


@dataclasses.dataclass
class Step:
    """One decode step's inputs for every layer copy of a stage."""

    stack: DecoderStack
    cache: SlotKVCache
    batch: AttentionBatch
    x: torch.Tensor  # [rows, 1, hidden]
    cos: torch.Tensor
    sin: torch.Tensor


def stage_stack(config: Any, stage: str) -> DecoderStack:
    """COPIES full-size MoE layers of the stage, random bf16 weights (random routers), the eight kernels on."""
    text = config.thinker_config.text_config if stage == "thinker" else config.talker_config.text_config
    spec = dataclasses.replace(DecoderSpec.from_hf(text, always_moe=stage == "talker"), num_layers=COPIES)
    torch.manual_seed(0)
    stack = DecoderStack(spec).cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.03) + (1.0 if p.dim() == 1 else 0.0))
    assert stack.use_moe_layer_kernels()
    return stack


def step_inputs(stack: DecoderStack, rows: int, keys: int, distinct_inputs: int = 0) -> Step:
    """`rows` rows (slots 0..rows-1), each at a random position in the upper half of a `keys`-position range.
    `distinct_inputs` > 0: the rows are that many rows over again (row i the (i mod n)-th: its hidden state, position
    and cached keys and values, so that its attention's output, and so its routing, are the same too): they pick
    fewer experts, as a step of the service's rows does: with random weights 32 rows with a prompt
    each hit about 51 of the Thinker's 128 experts a layer (`benchmarks/expert_reads.py`), as 8 independent rows do."""
    spec = stack.spec
    cache = SlotKVCache(COPIES, rows, keys, spec.num_kv_heads, spec.head_dim, torch.bfloat16, "cuda")
    for k, v in cache.layers:
        k.normal_()
        v.normal_()
    slots = torch.arange(rows, device="cuda")
    like = slots % distinct_inputs if distinct_inputs else slots  # the row each row repeats
    for k, v in cache.layers:
        k[:rows], v[:rows] = k[like], v[like]
    starts = torch.randint(keys // 2, keys - 1, (rows,), device="cuda")[like]
    batch = AttentionBatch.from_tensors(slots, starts, 1, keys, rows_are_slots=True)
    positions = starts[:, None]
    positions = positions.unsqueeze(0).expand(3, -1, -1) if spec.mrope_section else positions
    cos, sin = stack.rotary(positions, torch.bfloat16)
    x = torch.randn(rows, 1, spec.hidden_size, device="cuda", dtype=torch.bfloat16)[like]
    return Step(stack, cache, batch, x, cos, sin)


def per_call_us(calls: list[Callable[..., torch.Tensor]], step: Step | None = None) -> float:
    """µs per call of a graph that makes every call once, one after the other. With `step`: call i gets row i of one
    step's zeroed split-attention counters (one memset a replay, as `DecoderStack.forward` makes one a step)."""
    def run() -> torch.Tensor:
        if step is None:
            return [call() for call in calls][-1]
        arrivals = small_batch_moe.new_arrivals(step.x, len(calls), step.stack.spec.num_kv_heads)
        return [call(arrivals[i]) for i, call in enumerate(calls)][-1]

    return 1000 * replay_ms(run, 50)[0] / len(calls)


def attention_row(step: Step, rows: int, keys: int) -> dict[str, Any]:
    """The attention kernel per (splits, key block), µs per call; `default`: the splits `decode_attention` picks."""
    layers = step.stack.layers
    attn = layers[0].self_attn
    qkvs = [torch.randn(rows, attn.qkv.shape[0], device="cuda", dtype=torch.bfloat16) for _ in layers]
    key_block = small_batch_moe.attention_key_block(keys)
    chosen = small_batch_moe.attention_splits(rows, attn.num_kv_heads, keys // key_block)
    row: dict[str, Any] = {"rows": rows, "keys": keys, "default": f"{chosen} x {key_block}"}
    for key_block in KEY_BLOCKS:
        for splits in SPLITS:
            if splits <= keys // key_block:
                row[f"{splits} x {key_block}"] = per_call_us([
                    lambda arrivals, i=i, splits=splits, key_block=key_block: small_batch_moe.decode_attention(
                        qkvs[i], layers[i].self_attn, step.cos, step.sin, step.cache.layers[i], step.batch, arrivals,
                        splits=splits, key_block=key_block) for i in range(len(layers))], step)
    return row


def router_logits(step: Step) -> list[torch.Tensor]:
    """Each layer copy's router logits for the step's rows (its post-attention norm and router GEMM)."""
    out = []
    for layer in step.stack.layers:
        moe, norm = layer.mlp, layer.post_attention_layernorm
        router = moe.router_and_shared_gate if moe.router_and_shared_gate is not None else moe.gate.weight
        out.append(rows_matmul(step.x[:, 0], router, norm.weight, norm.variance_epsilon))
    return out


def step_routes(step: Step) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer copy's routing of the step's rows (`small_batch_moe.route` on `router_logits`)."""
    moe = step.stack.layers[0].mlp
    return [small_batch_moe.route(lg, moe.gate.top_k, moe.gate.norm_topk_prob, moe.gate.weight.shape[0],
                                  moe.shared_parts) for lg in router_logits(step)]


ROUTE_WARPS = (1, 2, 4, 8)


def route_row(step: Step, rows: int) -> dict[str, Any]:
    """The routing kernel, µs per call, per num_warps (`default`: `route_warps`'s pick); with a shared expert also
    without its gate column and parts (logits of the routed experts only)."""
    moe = step.stack.layers[0].mlp
    experts, top_k = moe.gate.weight.shape[0], moe.gate.top_k
    logits = router_logits(step)
    variants = {"": (logits, moe.shared_parts)}
    if moe.shared_parts:
        variants[", no shared expert"] = ([lg[:, :experts].contiguous() for lg in logits], 0)
        # the same logits read as if there were no shared expert: the kernel's shared-expert code, or its input?
        variants[", routed columns only"] = (logits, 0)
    row: dict[str, Any] = {"rows": rows, "default": small_batch_moe.route_warps(rows)}
    for name, (inputs, shared) in variants.items():
        for warps in ROUTE_WARPS:
            row[f"{warps} warps{name}"] = per_call_us([
                lambda lg=lg, warps=warps: small_batch_moe.route(lg, top_k, moe.gate.norm_topk_prob, experts, shared,
                                                                 warps)[0] for lg in inputs])
    return row


def expert_rows(step: Step, rows: int) -> list[dict[str, Any]]:
    """Both expert GEMMs per launch config, µs per call, and the picked experts' bytes at 4.3 TB/s."""
    layers = step.stack.layers
    norm = layers[0].post_attention_layernorm
    flat = step.x[:, 0]
    squares = flat.float().pow(2).reshape(rows, -1, 64).sum(-1).T.contiguous()
    routes = step_routes(step)
    weights = [layer.mlp.experts.stacked or (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj)
               for layer in layers]
    hits = sum(int(hit_count) for _, _, _, hit_count in routes) / len(routes)
    hidden = [picked_experts.picked_expert_matmul(flat, w[0], p, hl, h, gated=True, per_pick=False,
                                                  norm_weight=norm.weight, eps=norm.variance_epsilon, squares=squares)
              for w, (p, _, hl, h) in zip(weights, routes)]
    out = []
    for name, gated in (("gate_up (norm, SiLU*up)", True), ("down", False)):
        expert_bytes = weights[0][0 if gated else 1][0].numel() * 2
        row: dict[str, Any] = {"rows": rows, "gemm": name, "experts hit": hits,
                               "floor": hits * expert_bytes / BANDWIDTH * 1e6,
                               "default": str(list(picked_experts.picked_expert_config(gated, rows)))}
        for config in EXPERT_CONFIGS:
            def call(i: int, config: ExpertMatmulConfig = config, gated: bool = gated) -> torch.Tensor:
                picks, _, hit_list, hit_count = routes[i]
                if gated:
                    return picked_experts.picked_expert_matmul(
                        flat, weights[i][0], picks, hit_list, hit_count, gated=True, per_pick=False,
                        norm_weight=norm.weight, eps=norm.variance_epsilon, squares=squares, config=config)
                return picked_experts.picked_expert_matmul(hidden[i], weights[i][1], picks, hit_list, hit_count,
                                                           gated=False, per_pick=True, config=config)
            try:
                row[str(list(config))] = per_call_us([lambda i=i: call(i) for i in range(len(layers))])
            except Exception as exc:  # e.g. more shared memory than the GPU has
                row[str(list(config))] = None
                print(f"{name} rows={rows} {config}: {type(exc).__name__}")
        out.append(row)
    return out


def layer_row(step: Step, rows: int) -> dict[str, Any]:
    """A whole layer's decode step (eight kernels, and with fewer: `LAYER_VARIANTS`), µs per layer, against the bytes
    it must read at 4.3 TB/s: its attention and router weights, the picked experts' weights and each row's keys and
    values."""
    layers = step.stack.layers
    moe = layers[0].mlp
    dense = sum(p.numel() * 2 for name, p in layers[0].named_parameters() if "experts" not in name)
    gate_up, down = moe.experts.stacked or (moe.experts.gate_up_proj, moe.experts.down_proj)
    per_expert = (gate_up[0].numel() + down[0].numel()) * 2
    hits = sum(int(hit_count) for _, _, _, hit_count in step_routes(step)) / len(layers)
    written = step.batch.write_index.reshape(-1).float().mean().item()
    spec = step.stack.spec
    kv_bytes = rows * written * spec.num_kv_heads * spec.head_dim * 2 * 2
    floor = (dense + hits * per_expert + kv_bytes) / BANDWIDTH * 1e6
    row: dict[str, Any] = {"rows": rows}
    for name, combine_in_down, route_in_router in LAYER_VARIANTS:
        row[name] = per_call_us([
            lambda arrivals, i=i, combined=combine_in_down, routed=route_in_router: small_batch_moe.decoder_layer(
                layers[i], step.x, step.cos, step.sin, step.cache.layers[i], step.batch, None, arrivals, combined,
                routed)[0]
            for i in range(len(layers))], step)
    return row | {"floor": floor, "experts hit": hits}


def table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table of `rows` (every key of any row a column; None or missing as –)."""
    if not rows:
        return []
    names = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: Any) -> str:
        return "–" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    return ["", f"## {title}", "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names),
            *("| " + " | ".join(cell(row.get(name)) for name in names) + " |" for row in rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--stages", default="thinker,talker")
    parser.add_argument("--sections", default="layer,attention,route,experts")
    parser.add_argument("--distinct-inputs", type=int, default=0,
                        help="the rows' hidden states are this many vectors over again (0: every row its own), so that "
                        "they hit fewer experts: 8 at 32 rows hits about the 51 experts of a service step's rows")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    sections = set(args.sections.split(","))
    document: dict[str, Any] = {}
    lines: list[str] = []
    for stage in args.stages.split(","):
        stack = stage_stack(config, stage)
        found: dict[str, list[dict[str, Any]]] = {"layer": [], "attention": [], "route": [], "experts": []}
        for rows in (int(r) for r in args.rows.split(",")):
            step = step_inputs(stack, rows, KEYS[stage], args.distinct_inputs)
            if "layer" in sections:
                found["layer"].append(layer_row(step, rows))
            if "attention" in sections:
                found["attention"].append(attention_row(step, rows, KEYS[stage]))
            if "route" in sections:
                found["route"].append(route_row(step, rows))
            if "experts" in sections:
                found["experts"] += expert_rows(step, rows)
        document[stage] = found
        lines += table(f"{stage}: a whole layer's step, µs per layer (floor: its bytes at 4.3 TB/s)", found["layer"])
        lines += table(f"{stage}: the attention kernel, µs per call, by splits x key block", found["attention"])
        lines += table(f"{stage}: the routing kernel, µs per call", found["route"])
        lines += table(f"{stage}: each expert GEMM, µs per call, by launch config [BLOCK_N, BLOCK_K, stages, warps] "
                       f"(floor: the picked experts' bytes at 4.3 TB/s)", found["experts"])
        del stack
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name()
    meta = run_meta("benchmarks.moe_layer_bench", argv, gpu=gpu)
    head = [f"# The eight-kernel MoE layer's decode-step kernels, replayed from CUDA graphs ({COPIES} layer copies "
            f"per graph): {gpu}, {meta['date']}, commit {meta['commit']}", f"# command: {meta['command']}"]
    write_results(args.out, "moe_layer_kernels", {"meta": meta, **document}, "\n".join(head + lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
