"""Where the Talker's codes stop matching, on a GPU with the embedded checkpoint in bf16: graph replay against eager
steps, and two lanes stepping at once on their own streams against one after the other, for each engine variant
(the code predictor's kernels and the MoE expert kernels, on and off). Prints the first differing frame per request.

    python -m benchmarks.talker_divergence [--variants kernels,no-code-predictor-kernels,no-moe-kernels]
"""

from __future__ import annotations

import argparse
import threading
from contextlib import nullcontext
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3OmniMoeConfig

from omni_ray.engine.kv_cache import SlotKVCache
from omni_ray.engine.loop import run_to_end
from omni_ray.engine.sampler import SamplingParams
from omni_ray.models.qwen3_omni.checkpoint import ensure_default_checkpoint
from omni_ray.models.qwen3_omni.talker import TalkerRunner, TalkerSequence
from omni_ray.models.qwen3_omni.talker_model import load_talker
from omni_ray.models.qwen3_omni.thinker import ThinkerRunner, ThinkerSequence, load_thinker

PROMPTS = ("Hello there!", "Tell me a story about a dog.", "Hi", "What is the weather like today in the city?")
LENGTHS = (48, 40, 48, 24)
SERVED = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, seed=7)
VARIANTS = {"kernels": (True, True), "no-code-predictor-kernels": (False, True), "no-moe-kernels": (True, False)}


def think(checkpoint: Any, config: Any, device: str) -> tuple[list[ThinkerSequence], dict[str, list[Any]]]:
    """Greedy Thinker replies for the prompts, replayed from graphs with compiled layers."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tc = config.thinker_config.text_config
    runner = ThinkerRunner(load_thinker(checkpoint, config, device, torch.bfloat16), config,
                           SlotKVCache(tc.num_hidden_layers, 4, 256, tc.num_key_value_heads, tc.head_dim,
                                       torch.bfloat16, device), cuda_graphs=True, compile_layers=True)
    runner.warmup(4)
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        seqs.append(ThinkerSequence(f"r{i}", tokenizer.encode(text, add_special_tokens=False),
                                    SamplingParams(temperature=0.0), LENGTHS[i], frozenset(), for_talker=True))
        runner.admit(seqs[-1])
    outputs = run_to_end(runner, seqs)
    print("thinker graphs that failed to capture:", runner.graphs.uncapturable or "none")
    return seqs, outputs


def talker(config: Any, assets: Any, graphs: bool, variant: str, rows: int) -> TalkerRunner:
    """A warmed-up Talker runner with compiled layers (on CUDA) and `rows` KV slots over the shared `assets`."""
    code_predictor_kernels, moe_kernels = VARIANTS[variant]
    kc = config.talker_config.text_config
    runner = TalkerRunner(assets, config, SlotKVCache(kc.num_hidden_layers, rows, 512, kc.num_key_value_heads,
                                                      kc.head_dim, torch.bfloat16, assets.tts_pad.device),
                          rows, cuda_graphs=graphs, compile_layers=True,
                          code_predictor_kernels=code_predictor_kernels, moe_kernels=moe_kernels)
    runner.warmup(rows)
    return runner


def speak(runner: TalkerRunner, seqs: list[ThinkerSequence], outputs: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
    """Seeded served sampling (request i: seed 7 + i) until each request's frame count."""
    lengths = dict(zip([f"r{i}" for i in range(len(PROMPTS))], LENGTHS))
    speeches = []
    for seq in seqs:
        index = int(seq.request_id[1:])
        speech = TalkerSequence(seq.request_id, SERVED.model_copy(update={"seed": 7 + index}), 2302,
                                max_frames=lengths[seq.request_id])
        runner.admit(speech)
        speech.hear(outputs[seq.request_id])
        speeches.append(speech)
    return {request: [out.codes for out in outs if out.codes is not None]
            for request, outs in run_to_end(runner, speeches).items()}


def first_differences(a: dict[str, list[list[int]]], b: dict[str, list[list[int]]]) -> str:
    """Per request: equal, or the first frame (and code group) where the two runs differ."""
    notes = []
    for request in sorted(a):
        frames = next((i for i, (x, y) in enumerate(zip(a[request], b[request])) if x != y), None)
        if frames is None and len(a[request]) == len(b[request]):
            notes.append(f"{request} equal")
            continue
        if frames is None:
            notes.append(f"{request} lengths {len(a[request])} / {len(b[request])}")
            continue
        group = next(g for g, (x, y) in enumerate(zip(a[request][frames], b[request][frames])) if x != y)
        notes.append(f"{request} frame {frames} group {group}")
    return "; ".join(notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2, help="concurrent lane runs per variant")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (no graphs, no streams)")
    args = parser.parse_args(argv)
    checkpoint = ensure_default_checkpoint()
    config = Qwen3OmniMoeConfig.from_pretrained(checkpoint)
    seqs, outputs = think(checkpoint, config, args.device)
    for variant in args.variants.split(","):
        assets = load_talker(checkpoint, config, args.device, torch.bfloat16)
        eager = speak(talker(config, assets, False, variant, 4), seqs, outputs)
        replayed = speak(talker(config, assets, True, variant, 4), seqs, outputs)
        again = speak(talker(config, assets, True, variant, 4), seqs, outputs)
        print(f"[{variant}] graphs vs eager: {first_differences(replayed, eager)}")
        print(f"[{variant}] graphs vs graphs again: {first_differences(replayed, again)}")
        halves = (seqs[:2], seqs[2:])
        sequential: dict[str, list[list[int]]] = {}
        for half in halves:
            sequential.update(speak(talker(config, assets, True, variant, 2), half, outputs))
        for repeat in range(args.repeats):
            lanes = [talker(config, assets, True, variant, 2) for _ in halves]
            together: dict[str, list[list[int]]] = {}

            def run(lane: TalkerRunner, half: list[ThinkerSequence]) -> None:
                with torch.cuda.stream(torch.cuda.Stream()) if args.device == "cuda" else nullcontext():
                    together.update(speak(lane, half, outputs))

            threads = [threading.Thread(target=run, args=pair) for pair in zip(lanes, halves)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            print(f"[{variant}] lanes together ({repeat}) vs one after the other: "
                  f"{first_differences(together, sequential)}")
        print(f"[{variant}] lanes one after the other vs one batch of four: {first_differences(sequential, replayed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
