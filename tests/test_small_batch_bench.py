"""The GEMM sweep's shapes (`benchmarks/small_batch_bench.gemm_shapes`) are the served layers' own, and the launches
`matmul_config` picks for them are the sweep's winners."""

from __future__ import annotations

from transformers import Qwen3OmniMoeConfig

from benchmarks.small_batch_bench import gemm_shapes
from omni_ray.bench import FULL_CONFIG
from omni_ray.layers.small_batch import matmul_config


def test_the_sweep_takes_each_stages_served_gemm_shapes_once() -> None:
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    thinker = gemm_shapes(config, ["thinker"])
    # q/k/v: 32 query heads and 4 KV heads of 128 over 2,048; o back; the router's 128 experts. The norm-fused ones
    # read the partial sums their kernel ahead leaves: the combine's 64-column blocks, the o projection's blocks.
    assert thinker == {"thinker qkv (norm, partial squares)": (5120, 2048, "norm", 32),
                       "thinker o (residual, keeping squares)": (2048, 4096, "residual", 0),
                       "thinker router (norm, partial squares)": (128, 2048, "norm", 2048 // 32)}
    talker = gemm_shapes(config, ["talker"])
    assert talker["talker router (norm, partial squares)"][0] == 144  # 128 experts + the shared gate, padded to 16
    both = gemm_shapes(config, ["code_predictor", "talker"])
    assert "talker o (residual, keeping squares)" not in both  # the code predictor's o has its shape
    assert both["o (residual, keeping squares)"][:3] == talker["talker o (residual, keeping squares)"][:3]


def test_deep_gemms_take_the_sweeps_launches_and_the_code_predictors_keep_theirs() -> None:
    assert matmul_config(5120, 2048) == (64, 256, 3, 4, 1)  # the Thinker's q/k/v
    assert matmul_config(2048, 4096) == (32, 128, 3, 4, 4)  # its o
    assert matmul_config(128, 2048) == (32, 128, 3, 4, 8)  # its router
    assert matmul_config(1024, 2048) == matmul_config(1024, 3072) == (16, 128, 3, 4, 4)  # o, down
    assert matmul_config(4096, 1024) == (32, 256, 3, 4, 1)  # the code predictor's q/k/v
    assert matmul_config(144, 1024) == (16, 256, 3, 4, 1)  # the Talker's router
