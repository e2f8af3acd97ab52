"""The official, non-streaming baselines on the same GPU, batch 1, with full-size random weights: transformers'
generate() on Qwen3-Omni (the speech workload: a 100-token prompt, 128 text tokens, 400 Talker frames), or with
`--family qwen3_tts` the official `qwen-tts` package's generate_custom_voice / generate_voice_clone (workload T: the
text, 75 frames, EOS ignored; Base with a fresh reference each call and with a prompt made once). Total time, seconds
of audio, RTF; time to first audio is the whole run. `benchmarks/e2e_serve.py --baseline` (`--tts-baseline`) runs it
in a fresh process after the service.

    python -m benchmarks.hf_baseline --out DIR/hf_baseline.json     # one H200 (the whole model in bf16, ~70 GB)
    PYTHONPATH=/tmp/qwen_site:$PWD python -m benchmarks.hf_baseline --family qwen3_tts --variant base --size 1b7 \
        --out DIR/official_base.json   # qwen-tts 0.1.1 and transformers 4.57.3 in /tmp/qwen_site (docs/gpu.md)

Qwen3-TTS writes a full-size random checkpoint in the official layout first (`--checkpoint-dir`, kept; `--size tiny`:
the tiny checkpoint, for a check on CPU). It imports only torch, the official package and the checkpoint writer, so
it runs beside transformers 4.57.3 without the service's packages."""

from __future__ import annotations

import argparse
import json
import statistics
import time
import wave
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
TTS_CONFIGS = HERE.parent / "omni_ray" / "models" / "qwen3_tts" / "configs"
REFERENCE = HERE.parent / "tests" / "goldens" / "qwen3_tts" / "reference.wav"
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
SAMPLE_RATE = 24000


def run(batch: int, prompt: int, text_tokens: int, frames: int) -> dict[str, float]:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omni_ray.bench import FULL_CONFIG, benchmark_prompt_ids

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


def read_wav(path: Path) -> tuple[Any, int]:
    """A 16-bit mono WAV as float32 samples and its rate (no audio library needed)."""
    import numpy as np

    with wave.open(str(path)) as clip:
        samples = np.frombuffer(clip.readframes(clip.getnframes()), dtype=np.int16).astype(np.float32) / 32768
        return samples, clip.getframerate()


def official_tts_model(variant: str, size: str, checkpoint_dir: Path | None, device: str) -> Any:
    """The official package's model on a random checkpoint of `variant` at `size` (1b7 | 0b6 | tiny), its EOS
    never sampled: the codec EOS id set to -1 puts the real one among the suppressed control ids, and generation
    runs to max_new_tokens."""
    from qwen_tts import Qwen3TTSModel

    from omni_ray.models.qwen3_tts.checkpoint import ensure_tiny_checkpoint, make_random_checkpoint

    if size == "tiny":
        directory, dtype = ensure_tiny_checkpoint(variant), torch.float32
    else:
        directory = make_random_checkpoint(checkpoint_dir or Path(f"/tmp/qwen3_tts_random_{size}_{variant}"),
                                           TTS_CONFIGS / f"qwen3_tts_12hz_{size}_{variant}.json",
                                           TTS_CONFIGS / "speech_tokenizer_12hz.json", device=device)
        dtype = torch.bfloat16
    model = Qwen3TTSModel.from_pretrained(str(directory), device_map=device, dtype=dtype)
    for config in {id(c): c for c in (model.model.config.talker_config, model.model.talker.config)}.values():
        config.codec_eos_token_id = -1
    return model


def run_official_tts(variant: str, size: str, text: str, frames: int, runs: int, checkpoint_dir: Path | None,
                     device: str) -> dict[str, Any]:
    """Workload T through `qwen-tts` at batch 1: one warm-up call, then `runs` timed calls of each case (median)."""
    model = official_tts_model(variant, size, checkpoint_dir, device)
    common = {"text": text, "language": "english", "max_new_tokens": frames + 1}  # n steps give n - 1 frames
    if variant == "custom_voice":
        cases = {"custom_voice": lambda: model.generate_custom_voice(speaker="vivian", **common)}
    else:
        reference = read_wav(REFERENCE)
        prompt = model.create_voice_clone_prompt(ref_audio=reference, ref_text=REFERENCE_TEXT)
        cases = {"base_fresh": lambda: model.generate_voice_clone(ref_audio=reference, ref_text=REFERENCE_TEXT, **common),
                 "base_cached": lambda: model.generate_voice_clone(voice_clone_prompt=prompt, **common)}
    results: dict[str, Any] = {"variant": variant, "size": size, "frames": frames, "device": device,
                               "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "cases": {}}
    for name, call in cases.items():
        call()  # warm-up
        times, audio = [], 0.0
        for _ in range(runs):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            wavs, rate = call()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            audio = len(wavs[0]) / rate
        total = statistics.median(times)
        results["cases"][name] = {"total_s": total, "runs_s": times, "audio_s": audio, "rtf": total / audio,
                                  "audio_s_per_s": audio / total, "time_to_first_audio_s": total}
        print(name, json.dumps(results["cases"][name]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_baseline", description=__doc__)
    parser.add_argument("--family", choices=("qwen3_omni", "qwen3_tts"), default="qwen3_omni")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=100)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument("--frames", type=int, help="Talker frames (default: 400 Qwen3-Omni, 75 Qwen3-TTS)")
    parser.add_argument("--variant", choices=("custom_voice", "base"), default="custom_voice", help="Qwen3-TTS")
    parser.add_argument("--size", choices=("1b7", "0b6", "tiny"), default="1b7", help="Qwen3-TTS")
    parser.add_argument("--text", help="Qwen3-TTS: the text (default: workload T's)")
    parser.add_argument("--runs", type=int, default=3, help="Qwen3-TTS: timed calls of each case, after a warm-up")
    parser.add_argument("--checkpoint-dir", type=Path, help="Qwen3-TTS: where the random checkpoint is written")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.family == "qwen3_tts":
        text = args.text or ("The quiet harbour woke slowly as fishing boats returned with the tide, gulls circling "
                             "above the nets while old sailors traded stories about storms, lost anchors and the long "
                             "winter ahead.")  # workload T's (benchmarks/tts_e2e/workloads.py)
        result = run_official_tts(args.variant, args.size, text, args.frames or 75, args.runs, args.checkpoint_dir,
                                  args.device)
    else:
        result = run(args.batch, args.prompt, args.text_tokens, args.frames or 400)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
