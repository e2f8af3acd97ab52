"""Load generator for omni-ray's OpenAI-compatible API, closed-loop or Poisson arrivals: `python -m load_tests.loadgen --help`."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import aiohttp
from tqdm import tqdm

from load_tests.client import (AudioInput, chat_body, fetch_default_model, load_audio_input, load_prompts,
                               load_reference_audio, send_request, speech_body)
from load_tests.metrics import RequestRecord, aggregate
from load_tests.report import format_table, write_plots, write_results


@dataclass
class LoadConfig:
    """Everything one run needs; `model=None` means the first id from GET /v1/models."""

    url: str
    scenario: str
    concurrency: int
    requests: int
    max_tokens: int = 64
    prompt_file: str | None = None
    audio_in: str | None = None
    out_dir: str | None = None
    seed: int = 0
    timeout: float = 300.0
    model: str | None = None
    voice: str | None = "ethan"  # speech: None sends none (the model's own voice)
    temperature: float = 0.7
    ignore_eos: bool = False
    progress: bool = True
    plots: bool = True
    rate: float | None = None  # requests/s arriving as a Poisson process (open loop); None: closed loop
    max_new_tokens: int | None = None  # speech: the frame cap
    task_type: str | None = None  # speech, Qwen3-TTS: CustomVoice | Base | VoiceDesign
    language: str | None = None  # speech, Qwen3-TTS
    ref_audio: str | None = None  # speech, Qwen3-TTS Base: a reference clip's path, sent as base64 in every request
    ref_text: str | None = None  # its transcript (in-context cloning)


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """When each of `count` requests starts (seconds after the first), arriving as a Poisson process of `rate`
    requests a second: exponential gaps of mean 1/rate, drawn from `seed`."""
    if rate <= 0:
        raise ValueError(f"rate {rate} must be > 0")
    draw = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += draw.expovariate(rate)
        offsets.append(now)
    return offsets


def build_bodies(cfg: LoadConfig, model: str, prompts: Sequence[str], audio: AudioInput | None) -> list[dict[str, Any]]:
    """One request body per index: prompts in a seed-shuffled cycle; chat request i gets seed `cfg.seed + i`."""
    reference = load_reference_audio(cfg.ref_audio) if cfg.ref_audio else None
    order = list(prompts)
    random.Random(cfg.seed).shuffle(order)
    bodies = []
    for i in range(cfg.requests):
        prompt = order[i % len(order)]
        if cfg.scenario == "chat":
            bodies.append(chat_body(model, prompt, max_tokens=cfg.max_tokens, voice=cfg.voice or "ethan",
                                    temperature=cfg.temperature, seed=cfg.seed + i, audio=audio,
                                    ignore_eos=cfg.ignore_eos))
        else:
            bodies.append(speech_body(model, prompt, voice=None if reference else cfg.voice,
                                      max_new_tokens=cfg.max_new_tokens, ignore_eos=cfg.ignore_eos,
                                      task_type=cfg.task_type, language=cfg.language, ref_audio=reference,
                                      ref_text=cfg.ref_text))
    return bodies


async def run_load(cfg: LoadConfig) -> tuple[str, list[RequestRecord], float]:
    """Keep `cfg.concurrency` requests in flight until `cfg.requests` are done, or (`cfg.rate`) start them at
    Poisson arrivals whatever is in flight; return (model, records, wall s)."""
    url = cfg.url.rstrip("/")
    prompts = load_prompts(cfg.prompt_file)
    audio = load_audio_input(cfg.audio_in) if cfg.audio_in else None
    connector = aiohttp.TCPConnector(limit=0 if cfg.rate else cfg.concurrency)  # open loop: no cap on connections
    async with aiohttp.ClientSession(connector=connector) as session:
        model = cfg.model or await fetch_default_model(session, url, min(cfg.timeout, 30.0))
        bodies = build_bodies(cfg, model, prompts, audio)
        records: list[RequestRecord] = []
        indices = itertools.count()
        bar = tqdm(total=cfg.requests, file=sys.stderr, disable=not cfg.progress, unit="req",
                   desc=f"{cfg.scenario} " + (f"{cfg.rate:g} req/s" if cfg.rate else f"c={cfg.concurrency}"))
        run_start = time.perf_counter()

        async def one(i: int) -> None:
            rec = await send_request(session, url, cfg.scenario, bodies[i], index=i, run_start=run_start,
                                     timeout=cfg.timeout)
            records.append(rec)
            bar.update(1)
            if not rec.ok:
                bar.set_postfix(errors=sum(1 for r in records if not r.ok), refresh=False)

        async def worker() -> None:
            while (i := next(indices)) < cfg.requests:
                await one(i)

        async def arrival(i: int, offset: float) -> None:
            await asyncio.sleep(max(0.0, run_start + offset - time.perf_counter()))
            await one(i)

        try:
            if cfg.rate:
                await asyncio.gather(*(arrival(i, offset) for i, offset in
                                       enumerate(poisson_offsets(cfg.rate, cfg.requests, cfg.seed))))
            else:
                await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, cfg.requests))))
        finally:
            bar.close()
        wall = time.perf_counter() - run_start
    return model, sorted(records, key=lambda r: r.index), wall


def default_out_dir() -> Path:
    """load_results/<local timestamp>/, with a numeric suffix if that already exists."""
    base = Path("load_results") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def parse_args(argv: Sequence[str] | None) -> LoadConfig:
    """CLI flags -> LoadConfig."""
    ap = argparse.ArgumentParser(prog="python -m load_tests.loadgen", description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="service base URL")
    ap.add_argument("--scenario", choices=("chat", "speech"), default="chat",
                    help="chat: streaming text+audio chat completions; speech: streaming /v1/audio/speech PCM")
    ap.add_argument("--concurrency", type=int, default=1, help="requests kept in flight (closed loop)")
    ap.add_argument("--rate", type=float, help="open loop: requests a second, arriving as a Poisson process "
                    "(seeded by --seed) whatever is in flight, instead of --concurrency")
    ap.add_argument("--requests", type=int, default=10, help="total requests to send")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_completion_tokens (chat)")
    ap.add_argument("--prompt-file", help="prompts, one per line (default: built-in varied prompts)")
    ap.add_argument("--audio-in", help="audio clip sent as an input_audio part with every chat request")
    ap.add_argument("--out-dir", help="results directory (default: load_results/<timestamp>/)")
    ap.add_argument("--seed", type=int, default=0, help="prompt-order shuffle seed; chat request i gets seed+i")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    ap.add_argument("--model", help="model id (default: first id from GET /v1/models)")
    ap.add_argument("--voice", default="ethan")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (chat)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="omni-ray extension: replies run to max tokens and the Talker's frame cap (speech: to "
                    "--max-new-tokens)")
    ap.add_argument("--max-new-tokens", type=int, help="speech: the frame cap (12.5 frames a second)")
    ap.add_argument("--task-type", choices=("CustomVoice", "Base", "VoiceDesign"), help="speech, Qwen3-TTS")
    ap.add_argument("--language", help="speech, Qwen3-TTS: auto or one of the model's languages")
    ap.add_argument("--ref-audio", help="speech, Qwen3-TTS Base: a reference clip sent (base64) with every request; "
                    "without it, --voice names a stored voice")
    ap.add_argument("--ref-text", help="speech, Qwen3-TTS Base: the reference's transcript (in-context cloning)")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    a = ap.parse_args(argv)
    if a.concurrency < 1 or a.requests < 1:
        ap.error("--concurrency and --requests must be >= 1")
    if a.timeout <= 0 or a.max_tokens < 1:
        ap.error("--timeout must be > 0 and --max-tokens >= 1")
    if a.audio_in and a.scenario != "chat":
        ap.error("--audio-in only applies to --scenario chat")
    if a.rate is not None and a.rate <= 0:
        ap.error("--rate must be > 0")
    speech_only = ("max_new_tokens", "task_type", "language", "ref_audio", "ref_text")
    if a.scenario != "speech" and any(getattr(a, name) is not None for name in speech_only):
        ap.error("--max-new-tokens, --task-type, --language, --ref-audio and --ref-text only apply to --scenario speech")
    return LoadConfig(url=a.url, scenario=a.scenario, concurrency=a.concurrency, requests=a.requests,
                      max_tokens=a.max_tokens, prompt_file=a.prompt_file, audio_in=a.audio_in, out_dir=a.out_dir,
                      seed=a.seed, timeout=a.timeout, model=a.model, voice=a.voice, temperature=a.temperature,
                      ignore_eos=a.ignore_eos, progress=not a.no_progress, plots=not a.no_plots, rate=a.rate,
                      max_new_tokens=a.max_new_tokens, task_type=a.task_type, language=a.language,
                      ref_audio=a.ref_audio, ref_text=a.ref_text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a load test, print the table and write the results.

    Exit status: 0 if any request succeeded, 1 if none did, 2 if setup failed (e.g. GET /v1/models).
    """
    cfg = parse_args(argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir()
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        model, records, wall = asyncio.run(run_load(cfg))
    except (OSError, ValueError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        print(f"loadgen: setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    summary: dict[str, Any] = {"started_at": started_at, "model": model,
                               "config": {k: v for k, v in asdict(cfg).items() if k not in ("progress", "plots")},
                               **aggregate(records, wall)}
    summary["config"]["out_dir"] = str(out_dir)
    files = write_results(out_dir, summary, records)
    if cfg.plots:
        try:
            level = f"{cfg.rate:g} req/s" if cfg.rate else f"c={cfg.concurrency}"
            files += write_plots(out_dir, records, title=f"{cfg.scenario} {level} n={cfg.requests}")
        except ImportError as exc:
            print(f"loadgen: plots skipped ({exc})", file=sys.stderr)
    print(format_table(summary))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
