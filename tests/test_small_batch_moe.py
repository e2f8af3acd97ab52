"""The eight-kernel MoE decoder layer (`layers/small_batch_moe.py`) against the eager layer: under Triton's
interpreter on the CPU, and compiled for the H200 without a GPU."""

from __future__ import annotations

from typing import Any

import pytest

from _triton import compile_for_h200, run_interpreted

# Run in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are defined.
CHECK = r"""
import copy, json, torch
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.layers import small_batch_moe
from omni_ray.layers.attention import AttentionBatch
from omni_ray.layers.decoder import DecoderSpec, DecoderStack

torch.manual_seed(0)
results = {}
CACHE = 150
# the attention's programs in all (1: one per (row, KV head); 256: the key blocks split over 2 or 3) and key block
CASES = ((torch.float32, True, 64, 4, 32, 1, 128), (torch.float32, True, 64, 4, 32, 256, 64),
         (torch.float32, False, 0, 16, 32, 256, 128), (torch.bfloat16, False, 64, 4, 32, 256, 64),
         (torch.float32, False, 64, 4, 8, 1, 64), (torch.float32, False, 64, 4, 8, 256, 128))
for dtype, rows_are_slots, shared, heads, dim, programs, key_block in CASES:
    small_batch_moe.ATTENTION_PROGRAMS, small_batch_moe.KEY_BLOCK = programs, key_block
    spec = DecoderSpec(num_layers=2, hidden_size=64, num_heads=heads, num_kv_heads=2, head_dim=dim, rms_norm_eps=1e-6,
                       rope_theta=10000.0, mrope_section=None, intermediate_size=96, num_experts=8, top_k=3,
                       moe_intermediate_size=32, norm_topk_prob=True, shared_expert_intermediate_size=shared)
    eager = DecoderStack(spec).to(dtype)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15) + (1.0 if p.dim() == 1 else 0.0))
    fused, folded = copy.deepcopy(eager), copy.deepcopy(eager)
    eager.fuse_projections()
    assert fused.use_moe_layer_kernels() and not (fused.moe_combine_in_down or fused.moe_route_in_router)
    assert folded.use_moe_layer_kernels(folds=True) and folded.moe_combine_in_down and folded.moe_route_in_router
    # the eager layers, the eight kernels, then with the combine in the down GEMM's kernel, the routing in the
    # router GEMM's, and both (seven, seven and six kernels)
    fewer = ((False, False), (True, False), (False, True), (True, True))
    caches = [SlotKVCache(2, 5, CACHE, 2, dim, dtype, "cpu") for _ in range(1 + len(fewer))]
    for k, v in caches[0].layers:  # stale keys past each row's position: the kernel must not read them
        k.normal_(); v.normal_()
    for cache in caches[1:]:
        for (k0, v0), (k1, v1) in zip(caches[0].layers, cache.layers):
            k1.copy_(k0); v1.copy_(v0)
    rows = 3
    slots = torch.arange(rows) if rows_are_slots else torch.tensor([4, 0, 2])
    starts = torch.tensor([5, 63, 130])
    worst = {"hidden": 0.0, "keys": 0.0, "values": 0.0, "used": 0, "fewer kernels": 0.0}
    for step in range(3):
        batch = AttentionBatch.from_tensors(slots, starts, 1, int(starts.max()) + 1, rows_are_slots=rows_are_slots)
        x = torch.randn(rows, 1, 64).to(dtype)
        cos, sin = eager.rotary(starts[:, None], dtype)
        outs = [eager(x, None, caches[0].layers, batch, rope=(cos, sin))[0].float()]
        worst["used"] += sum(int(small_batch_moe.applies(layer, x, batch)) for layer in fused.layers)
        for (combine_in_down, route_in_router), cache in zip(fewer, caches[1:]):
            fused.moe_combine_in_down, fused.moe_route_in_router = combine_in_down, route_in_router
            outs.append(fused(x, None, cache.layers, batch, rope=(cos, sin))[0].float())
        worst["hidden"] = max(worst["hidden"], (outs[0] - outs[1]).abs().max().item() / outs[0].abs().max().item())
        for out in outs[2:]:
            worst["fewer kernels"] = max(worst["fewer kernels"], (outs[1] - out).abs().max().item())
        for (k0, v0), (k1, v1) in zip(caches[0].layers, caches[1].layers):
            worst["keys"] = max(worst["keys"], (k0.float() - k1.float()).abs().max().item())
            worst["values"] = max(worst["values"], (v0.float() - v1.float()).abs().max().item())
        for cache in caches[2:]:
            for (k1, v1), (k2, v2) in zip(caches[1].layers, cache.layers):
                assert torch.equal(k1, k2) and torch.equal(v1, v2)
        starts = starts + 1
    worst["splits"] = small_batch_moe.attention_splits(rows, 2, -(-batch.kv_len // key_block))
    results[f"{dtype}-{'rows are slots' if rows_are_slots else 'slots'}-shared {shared}-heads {heads}-dim {dim}-"
            f"{programs} programs-blocks of {key_block}"] = worst
# steps the kernels leave to the layers' own code: two tokens a row, a prefill from position 0, 65 rows
layer = fused.layers[0]
two_tokens = AttentionBatch.from_tensors(slots, starts, 2, int(starts.max()) + 2)
prefill = AttentionBatch.prefill(slots, 4)
many = AttentionBatch.from_tensors(torch.zeros(65, dtype=torch.long), torch.zeros(65, dtype=torch.long), 1, 1)
results["fallbacks"] = [small_batch_moe.applies(layer, torch.zeros(3, 2, 64, dtype=dtype), two_tokens),
                        small_batch_moe.applies(layer, torch.zeros(3, 4, 64, dtype=dtype), prefill),
                        small_batch_moe.applies(layer, torch.zeros(65, 1, 64, dtype=dtype), many),
                        small_batch_moe.applies(layer, torch.zeros(64, 1, 64, dtype=dtype), many)]
print(json.dumps(results))
"""


def test_moe_layers_as_kernels_equal_the_eager_layers_under_the_triton_interpreter() -> None:
    """A two-layer MoE stack (8 experts, 3 picked per token, with and without a shared expert folded in as two more
    picks) over a 150-position cache holding stale keys: three rows decode three steps from positions 5, 63 and 130
    (so a row's keys span one to three blocks of 64, and its new key lands at a block's edge), in the first slots or
    in others, with 2 and 8 query heads per KV head, heads of 32 and of 8 (padded to 16 for the tile products), the
    attention in one program per (row, KV head) and with its key blocks (of 64 or 128) split over two or three
    programs (some with no block of a row's; the last to finish merging). The kernels' outputs and the keys and values
    they write equal the eager layers' (which route and run each expert by torch ops), fp32 to float rounding, bf16 to
    its rounding, for every layer of every step: the second layer's input norm reads the sums of squares the first
    layer's combine left. With the combine inside the down projection's kernel, the routing inside the router
    GEMM's or both (the stack's `moe_combine_in_down`, `moe_route_in_router`), the outputs and the keys and values
    equal the eight kernels' bit for bit. Steps of two tokens a row, prefills and steps of more than 64 rows keep the
    layers' own code."""
    results = run_interpreted(CHECK)
    # two tokens a row, a prefill and 65 rows run the layers' own code; 64 rows of one token take the kernels
    assert results.pop("fallbacks") == [False, False, False, True]
    assert len(results) == 6
    for case, worst in results.items():
        assert worst["used"] == 6, case  # 2 layers x 3 steps ran the kernels
        assert worst["splits"] == (1 if "-1 programs" in case else 3 if case.endswith("of 64") else 2), case
        bf16 = "bfloat16" in case
        assert worst["hidden"] < (3e-2 if bf16 else 1e-5), (case, worst)  # relative to the largest output
        assert max(worst["keys"], worst["values"]) < (0.1 if bf16 else 1e-5), (case, worst)
        assert worst["fewer kernels"] == 0.0, (case, worst)


ROUTE_CHECK = r"""
import json, torch
from omni_ray.layers import small_batch_moe

torch.manual_seed(0)
results = {}
for rows, experts, top_k, shared, norm in ((1, 128, 8, 0, True), (5, 128, 6, 2, False), (32, 128, 6, 2, True),
                                           (20, 12, 3, 0, True)):
    logits = (torch.randn(rows, experts + (1 if shared else 0)) * 3).to(torch.bfloat16)
    logits[0, 1] = logits[0, 2] = 40.0  # a tie at the top: the lower id comes first
    picks, weights, hit_list, hits = small_batch_moe.route(logits, top_k, norm, experts, shared)
    probs = torch.softmax(logits[:, :experts].float(), -1)
    top, chosen = (part[:, :top_k] for part in torch.sort(probs, dim=-1, descending=True, stable=True))  # ties: lower id
    if norm:
        top = top / top.sum(-1, keepdim=True)
    picked = set(chosen.flatten().tolist()) | {experts + part for part in range(shared)}
    results[f"{rows} rows, {experts} experts, top {top_k}, {shared} shared parts"] = {
        "picks": picks[:, :top_k].tolist() == chosen.tolist(),
        "weights": ((weights[:, :top_k] - top) / top).abs().max().item(),  # relative
        "shared picks": picks[:, top_k:].tolist() == [[experts + p for p in range(shared)]] * rows,
        "shared weights": ((weights[:, top_k:] - torch.sigmoid(logits[:, experts:].float())).abs()
                           / torch.sigmoid(logits[:, experts:].float())).max().item() if shared else 0.0,
        "hit list": hit_list[: int(hits)].tolist() == sorted(picked),
    }
print(json.dumps(results))
"""


def test_routing_kernel_picks_weights_and_lists_the_hit_experts() -> None:
    """`route` under Triton's interpreter, against softmax + top-k by torch: each row's top-k experts in order (a tie
    to the lower id), their weights (renormalised or not), the shared expert's parts with their sigmoid gate, and the
    list of every expert some row picked, in increasing order and nothing else, at 1, 5, 20 and 32 rows (padding rows
    of the 16- and 32-row tiles pick nothing)."""
    results = run_interpreted(ROUTE_CHECK)
    assert len(results) == 4
    for case, found in results.items():
        assert found["picks"] and found["shared picks"] and found["hit list"], (case, found)
        # rounded to bf16 (the logits' dtype) as the eager layer rounds them: within one bf16 step (2**-7 relative)
        assert found["weights"] <= 2**-7 and found["shared weights"] <= 2**-7, (case, found)


DOWN_AND_COMBINE_CHECK = r"""
import json, torch
from omni_ray.layers import picked_experts, small_batch, small_batch_moe

torch.manual_seed(0)
results = {}
for rows, experts, top_k, n, depth, dtype in ((3, 8, 3, 64, 32, torch.float32), (5, 8, 5, 96, 32, torch.bfloat16),
                                              (32, 16, 6, 192, 48, torch.float32),
                                              (1, 128, 8, 128, 32, torch.bfloat16)):
    launches = []
    for launch in range(2):  # the second launch routes otherwise: the counters the first left must be zeros again
        picks, weights, hit_list, hits = small_batch_moe.route(torch.randn(rows, experts).to(dtype), top_k, True,
                                                               experts, 0)
        hidden = torch.randn(rows * top_k, depth).to(dtype)
        down = (torch.randn(experts, n, depth) * 0.2).to(dtype)
        residual = torch.randn(rows, n).to(dtype)
        y = picked_experts.picked_expert_matmul(hidden, down, picks, hit_list, hits, gated=False, per_pick=True)
        apart = picked_experts.combine(y, weights, residual)
        together = picked_experts.down_and_combine(hidden, down, picks, hit_list, hits, weights, residual)
        launches.append({"outputs equal": torch.equal(apart[0], together[0]),
                         "squares equal": torch.equal(apart[1], together[1]), "hits": int(hits),
                         "column blocks": together[1].shape[0]})
    launches.append({"counters left at zero": not small_batch.arrival_counters(torch.device("cpu")).any().item()})
    results[f"{rows} rows, {experts} experts, top {top_k}, {n} wide, {dtype}"] = launches
print(json.dumps(results))
"""


def test_the_down_kernel_that_combines_equals_the_down_kernel_then_the_combine_kernel() -> None:
    """`down_and_combine` (each column block's last program to finish combines the block) under Triton's
    interpreter, against the down projection's kernel and then the combine kernel: the same output and the same partial
    sums of squares, bit for bit, at 1 to 32 rows, 3 to 32 experts hit, one to three column blocks, fp32 and bf16;
    two launches in a row with different routings both right, and the arrival counters left at zero."""
    results = _launches_leaving_zeroed_counters(DOWN_AND_COMBINE_CHECK)
    for case, launches in results.items():
        for launch in launches:
            assert launch["outputs equal"] and launch["squares equal"], (case, launch)
        assert launches[0]["column blocks"] == -(-int(case.split(", ")[3].split()[0]) // 64), case
    assert max(launch["hits"] for launches in results.values() for launch in launches) >= 16  # many programs arrive


ROUTER_AND_ROUTE_CHECK = r"""
import json, torch
from omni_ray.layers import small_batch, small_batch_moe

torch.manual_seed(0)
results = {}
# rows, width, experts, top k, shared expert parts, dtype, programs splitting the depth
for rows, hidden, experts, top_k, shared, dtype, split in ((1, 64, 8, 3, 0, torch.float32, 1),
                                                          (5, 128, 16, 4, 2, torch.bfloat16, 1),
                                                          (32, 256, 128, 8, 0, torch.bfloat16, 4),
                                                          (20, 96, 12, 3, 0, torch.float32, 2)):
    config = (16, 32, 2, 4, split)  # BLOCK_N, BLOCK_K, stages, warps, SPLIT_K: several column blocks and programs
    small_batch.matmul_config = lambda n, k: config
    launches = []
    for launch in range(2):  # the second routes otherwise: the counters the first left must be zeros again
        x = torch.randn(rows, hidden).to(dtype)
        router = (torch.randn(-(-(experts + bool(shared)) // 16) * 16, hidden) * 0.2).to(dtype)
        norm = (torch.rand(hidden) + 0.5).to(dtype)
        squares = x.float().pow(2).sum(-1)[None, :].contiguous()
        logits = small_batch.rows_matmul(x, router, norm, 1e-6, squares=squares)
        apart = small_batch_moe.route(logits, top_k, True, experts, shared)
        together = small_batch_moe.router_and_route(x, router, norm, 1e-6, squares, top_k, True, experts, shared)
        hits = int(apart[3])
        launches.append({"picks": torch.equal(apart[0], together[0]), "weights": torch.equal(apart[1], together[1]),
                         "hits": hits if hits == int(together[3]) else -1,
                         "hit list": torch.equal(apart[2][:hits], together[2][:hits])})
    launches.append({"counters left at zero": not small_batch.arrival_counters(torch.device("cpu")).any().item()})
    results[f"{rows} rows, {experts} experts, top {top_k}, {shared} shared parts, {dtype}, depth in {split}"] = launches
print(json.dumps(results))
"""


def test_the_router_gemm_that_routes_equals_the_router_gemm_then_the_routing_kernel() -> None:
    """`router_and_route` (the router GEMM's last program to finish routes) under Triton's interpreter, against
    `rows_matmul` and then `route`: the same picks, weights and list of hit experts, bit for bit, at 1 to 32 rows, 8
    to 128 experts, with a shared expert's parts, the depth in one to four programs over several column blocks;
    two launches in a row with different routings both right, and the arrival counters left at zero."""
    results = _launches_leaving_zeroed_counters(ROUTER_AND_ROUTE_CHECK)
    for case, launches in results.items():
        for launch in launches:
            assert launch["picks"] and launch["weights"] and launch["hit list"] and launch["hits"] > 0, (case, launch)
    assert max(launch["hits"] for launches in results.values() for launch in launches) >= 64  # many experts listed


def _launches_leaving_zeroed_counters(script: str) -> dict[str, list[dict[str, Any]]]:
    """`script`'s four cases under the interpreter, each a list of launches and last the counters' state: that state
    checked (every arrival counter back at zero) and dropped."""
    results = run_interpreted(script)
    assert len(results) == 4
    for case, launches in results.items():
        assert launches.pop() == {"counters left at zero": True}, case
    return results


def _bf16_pointers(*names: str) -> dict[str, str]:
    return {name: "*bf16" for name in names}


def _i32(*names: str) -> dict[str, str]:
    return {name: "i32" for name in names}


@pytest.mark.parametrize("kernel_name", ["attention", "split attention", "route", "router + route", "gate_up", "down",
                                         "down + combine", "combine"])
def test_moe_layer_kernels_compile_for_the_h200_without_a_gpu(kernel_name: str) -> None:
    """Triton's compiler, not its interpreter, down to Hopper machine code (sm_90), each kernel in the form the
    Talker's layers launch it at 32 rows: what the interpreter lets pass and a GPU would refuse fails here."""
    from omni_ray.layers import picked_experts, small_batch
    from omni_ray.layers import small_batch_moe as kernels

    types: dict[str, str]
    constants: dict[str, Any]
    if kernel_name.endswith("attention"):
        kernel = kernels._decode_attention_kernel
        types = _bf16_pointers("qkv_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr",
                               "v_cache_ptr", "out_ptr")
        types |= {"slots_ptr": "*i64", "index_ptr": "*i64", "eps": "fp32", "scale": "fp32", "partial_ptr": "*fp32",
                  "arrivals_ptr": "*i32"}
        types |= _i32("qkv_stride", "rope_stride", "slot_stride", "position_stride", "out_stride")
        constants = {"HEADS": 16, "KV_HEADS": 2, "D": 128, "D_PAD": 128, "GROUP_ROWS": 16, "KEYS": 512, "KEY_BLOCK": 128,
                     "SPLITS": 4 if kernel_name == "split attention" else 1, "ROWS_ARE_SLOTS": True, "FP32_DOT": False,
                     "PRECISION": "tf32"}
    elif kernel_name == "route":
        kernel = kernels._route_kernel
        types = {"logits_ptr": "*bf16", "picks_ptr": "*i32", "weights_ptr": "*fp32", "hit_list_ptr": "*i32",
                 "hits_ptr": "*i32"} | _i32("logits_stride", "M", "num_experts")
        constants = {"TOP_K": 6, "SHARED_PARTS": 2, "NORM_TOP_K": True, "ROWS": 32, "EXPERTS": 128, "PICKS": 8}
    elif kernel_name == "router + route":  # the Talker's router (144 rows with its shared gate, 1,024 deep)
        kernel = kernels._router_kernel
        types = _bf16_pointers("x_ptr", "w_ptr", "out_ptr", "res_ptr", "norm_ptr")
        types |= {"eps": "fp32", "squares_in_ptr": "*fp32", "squares_out_ptr": "*fp32", "partial_ptr": "*fp32",
                  "arrivals_ptr": "*i32", "picks_ptr": "*i32", "weights_ptr": "*fp32", "hit_list_ptr": "*i32",
                  "hits_ptr": "*i32", "route_counter_ptr": "*i32"}
        types |= _i32("x_stride", "w_stride", "out_stride", "res_stride", "M", "N", "squares_in_count", "num_experts")
        block_n, block_k, _, _, split = small_batch.matmul_config(144, 1024)
        constants = {"K": 1024, "NORM": True, "GATED": False, "RESIDUAL": False, "SQUARES_IN": 16, "SQUARES_OUT": False,
                     "BLOCK_M": 32, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "FP32_DOT": False,
                     "PRECISION": "tf32", "WEIGHT_EVICTION": "evict_first", "TOP_K": 6, "SHARED_PARTS": 2,
                     "NORM_TOP_K": True, "ROUTE_ROWS": 32, "EXPERTS": 128, "PICKS": 8}
    elif kernel_name in ("gate_up", "down", "down + combine"):
        kernel = picked_experts._picked_expert_kernel
        gated = kernel_name == "gate_up"
        types = _bf16_pointers("x_ptr", "norm_ptr", "w_ptr", "out_ptr")
        types |= {"squares_ptr": "*fp32", "picks_ptr": "*i32", "hit_list_ptr": "*i32", "hits_ptr": "*i32",
                  "eps": "fp32"} | _i32("x_stride", "squares_count", "w_expert_stride", "w_row_stride", "out_stride",
                                        "M", "N", "res_stride", "layer_out_stride")
        types |= _bf16_pointers("res_ptr", "layer_out_ptr") | {"pick_weights_ptr": "*fp32", "squares_out_ptr": "*fp32",
                                                             "arrivals_ptr": "*i32"}
        block_n, block_k, _, _ = picked_experts.picked_expert_config(gated, 32)
        constants = {"K": 1024 if gated else 384, "WIDTH": 8, "PICKS": 8, "GATED": gated, "NORM": gated,
                     "SQUARES_IN": 64, "PER_PICK": not gated, "COMBINE": kernel_name == "down + combine", "BLOCK_M": 32,
                     "BLOCK_N": block_n, "BLOCK_K": block_k, "FP32_DOT": False, "PRECISION": "tf32"}
    else:
        kernel = picked_experts._combine_kernel
        types = _bf16_pointers("y_ptr", "res_ptr", "out_ptr") | {"weights_ptr": "*fp32", "squares_out_ptr": "*fp32"}
        types |= _i32("y_stride", "res_stride", "out_stride", "M", "N")
        constants = {"WIDTH": 8, "BLOCK_M": 32, "BLOCK_N": picked_experts.COMBINE_BLOCK_N}
    compile_for_h200(kernel, types, constants)
