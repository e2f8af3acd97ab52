#!/usr/bin/env bash
# One GPU session's runs in one command: each named step runs under its own time limit, its log and results go
# under $OUT, and everything is also packed into $OUT/suite.tar.gz (one file to bring back, whatever the count).
#
#   bash benchmarks/gpu_suite.sh [STEP ...]          (default: tests engine vocoder e2e)
#
# Steps: tests (GPU tests), engine (engine-only steps, compiled, the service's sampling), profile (kernels per
# step), vocoder (window vs stateful vocoder, with and without cuDNN autotuning), ipc (CUDA IPC vs host path, one
# GPU), relay (NCCL vs host path, two GPUs), e2e (the 2-GPU layout end to end), e2e1 (the 1-GPU layout under MPS),
# baseline (transformers' generate()).
# Environment: OUT (default ./gpu_out), OMNI_RAY_COMMIT (written into every results file), E2E_SET (extra
# `--set KEY=VALUE ...` for e2e), STEP_TIMEOUT (seconds per step, default 280).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
LIMIT=${STEP_TIMEOUT:-280}
mkdir -p "$OUT/logs" "$OUT/results"
if [ -d .whl ] && ! python3 -c "import ray" 2>/dev/null; then  # the GPU image has no Ray: the carried wheel bundle
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  find /tmp/site/ray/core -type f ! -name '*.py' -exec chmod +x {} +
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1

run_step() {  # name, command...
  local name=$1; shift
  local started=$SECONDS
  timeout "$LIMIT" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - started))s"
}

for step in "${@:-tests engine vocoder e2e}"; do
  for name in $step; do
    case $name in
      tests) run_step tests python -m pytest -rA tests/test_gpu_engine.py tests/test_gpu_vocoder.py tests/test_gpu_ipc.py \
               tests/test_gpu_relay.py ;;  # the last needs two GPUs (skipped on one)
      engine) run_step engine python -m omni_ray.bench --compile --talker-sampling served --out "$OUT/results/engine" ;;
      profile) run_step profile python -m benchmarks.profile_step --compile ;;
      vocoder) run_step vocoder python -m benchmarks.vocoder_bench --out "$OUT/results/vocoder"
               run_step vocoder_autotune python -m benchmarks.vocoder_bench --cudnn-autotune --out "$OUT/results/vocoder_autotune" ;;
      ipc) run_step ipc python -m benchmarks.relay_bench --producer cuda:0 --consumer cuda:0 --modes ipc,host --out "$OUT/results/ipc" ;;
      relay) run_step relay python -m benchmarks.relay_bench --out "$OUT/results/relay" ;;
      e2e) # shellcheck disable=SC2086
           run_step e2e python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_2gpu.yaml ${E2E_SET:-} --out "$OUT/results/e2e" ;;
      e2e1) nvidia-cuda-mps-control -d && echo "MPS daemon started" >> "$OUT/logs/e2e1.log"
            run_step e2e1 env CUDA_VISIBLE_DEVICES=0 python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_1gpu.yaml --out "$OUT/results/e2e1"
            echo quit | nvidia-cuda-mps-control ;;
      baseline) run_step baseline python -m benchmarks.hf_baseline --out "$OUT/results/baseline" ;;
      *) echo "unknown step: $name" >&2 ;;
    esac
  done
done
for table in "$OUT"/results/*/*.md; do [ -e "$table" ] && { echo "== $table"; tail -n 12 "$table"; }; done
tar -czf /tmp/suite.tar.gz -C "$OUT" logs results && mv /tmp/suite.tar.gz "$OUT/suite.tar.gz"
