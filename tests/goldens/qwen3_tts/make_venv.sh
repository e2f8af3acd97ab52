#!/usr/bin/env bash
# Build the official Qwen3-TTS reference venv (qwen-tts 0.1.1 on torch 2.13.0 CPU), then optionally rewrite the
# committed goldens. Usage: make_venv.sh [VENV_DIR] [--goldens]   (VENV_DIR defaults to /work/venv-qwen-tts)
set -euo pipefail
VENV="${1:-/work/venv-qwen-tts}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
PROJECT_PYTHON="${PROJECT_PYTHON:-$(command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet torch==2.13.0
  CONSTRAINTS="$(mktemp)"
  echo "torch==2.13.0" > "$CONSTRAINTS"
  # qwen-tts pins transformers 4.57.3; torchaudio has no 2.13.0, so pip picks a CUDA build that cannot load.
  "$VENV/bin/pip" install --quiet -c "$CONSTRAINTS" qwen-tts==0.1.1
  rm -f "$CONSTRAINTS"
  # qwen_tts imports torchaudio (kaldi features of the 25 Hz tokenizer); without its native libraries torchaudio
  # imports in pure-Python mode, which is all the 12 Hz path needs.
  rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so
fi
"$VENV/bin/python" -c "import qwen_tts, torch, transformers; print('qwen_tts ok; torch', torch.__version__, \
'transformers', transformers.__version__)" 2>/dev/null | tail -1

if [ "${2:-}" = "--goldens" ]; then
  for seed in 0 1; do
    "$VENV/bin/python" "$HERE/make_goldens.py" --seed "$seed" --out "$HERE/seed$seed" \
      --project-python "$PROJECT_PYTHON" 2>/dev/null | tail -1
  done
fi
