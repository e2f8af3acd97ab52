"""Profile one Thinker decode step (batch 1) of full-size Qwen3-Omni with random weights: where the time goes."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from omni_ray.bench import FULL_CONFIG
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker
from transformers import Qwen3OmniMoeConfig


def main() -> None:
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    text = config.thinker_config.text_config
    runner = ThinkerRunner(load_thinker(None, config, "cuda", torch.bfloat16), config,
                           SlotKVCache(text.num_hidden_layers, 1, 256, text.num_key_value_heads, text.head_dim, torch.bfloat16, "cuda"))
    ids = [config.im_start_token_id, config.user_token_id] + list(range(10, 104)) + [config.im_end_token_id,
           config.im_start_token_id, config.assistant_token_id, 198]
    seq = ThinkerSequence("p", ids, SamplingParams(temperature=0.0), 64, frozenset(), for_talker=True)
    runner.admit(seq)
    for _ in range(5):
        runner.step([seq])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.step([seq])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
