"""Compiled decoder layers are reusable from inductor's on-disk cache: a second process with the same cache directory
(what the helm chart's `compileCache` gives replicas on one node) compiles none of them again (CPU inductor here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def compile_and_step() -> None:
    """In a fresh process: a small MoE stack with compiled layers takes one decode step; prints inductor's FX graph
    cache counters and the seconds the step took (compiling included)."""
    from torch._dynamo.utils import counters

    from omni_ray.layers.attention import AttentionBatch
    from omni_ray.layers.decoder import DecoderSpec, DecoderStack

    spec = DecoderSpec(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
        mrope_section=None, intermediate_size=96, num_experts=8, top_k=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, always_moe=True,
    )
    torch.manual_seed(0)
    stack = DecoderStack(spec).eval()
    stack.compile_layers()
    start = time.perf_counter()
    with torch.inference_mode():
        caches = [(torch.zeros(3, 32, 2, 16), torch.zeros(3, 32, 2, 16)) for _ in range(2)]
        batch = AttentionBatch.from_tensors(torch.arange(2), torch.full((2,), 5), 1, 16, rows_are_slots=True)
        stack(torch.randn(2, 1, 64), torch.full((2, 1), 5), caches, batch)
    found = {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
    print(json.dumps({**found, "seconds": time.perf_counter() - start}))


def _in_a_new_process(cache_dir: Path) -> dict[str, float]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(ROOT)}
    code = "from tests.test_compile_cache import compile_and_step; compile_and_step()"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_every_compiled_layer_graph(tmp_path: Path) -> None:
    first, second = _in_a_new_process(tmp_path), _in_a_new_process(tmp_path)
    print(f"compile + step: {first['seconds']:.1f} s cold, {second['seconds']:.1f} s from the cache")
    assert first["fxgraph_cache_miss"] > 0 and first["fxgraph_cache_hit"] == 0
    assert first["fxgraph_cache_bypass"] == 0 and second["fxgraph_cache_bypass"] == 0  # nothing in a layer defeats it
    assert second["fxgraph_cache_hit"] == first["fxgraph_cache_miss"] and second["fxgraph_cache_miss"] == 0
