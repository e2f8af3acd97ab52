#!/usr/bin/env bash
# Samples one stage replica's Python threads with py-spy while a benchmark level runs: waits until LOG holds AFTER
# lines that start with "{" (e2e_serve prints one per finished level), then records SECONDS s of every thread, idle
# ones included (where each thread sits, waits too), then SECONDS s of the thread holding the GIL only (who keeps it),
# as collapsed stacks; `python -m benchmarks.spy_summary` reads them. Non-blocking: the process is not paused to
# sample it (a sample may then be torn, rarely).
#
#   bash benchmarks/spy_on_stage.sh STAGE LOG AFTER SECONDS OUTDIR      (PY_SPY: the py-spy binary, default py-spy)
set -uo pipefail
stage=$1 log=$2 after=$3 seconds=$4 out=$5
spy=${PY_SPY:-py-spy}
mkdir -p "$out"
while true; do
  done_levels=$(grep -c '^{' "$log" 2>/dev/null)
  [ "${done_levels:-0}" -ge "$after" ] && break
  [ "$SECONDS" -gt 400 ] && { echo "no level $after in $log after 400 s" > "$out/${stage}_spy.log"; exit 1; }
  sleep 0.5
done
sleep 2  # the next level's requests are in
pid=$(pgrep -f "ServeReplica:[^ ]*:$stage" | head -1)
echo "$(date -u +%T) sampling $stage (pid $pid) after $done_levels levels" > "$out/${stage}_spy.log"
"$spy" record -p "$pid" -d "$seconds" -r 100 --nonblocking --threads --idle -f raw -o "$out/${stage}_all.txt" >> "$out/${stage}_spy.log" 2>&1
"$spy" record -p "$pid" -d "$seconds" -r 100 --nonblocking --threads --gil -f raw -o "$out/${stage}_gil.txt" >> "$out/${stage}_spy.log" 2>&1
echo "$(date -u +%T) done" >> "$out/${stage}_spy.log"
