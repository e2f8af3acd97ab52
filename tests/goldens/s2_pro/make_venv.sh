#!/usr/bin/env bash
# Build the venv that runs the OFFICIAL Fish Audio S2 Pro Dual-AR and codec code (fishaudio/fish-speech at commit
# 3dd1f85, torch 2.13.0 CPU), then optionally rewrite the committed goldens dual_ar_seed{0,1}.json,
# codec_seed{0,1}.npz and codec_layout_full.json beside this script.
# The reference code cannot run in CI (it is not ours to ship and needs its own venv), so its outputs on our tiny
# random checkpoints are committed and tests compare our engine against those files.
#
# Licensing: fish-speech is covered by the Fish Audio Research License. It is exported into a folder OUTSIDE this
# repository and only imported at run time; none of its code is ever copied into omni-ray.
#
# Usage: make_venv.sh [--goldens]
#   FISH_SPEECH_VENV  the venv to build or reuse             (default /work/venv-fish-speech)
#   FISH_SPEECH_SRC   where the fish-speech source goes       (default /work/fish-speech-src)
#   FISH_SPEECH_MIRROR a bare git mirror of fish-speech to export from, when present
#                                                             (default /work/.mirror/fishaudio+fish-speech/repo)
#   PROJECT_PYTHON    the project's python, which writes the tiny checkpoints (default: python3 on PATH)
set -euo pipefail
FISH_SPEECH_COMMIT=3dd1f85
VENV="${FISH_SPEECH_VENV:-/work/venv-fish-speech}"
SRC="${FISH_SPEECH_SRC:-/work/fish-speech-src}"
MIRROR="${FISH_SPEECH_MIRROR:-/work/.mirror/fishaudio+fish-speech/repo}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
PROJECT_PYTHON="${PROJECT_PYTHON:-$(command -v python3)}"

case "$(cd "$(dirname "$SRC")" 2>/dev/null && pwd)/" in
  "$REPO"/*) echo "FISH_SPEECH_SRC must be outside the repository ($REPO): its code is never copied in" >&2; exit 1 ;;
esac

# The source: exported from a local mirror when there is one, else cloned (needs network access to GitHub).
if [ ! -f "$SRC/fish_speech/models/text2semantic/llama.py" ]; then
  mkdir -p "$SRC"
  if [ -d "$MIRROR" ] && git --git-dir="$MIRROR" cat-file -e "$FISH_SPEECH_COMMIT^{commit}" 2>/dev/null; then
    git --git-dir="$MIRROR" archive "$FISH_SPEECH_COMMIT" | tar -x -C "$SRC"
  else
    echo "No fish-speech mirror at $MIRROR: cloning from GitHub (network access needed)" >&2
    rm -rf "$SRC"
    git clone --quiet https://github.com/fishaudio/fish-speech "$SRC"
    git -C "$SRC" checkout --quiet "$FISH_SPEECH_COMMIT"
  fi
fi

# The venv: only what the Dual-AR model and inference.py import (no codec packages).
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch==2.13.0
  CONSTRAINTS="$(mktemp)"
  echo "torch==2.13.0" > "$CONSTRAINTS"
  # llama.py: einops, loguru, loralib (lora.py); inference.py: click, tqdm, numpy; tokenizer.py and
  # conversation.py: transformers (the repo requires <= 4.57.3); the weights: safetensors.
  "$VENV/bin/pip" install --quiet -c "$CONSTRAINTS" numpy einops loguru loralib click tqdm safetensors \
    transformers==4.57.3
  rm -f "$CONSTRAINTS"
fi
# The codec's imports (fish_speech/models/dac: hydra's instantiate, descript-audio-codec's layers and quantizer, which
# import descript-audiotools, which imports torchaudio). Those three go in without their dependencies (they would
# replace torch); torchaudio's compiled extensions are a CUDA build, so they are moved aside and it imports as pure
# Python (its load() is then unusable: the goldens read audio with soundfile, in the project's python).
if ! PYTHONPATH="$SRC" "$VENV/bin/python" -c "import fish_speech.models.dac.modded_dac, hydra" 2>/dev/null; then
  CONSTRAINTS="$(mktemp)"
  echo "torch==2.13.0" > "$CONSTRAINTS"
  "$VENV/bin/pip" install --quiet -c "$CONSTRAINTS" hydra-core==1.3.8 omegaconf==2.3.1 soundfile flatten-dict julius \
    ffmpy scipy importlib-resources rich tensorboard randomname argbind
  "$VENV/bin/pip" install --quiet --no-deps descript-audio-codec==1.0.0 descript-audiotools==0.7.2 torchaudio==2.11.1
  rm -f "$CONSTRAINTS"
  TORCHAUDIO_LIB="$("$VENV/bin/python" -c "import importlib.util, os
print(os.path.join(os.path.dirname(importlib.util.find_spec('torchaudio').origin), 'lib'))")"
  mkdir -p "$VENV/torchaudio-lib-moved-aside"
  find "$TORCHAUDIO_LIB" -maxdepth 1 -name '*.so' -exec mv {} "$VENV/torchaudio-lib-moved-aside/" \;
fi
PYTHONPATH="$SRC" "$VENV/bin/python" -c "import torch, transformers
from fish_speech.models.text2semantic.inference import decode_one_token_ar, load_codec_model
from fish_speech.models.dac.modded_dac import DAC
print('fish-speech ok; torch', torch.__version__, 'transformers', transformers.__version__)" 2>/dev/null | tail -1

if [ "${1:-}" = "--goldens" ]; then
  for seed in 0 1; do
    PYTHONPATH="$SRC" "$VENV/bin/python" "$HERE/make_goldens.py" --seed "$seed" \
      --out "$HERE/dual_ar_seed$seed.json" --project-python "$PROJECT_PYTHON" 2>/dev/null | tail -1
    PYTHONPATH="$SRC" "$VENV/bin/python" "$HERE/make_codec_goldens.py" --seed "$seed" \
      --out "$HERE/codec_seed$seed.npz" --project-python "$PROJECT_PYTHON" 2>/dev/null | tail -1
  done
  PYTHONPATH="$SRC" "$VENV/bin/python" "$HERE/make_codec_goldens.py" --full-layout "$HERE/codec_layout_full.json" \
    2>/dev/null | tail -1
fi
