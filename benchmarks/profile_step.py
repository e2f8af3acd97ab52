"""Profile graph-replayed Thinker and Talker(+MTP) steps of full-size Qwen3-Omni (random weights): GPU kernels by time."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3OmniMoeConfig

from omni_ray.bench import DEFAULT_TALKER_SAMPLING, FULL_CONFIG, GREEDY_TALKER, _talker_seqs, benchmark_prompt_ids
from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.talker import TalkerRunner, load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker


def _profile(name: str, runner: Any, seqs: list[Any], graphs: bool) -> None:
    for seq in seqs:
        runner.admit(seq)
    for _ in range(5):
        runner.step(seqs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.step(seqs)
        torch.cuda.synchronize()
    for seq in seqs:
        runner.release(seq)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events) / 3
    gpu_ms = sum(e.self_device_time_total for e in events) / 3 / 1000
    print(f"## {name}, batch {len(seqs)}, {'graphs' if graphs else 'eager'}: {gpu_ms:.2f} ms GPU time and {kernels:.0f} kernels per step")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70))
    sys.stdout.flush()


def main() -> None:
    compiled = "--compile" in sys.argv[1:]  # fuse each decoder layer with torch.compile
    served = "--served" in sys.argv[1:]  # the Talker samples as the service does (top-k 50; MTP top-k 50 / top-p 0.8)
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    text = config.thinker_config.text_config
    thinker = ThinkerRunner(load_thinker(None, config, "cuda", torch.bfloat16), config,
                            SlotKVCache(text.num_hidden_layers, 32, 2048, text.num_key_value_heads, text.head_dim, torch.bfloat16, "cuda"),
                            compile_layers=compiled)
    for batch in (1, 32):
        seqs = [ThinkerSequence(f"p{i}", benchmark_prompt_ids(config, 100), SamplingParams(temperature=0.0), 64, frozenset(), for_talker=True)
                for i in range(batch)]
        _profile("thinker decode", thinker, seqs, True)
    del thinker
    torch.cuda.empty_cache()
    talker_text = config.talker_config.text_config
    talker = TalkerRunner(load_talker(None, config, "cuda", torch.bfloat16), config,
                          SlotKVCache(talker_text.num_hidden_layers, 32, 2048, talker_text.num_key_value_heads, talker_text.head_dim,
                                      torch.bfloat16, "cuda"), 32, compile_layers=compiled)
    for batch in (1, 32):
        sampling = DEFAULT_TALKER_SAMPLING if served else GREEDY_TALKER
        _profile(f"talker decode + frame ({'served' if served else 'greedy'} sampling)", talker,
                 _talker_seqs(config, batch, 100, 20, sampling), True)


if __name__ == "__main__":
    main()
