"""Run by the official package's venv: write Qwen3-TTS golden outputs (greedy codes, waveforms, prompt layouts)
for the tiny checkpoints of one seed. Usage: make_goldens.py --seed N --out DIR [--project-python PY]."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from qwen_tts import Qwen3TTSModel
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
REFERENCE_WAV = HERE / "reference.wav"
REFERENCE_TEXT = "The morning was cold, so I made a pot of tea."
TEXT = "Good evening. Please take a seat by the window."
MAX_NEW_TOKENS = 10  # talker steps: without EOS, 10 steps give 9 frames
GREEDY: dict[str, Any] = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": MAX_NEW_TOKENS}

# (name, variant, official call arguments). Each runs in both prompt forms (non_streaming_mode False / True).
CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("custom_voice_speaker", "custom_voice", {"speaker": "ryan", "language": "english", "instruct": None}),
    ("custom_voice_instruct", "custom_voice",
     {"speaker": "vivian", "language": "auto", "instruct": "Speak slowly, in a warm and friendly tone."}),
    ("custom_voice_dialect", "custom_voice", {"speaker": "eric", "language": "chinese", "instruct": None}),
    ("voice_design", "voice_design", {"language": "english", "instruct": "A calm, deep male voice."}),
    ("base_in_context", "base", {"language": "english", "ref_text": REFERENCE_TEXT, "x_vector_only_mode": False}),
    ("base_x_vector_only", "base", {"language": "auto", "ref_text": None, "x_vector_only_mode": True}),
)


class Spy:
    """Wraps the model's generate and its talker's generate to capture ids, prompts and codes of one call."""

    def __init__(self, tts: Qwen3TTSModel) -> None:
        self.tts = tts
        self.seen: dict[str, Any] = {}
        model = tts.model
        outer, inner = model.generate, model.talker.generate

        def outer_spy(*args: Any, **kwargs: Any) -> Any:
            self.seen["outer_kwargs"] = kwargs
            result = outer(*args, **kwargs)
            self.seen["codes"] = result[0]
            return result

        def inner_spy(*args: Any, **kwargs: Any) -> Any:
            self.seen["inputs_embeds"] = kwargs["inputs_embeds"].detach().clone()
            self.seen["trailing_text_hidden"] = kwargs["trailing_text_hidden"].detach().clone()
            result = inner(*args, **kwargs)
            self.seen["steps"] = len(result.hidden_states)
            self.seen["last_token"] = int(result.sequences[0, -1])
            return result

        model.generate = outer_spy
        model.talker.generate = inner_spy


def _ids(tensor: torch.Tensor | None) -> list[int] | None:
    return None if tensor is None else [int(x) for x in tensor.reshape(-1).tolist()]


def prompt_layout(config: Any, kw: dict[str, Any], speaker: str | None, language: str,
                  ref_code: torch.Tensor | None, non_streaming: bool) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The prefill positions and the trailing text as ids, following the official prompt rules.

    A position's embedding is text_projection(text_embedding(text)) [text] + codec_embedding(codec) [codec]
    + the x-vector [x_vector] + the sum of the 16 groups' embeddings of reference frame ref_frame [ref_frame].
    A trailing entry is a text id (its projection is added to the decode step's input), None marks the end."""
    talker = config.talker_config
    input_ids, instruct = _ids(kw["input_ids"][0]), kw.get("instruct_ids")
    positions: list[dict[str, Any]] = []
    if instruct is not None and instruct[0] is not None:
        positions += [{"text": t} for t in _ids(instruct[0])]
    positions += [{"text": t} for t in input_ids[:3]]
    language_id = None if language.lower() == "auto" else talker.codec_language_id[language.lower()]
    if language.lower() in ("chinese", "auto") and speaker and talker.spk_is_dialect[speaker.lower()]:
        language_id = talker.codec_language_id[talker.spk_is_dialect[speaker.lower()]]
    if language_id is None:
        prefix: list[dict[str, Any]] = [{"codec": c} for c in
                                         (talker.codec_nothink_id, talker.codec_think_bos_id, talker.codec_think_eos_id)]
    else:
        prefix = [{"codec": c} for c in (talker.codec_think_id, talker.codec_think_bos_id, language_id,
                                         talker.codec_think_eos_id)]
    voice = kw.get("voice_clone_prompt")
    if voice is not None:
        if voice["x_vector_only_mode"][0] or voice["icl_mode"][0]:
            prefix.append({"x_vector": True})
    elif speaker:
        spk = talker.spk_id[speaker.lower()]
        prefix.append({"codec": int(spk[0] if isinstance(spk, list) else spk)})
    prefix += [{"codec": talker.codec_pad_id}, {"codec": talker.codec_bos_id}]
    texts = [config.tts_pad_token_id] * (len(prefix) - 2) + [config.tts_bos_token_id]
    positions += [{**p, "text": t} for p, t in zip(prefix[:-1], texts)]
    body, pad, eos = input_ids[3:-5], config.tts_pad_token_id, config.tts_eos_token_id
    bos, codec_pad = talker.codec_bos_id, talker.codec_pad_id
    if voice is not None and voice["icl_mode"][0]:
        text = _ids(kw["ref_ids"][0])[3:-2] + body + [eos]
        codec: list[dict[str, Any]] = [{"codec": bos}] + [{"ref_frame": t} for t in range(ref_code.shape[0])]
        if non_streaming:
            positions += [{"text": t, "codec": codec_pad} for t in text] + [{**c, "text": pad} for c in codec]
            return positions, [pad]
        if len(text) > len(codec):
            positions += [{**c, "text": t} for c, t in zip(codec, text)]
            return positions, text[len(codec):]
        text = text + [pad] * (len(codec) - len(text))
        positions += [{**c, "text": t} for c, t in zip(codec, text)]
        return positions, [pad]
    if non_streaming:
        positions += [{"text": t, "codec": codec_pad} for t in body + [eos]] + [{"text": pad, "codec": bos}]
        return positions, [pad]
    positions.append({"text": body[0], "codec": bos})
    return positions, body[1:] + [eos]


@torch.no_grad()
def embed_layout(tts: Qwen3TTSModel, positions: list[dict[str, Any]], x_vector: torch.Tensor | None,
                 ref_code: torch.Tensor | None) -> torch.Tensor:
    """The prefill embeddings the layout describes, computed from the model's own weights."""
    talker = tts.model.talker
    rows = []
    for p in positions:
        row = torch.zeros(talker.config.hidden_size)
        if p.get("text") is not None:
            row += talker.text_projection(talker.get_text_embeddings()(torch.tensor([[p["text"]]])))[0, 0]
        if p.get("codec") is not None:
            row += talker.get_input_embeddings()(torch.tensor([p["codec"]]))[0]
        if p.get("x_vector"):
            row += x_vector.reshape(-1).float()
        if p.get("ref_frame") is not None:
            frame = ref_code[p["ref_frame"]]
            row += talker.get_input_embeddings()(frame[:1])[0]
            for g in range(1, frame.shape[0]):
                row += talker.code_predictor.get_input_embeddings()[g - 1](frame[g:g + 1])[0]
        rows.append(row)
    return torch.stack(rows)


def run_case(tts: Qwen3TTSModel, spy: Spy, name: str, variant: str, args: dict[str, Any],
             non_streaming: bool) -> tuple[dict[str, Any], np.ndarray]:
    """One official generate_* call under greedy decoding; its record and its waveform."""
    spy.seen.clear()
    record: dict[str, Any] = {"name": name, "variant": variant, "text": TEXT, "non_streaming_mode": non_streaming,
                              "generation": {**GREEDY, **{k: v for k, v in tts.generate_defaults.items()
                                                          if k not in GREEDY}}}
    ref_code = x_vector = None
    if variant == "custom_voice":
        wavs, rate = tts.generate_custom_voice(TEXT, speaker=args["speaker"], language=args["language"],
                                               instruct=args["instruct"], non_streaming_mode=non_streaming, **GREEDY)
        record.update(speaker=args["speaker"], language=args["language"], instruct=args["instruct"])
    elif variant == "voice_design":
        wavs, rate = tts.generate_voice_design(TEXT, instruct=args["instruct"], language=args["language"],
                                               non_streaming_mode=non_streaming, **GREEDY)
        record.update(language=args["language"], instruct=args["instruct"])
    else:
        prompt = tts.create_voice_clone_prompt(ref_audio=str(REFERENCE_WAV), ref_text=args["ref_text"],
                                               x_vector_only_mode=args["x_vector_only_mode"])[0]
        wavs, rate = tts.generate_voice_clone(TEXT, language=args["language"], voice_clone_prompt=[prompt],
                                              non_streaming_mode=non_streaming, **GREEDY)
        x_vector = prompt.ref_spk_embedding.float()
        ref_code = prompt.ref_code
        record.update(language=args["language"], ref_text=args["ref_text"],
                      x_vector_only_mode=args["x_vector_only_mode"],
                      reference={"file": REFERENCE_WAV.name,
                                 "sha256": hashlib.sha256(REFERENCE_WAV.read_bytes()).hexdigest()},
                      x_vector=[float(v) for v in x_vector.tolist()],
                      ref_codes=None if ref_code is None else ref_code.tolist())
    assert rate == 24000
    kw = spy.seen["outer_kwargs"]
    codes = spy.seen["codes"][0]
    positions, trailing = prompt_layout(tts.model.config, kw, record.get("speaker"), record["language"],
                                        ref_code, non_streaming)
    rebuilt = embed_layout(tts, positions, x_vector, ref_code)
    captured = spy.seen["inputs_embeds"][0]
    if rebuilt.shape != captured.shape:
        raise RuntimeError(f"{name}: layout has {rebuilt.shape[0]} positions, the official prompt {captured.shape[0]}")
    trailing_rebuilt = embed_layout(tts, [{"text": t} for t in trailing], None, None)
    trailing_captured = spy.seen["trailing_text_hidden"][0]
    wav = np.asarray(wavs[0], dtype=np.float32)
    eos = tts.model.config.talker_config.codec_eos_token_id
    record.update(
        input_ids=_ids(kw["input_ids"][0]),
        instruct_ids=_ids((kw.get("instruct_ids") or [None])[0]),
        ref_ids=_ids((kw.get("ref_ids") or [None])[0]),
        prompt=positions,
        trailing_text=trailing,
        prompt_check_max_abs_diff=float((rebuilt - captured).abs().max()),
        trailing_check_max_abs_diff=float((trailing_rebuilt - trailing_captured).abs().max()),
        talker_steps=int(spy.seen["steps"]),
        finish_reason="stop" if spy.seen["last_token"] == eos else "length",
        codes=codes.tolist(),
        frames=int(codes.shape[0]),
        waveform_samples=int(wav.shape[0]),
        waveform_rms=float(np.sqrt(np.mean(wav.astype(np.float64) ** 2))),
    )
    if ref_code is not None:  # in-context clone: the reference and generated codes decode together, then the cut
        total = ref_code.shape[0] + codes.shape[0]
        record["ref_cut_samples"] = int(ref_code.shape[0] / total * (total * 1920))
    if max(record["prompt_check_max_abs_diff"], record["trailing_check_max_abs_diff"]) > 1e-5:
        raise RuntimeError(f"{name}: the layout does not rebuild the official prompt: {record}")
    return record, wav


def ensure_checkpoints(root: Path, seed: int, project_python: str) -> dict[str, Path]:
    """The tiny checkpoints of ``seed``, made by the project's own ``omni-ray make-tiny``."""
    dirs = {}
    for variant in ("base", "custom_voice", "voice_design"):
        out = root / f"{variant}-seed{seed}"
        subprocess.run([project_python, "-m", "omni_ray.cli", "make-tiny", "--family", "qwen3_tts", "--variant",
                        variant, "--seed", str(seed), "--out", str(out)], check=True, cwd=REPO_ROOT)
        dirs[variant] = out
    return dirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True, help="directory for cases.json and waveforms.safetensors")
    parser.add_argument("--project-python", default=str(REPO_ROOT.parent / "venv-c" / "bin" / "python"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # one reduction order, so reruns give the same bits
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qwen3-tts-goldens-") as scratch:
        dirs = ensure_checkpoints(Path(scratch), args.seed, args.project_python)
        records, waves = [], {}
        for variant, directory in dirs.items():
            tts = Qwen3TTSModel.from_pretrained(str(directory), dtype=torch.float32)
            spy = Spy(tts)
            for name, case_variant, case_args in CASES:
                if case_variant != variant:
                    continue
                for non_streaming in (False, True):
                    key = f"{name}-{'non_streaming' if non_streaming else 'streaming'}"
                    record, wav = run_case(tts, spy, name, variant, case_args, non_streaming)
                    records.append({"key": key, **record})
                    waves[key] = torch.from_numpy(wav)
    order = [f"{n}-{m}" for n, _, _ in CASES for m in ("streaming", "non_streaming")]
    records.sort(key=lambda r: order.index(r["key"]))
    document = {"seed": args.seed, "qwen_tts": "0.1.1", "sample_rate": 24000, "samples_per_frame": 1920,
                "cases": records}
    (out / "cases.json").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    save_file({k: waves[k].contiguous() for k in order}, str(out / "waveforms.safetensors"))
    print(json.dumps({r["key"]: [r["frames"], r["finish_reason"], round(r["waveform_rms"], 4)] for r in records}))


if __name__ == "__main__":
    main()
