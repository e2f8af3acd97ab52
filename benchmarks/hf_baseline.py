"""transformers' generate() on full-size random-weight Qwen3-Omni: the non-streaming baseline of the speech
workload (a 100-token prompt, 128 text tokens, 400 Talker frames), batch 1 by default. Total time, seconds of audio,
RTF (time to first audio is the whole run). Use it as the reference the service is measured against;
`benchmarks/e2e_serve.py --baseline` runs it in a fresh process after the service.

    python -m benchmarks.hf_baseline --out DIR/hf_baseline.json     # one H200 (the whole model in bf16, ~70 GB)"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from omni_ray.bench import FULL_CONFIG, benchmark_prompt_ids


def run(batch: int, prompt: int, text_tokens: int, frames: int) -> dict[str, float]:
    config = Qwen3OmniMoeConfig.from_json_file(FULL_CONFIG)
    with torch.device("cuda"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.tensor([benchmark_prompt_ids(config, prompt)] * batch, device="cuda")
    kwargs = dict(thinker_max_new_tokens=text_tokens, thinker_eos_token_id=-1, talker_max_new_tokens=frames,
                  speaker="ethan", return_audio=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        _, audio = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    audio_s = audio.shape[-1] / 24000
    return {"batch": batch, "total_s": seconds, "audio_s": audio_s, "rtf": seconds / audio_s,
            "time_to_first_audio_s": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_baseline", description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args.batch, args.prompt, args.text_tokens, args.frames)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
