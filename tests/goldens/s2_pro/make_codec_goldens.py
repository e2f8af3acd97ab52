"""Run by the fish-speech venv (the official source on PYTHONPATH, see make_venv.sh): write the official S2 Pro codec's
codes of the reference clip and its one-shot waveform of a fixed code matrix, on the tiny codec of one seed.

Usage: make_codec_goldens.py --seed N --out FILE.npz --project-python PY [--checkpoint DIR]
       make_codec_goldens.py --full-layout FILE.json

`--full-layout` writes the released codec's tensors (key → shape, without the `generator.` prefix) as the official
hydra config builds them, on the meta device (no weights: the released ones are not needed).

The tiny checkpoint (its `codec.pth` in the official layout and `codec_config.json`) is written by the project's own
`omni_ray.models.s2_pro.checkpoint.write_tiny_checkpoint`, run by the project's python, unless `--checkpoint` names
one already written. The codec loads through the official `load_codec_model` with the official hydra config
(`modded_dac_vq.yaml`) set to the tiny geometry. The reference clip is `tests/goldens/qwen3_tts/reference.wav`
(eSpeak NG speech at 24 kHz) resampled to 44.1 kHz by the project's `omni_ray.audio.resample`, run by the project's
python. The official code is only imported here, never copied."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import omegaconf
import torch

from hydra.utils import instantiate

from fish_speech.models.text2semantic import inference
from fish_speech.models.text2semantic.inference import load_codec_model

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
FISH_SPEECH_COMMIT = "3dd1f85"
CONFIG = Path(inference.__file__).parents[2] / "configs" / "modded_dac_vq.yaml"  # the file load_codec_model reads
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "codec.pth",
                    "codec_config.json")
FIXED_FRAMES = 20
REFERENCE_WAV = REPO_ROOT / "tests" / "goldens" / "qwen3_tts" / "reference.wav"
# The project's python reads and resamples the clip (tests/test_s2_pro_codec.py's `reference_audio` does the same).
REFERENCE_CODE = ("import sys, numpy as np, soundfile as sf; from omni_ray.audio import resample; "
                  "audio, rate = sf.read(sys.argv[1], dtype='float32', always_2d=True); "
                  "np.save(sys.argv[2], resample(audio.mean(axis=1), rate, 44100).astype(np.float32))")


def write_checkpoint(project_python: str, seed: int, out_dir: Path) -> Path:
    code = ("import sys; from pathlib import Path; "
            "from omni_ray.models.s2_pro.checkpoint import write_tiny_checkpoint; "
            "write_tiny_checkpoint(Path(sys.argv[1]), int(sys.argv[2]))")
    subprocess.run([project_python, "-c", code, str(out_dir), str(seed)], cwd=REPO_ROOT, check=True)
    return out_dir


def reference_audio(project_python: str, out: Path) -> np.ndarray:
    subprocess.run([project_python, "-c", REFERENCE_CODE, str(REFERENCE_WAV), str(out)], cwd=REPO_ROOT, check=True)
    return np.load(out)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiny_hydra_config(codec_config: dict[str, Any]) -> omegaconf.DictConfig:
    """The official hydra config with the tiny geometry of `codec_config.json` set in its places."""
    cfg = omegaconf.OmegaConf.load(str(CONFIG))
    if codec_config["encoder_window"] != 512:
        raise SystemExit("the official encoder's window is always 512 (its general config names none)")
    for key in ("sample_rate", "encoder_dim", "encoder_rates", "encoder_transformer_layers", "decoder_dim",
                "decoder_rates"):
        cfg[key] = codec_config[key]
    # The decoder's transformer layers build a module its blocks never call (one head per 64 channels: none at the
    # tiny width, which fails to build); no layers build nothing, as the decoder computes either way.
    cfg.decoder_transformer_layers = [0] * len(codec_config["decoder_rates"])
    general = cfg.transformer_general_config
    general.head_dim, general.rope_base, general.norm_eps = (codec_config["head_dim"], codec_config["rope_base"],
                                                             codec_config["norm_eps"])
    latent = codec_config["encoder_dim"] * 2 ** len(codec_config["encoder_rates"])
    quantizer = cfg.quantizer
    quantizer.input_dim = latent
    quantizer.n_codebooks = codec_config["codebooks"]
    quantizer.codebook_size = codec_config["codebook_size"]
    quantizer.semantic_codebook_size = codec_config["semantic_codebook_size"]
    quantizer.codebook_dim = codec_config["codebook_dim"]
    quantizer.downsample_factor = codec_config["downsample_factors"]
    for name in ("pre_module", "post_module"):
        module = quantizer[name]
        module.input_dim, module.window_size = latent, codec_config["quantizer_window"]
        module.config.n_layer, module.config.n_head = codec_config["quantizer_layers"], codec_config["quantizer_heads"]
        module.config.dim, module.config.intermediate_size = (codec_config["quantizer_dim"],
                                                              codec_config["quantizer_hidden"])
        module.config.head_dim, module.config.rope_base, module.config.norm_eps = (
            codec_config["quantizer_head_dim"], codec_config["rope_base"], codec_config["norm_eps"])
    return cfg


def load_official(directory: Path) -> Any:
    """The official `load_codec_model` (float32, CPU) with its config file read as the tiny one; then a check that
    every tensor of `codec.pth` (less its `generator.` prefix) is one of the model's, equal, and none is missing
    (the official load is not strict)."""
    cfg = tiny_hydra_config(json.loads((directory / "codec_config.json").read_text()))
    original_load = omegaconf.OmegaConf.load
    omegaconf.OmegaConf.load = staticmethod(lambda path: cfg if Path(path) == CONFIG else original_load(path))
    try:
        codec = load_codec_model(str(directory / "codec.pth"), "cpu", precision=torch.float32)
    finally:
        omegaconf.OmegaConf.load = original_load
    stored = {k.removeprefix("generator."): v for k, v in torch.load(directory / "codec.pth").items()}
    state = codec.state_dict()
    missing, unexpected = sorted(set(state) - set(stored)), sorted(set(stored) - set(state))
    changed = sorted(k for k in set(state) & set(stored) if not torch.equal(state[k], stored[k]))
    if missing or unexpected or changed:
        raise SystemExit(f"official codec load mismatch: missing={missing} unexpected={unexpected} changed={changed}")
    return codec


def fixed_codes(seed: int, codec: Any) -> torch.Tensor:
    """[10, FIXED_FRAMES] codes from torch.Generator().manual_seed(2000 + seed): row 0 in 0..semantic size + 255 and
    rows 1..9 in 0..2 × codebook size - 1, so about half of them lie past their codebook (the clamp's cases)."""
    generator = torch.Generator().manual_seed(2000 + seed)
    semantic = codec.quantizer.semantic_quantizer.codebook_size
    residual = codec.quantizer.quantizer.codebook_size
    rows = [torch.randint(0, semantic + 256, (1, FIXED_FRAMES), generator=generator),
            torch.randint(0, 2 * residual, (9, FIXED_FRAMES), generator=generator)]
    return torch.cat(rows)


def write_full_layout(out: Path) -> None:
    with torch.device("meta"):
        codec = instantiate(omegaconf.OmegaConf.load(str(CONFIG)))
    shapes = {key: list(value.shape) for key, value in codec.state_dict().items()}
    out.write_text("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in shapes.items()) + "\n}\n")
    print(f"wrote {out}: {len(shapes)} tensors, {sum(math.prod(v) for v in shapes.values())} numbers")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--project-python")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--full-layout", type=Path)
    args = parser.parse_args()
    if args.full_layout:
        write_full_layout(args.full_layout)
        return
    if args.seed is None or args.out is None or not args.project_python:
        raise SystemExit("--seed, --out and --project-python are needed (the project's python resamples the clip)")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        directory = args.checkpoint or write_checkpoint(args.project_python, args.seed, Path(tmp) / "s2_pro")
        codec = load_official(directory)
        audio = reference_audio(args.project_python, Path(tmp) / "reference_44k.npy")
        waves = torch.from_numpy(audio)[None, None]
        indices, lengths = codec.encode(waves, torch.tensor([waves.shape[-1]]))
        reference_codes = indices[0, :, : int(lengths[0])]
        codes = fixed_codes(args.seed, codec)
        waveform = codec.from_indices(codes.clone()[None])[0, 0]  # a copy: the official decode clamps in place
        meta = {
            "seed": args.seed, "fish_speech_commit": FISH_SPEECH_COMMIT, "torch": torch.__version__,
            "checkpoint_sha256": {name: sha256(Path(directory) / name) for name in CHECKPOINT_FILES},
            "reference_audio_sha256": hashlib.sha256(audio.tobytes()).hexdigest(),
            "reference_samples": int(audio.shape[0]), "sample_rate": int(codec.sample_rate),
        }
        np.savez(args.out, meta=np.array(json.dumps(meta, sort_keys=True)),
                 reference_codes=reference_codes.numpy().astype(np.int64), fixed_codes=codes.numpy().astype(np.int64),
                 waveform=waveform.numpy().astype(np.float32))
    print(f"wrote {args.out}: reference codes {tuple(reference_codes.shape)}, waveform {tuple(waveform.shape)}")


if __name__ == "__main__":
    main()
