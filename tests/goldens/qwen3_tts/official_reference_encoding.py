"""Runs inside the official qwen-tts venv: reference codes and x-vectors of clips, as `create_voice_clone_prompt` gives.

Usage: python official_reference_encoding.py CHECKPOINT IN.npz OUT.npz [DTYPE]  (float32 unless bfloat16 is named)
IN.npz holds `wave_<i>` (float32 [samples]) and `rate_<i>` for i in 0..count-1, plus `batched` (0 or 1: one call
for all clips, else one call per clip). OUT.npz gets `codes_<i>` [T, 16] int64 and `x_vector_<i>` [enc_dim] float32."""

from __future__ import annotations

import sys

import numpy as np
import torch


def main(checkpoint: str, in_path: str, out_path: str, dtype: str = "float32") -> None:
    from qwen_tts import Qwen3TTSModel

    data = np.load(in_path)
    count = sum(1 for key in data.files if key.startswith("wave_"))
    clips = [(data[f"wave_{i}"].astype(np.float32), int(data[f"rate_{i}"])) for i in range(count)]
    model = Qwen3TTSModel.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    if int(data["batched"]):
        items = model.create_voice_clone_prompt(ref_audio=clips, ref_text=["reference"] * count, x_vector_only_mode=False)
    else:
        items = [model.create_voice_clone_prompt(ref_audio=clip, ref_text="reference", x_vector_only_mode=False)[0]
                 for clip in clips]
    out: dict[str, np.ndarray] = {}
    for i, item in enumerate(items):
        out[f"codes_{i}"] = item.ref_code.detach().cpu().to(torch.int64).numpy()
        out[f"x_vector_{i}"] = item.ref_spk_embedding.detach().cpu().to(torch.float32).numpy()
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
