"""The `omni-ray` command line, run as a user would: make-tiny, and generate writing a wav."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import soundfile as sf
from transformers import AutoTokenizer

from _reference import wav_part


def _run(args: list[str], env: dict[str, str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_ray.cli", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path: Path, tiny_checkpoint: Path) -> None:
    out = tmp_path / "tiny"
    result = _run(["make-tiny", "--out", str(out), "--seed", "0"])
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("<|im_end|>") is not None


def test_generate_streams_text_and_writes_audio(tmp_path: Path, ray_cluster: str, pipeline: Any) -> None:
    audio_in = tmp_path / "question.wav"
    audio_in.write_bytes(base64.b64decode(wav_part(1.2, 22050, 2, seed=1)["input_audio"]["data"]))
    reply = tmp_path / "reply.wav"
    result = _run(
        ["generate", "--text", "Describe this.", "--audio", str(audio_in), "--out", str(reply), "--greedy",
         "--max-tokens", "12", "--max-audio-frames", "6"],
        env={"RAY_ADDRESS": ray_cluster},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finish_reason=length" in result.stderr
    samples, rate = sf.read(reply)
    assert rate == 24000 and len(samples) == 6 * 1920 - 555
    assert abs(samples).max() > 0
    # The printed text is the greedy reply the Python API gives for the same request.
    import asyncio

    from _reference import run_pipeline

    messages = [{"role": "user", "content": [wav_part(1.2, 22050, 2, seed=1), {"type": "text", "text": "Describe this."}]}]
    expected = asyncio.run(run_pipeline(pipeline, messages, max_tokens=12, max_frames=6))
    text = pipeline.tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert result.stdout.strip("\n") == text.strip("\n")
