"""Ingress CPU per streamed token: decoding the whole reply for each token against IncrementalDetokenizer (CPU only)."""

from __future__ import annotations

import argparse
import time

from transformers import AutoTokenizer

from omni_ray.bench import run_meta, write_results
from omni_ray.detokenizer import IncrementalDetokenizer
from omni_ray.models.qwen3_omni.checkpoint import ensure_default_checkpoint

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. "


def per_token_us(tokenizer: object, ids: list[int]) -> tuple[float, float]:
    start = time.perf_counter()
    for n in range(1, len(ids) + 1):
        tokenizer.decode(ids[:n], skip_special_tokens=True)  # type: ignore[attr-defined]
    whole = time.perf_counter() - start
    start = time.perf_counter()
    detokenizer = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detokenizer.push(token)
    incremental = time.perf_counter() - start
    return whole / len(ids) * 1e6, incremental / len(ids) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.detokenize_bench", description=__doc__)
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_checkpoint())
    corpus = tokenizer.encode(TEXT * 300, add_special_tokens=False)
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        whole, incremental = per_token_us(tokenizer, corpus[:length])
        rows.append({"reply_tokens": length, "whole_decode_us_per_token": round(whole, 1),
                     "incremental_us_per_token": round(incremental, 1)})
    meta = run_meta("benchmarks.detokenize_bench", argv, gpu="cpu")
    table = "\n".join([f"# Ingress detokenization per streamed token (CPU, {meta['date']})", "",
                       f"commit `{meta['commit']}`, command `{meta['command']}`", "",
                       "| reply tokens | whole-reply decode per token (µs) | incremental (µs) |", "|---|---|---|",
                       *[f"| {r['reply_tokens']} | {r['whole_decode_us_per_token']} | {r['incremental_us_per_token']} |"
                         for r in rows]]) + "\n"
    write_results(args.out, "detokenize", {"meta": meta, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
