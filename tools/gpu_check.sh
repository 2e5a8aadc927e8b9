#!/usr/bin/env bash
# Everything this project measures on a GPU, in one device call (run from the repo root there):
#   run(command="bash tools/gpu_check.sh", carry=[".whl"])   after tools/gpu_wheels.sh here.
# Stages (default: all, in this order): tests peer bench profile events bench-thread; `smoke` = a short bench and peer run.
# Each stage has its own time limit, cut to what is left of $BUDGET seconds (default 540: a device call
# may run 600), so a hang costs one stage and the logs always come back.
# Writes logs and tables under $OUT; prints the short tables last.
set -uo pipefail
# The device tool returns at most 8 files from $OUT: work in $LOGS, pack it into $OUT/logs.tgz at the end.
OUT=${OUT:-/tmp/gpu-out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
stages=${*:-tests peer bench profile events bench-thread}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%FT%TZ; echo "stages: $stages"; } > "$LOGS/gpu.txt"
show=("$LOGS/gpu.txt")

BUDGET=${BUDGET:-540}
limit() { local left=$((BUDGET - SECONDS)); echo $(($1 < left ? $1 : (left > 1 ? left : 1))); }
for stage in $stages; do
    start=$SECONDS
    if ((SECONDS >= BUDGET - 5)); then echo "stage $stage: skipped, budget spent" | tee -a "$LOGS/gpu.txt"; continue; fi
    case $stage in
    tests)
        timeout $(limit 150) python3 -m pytest -q -m cuda -p no:cacheprovider --durations=8 tests/ > "$LOGS/cuda-tests.log" 2>&1; rc=$?
        tail -15 "$LOGS/cuda-tests.log" > "$LOGS/cuda-tests.tail"; show+=("$LOGS/cuda-tests.tail") ;;
    events)
        timeout $(limit 60) python3 tools/bench_event_wait.py --repeats 300 > "$LOGS/event-wait.md" 2>"$LOGS/event-wait.err"; rc=$?
        show+=("$LOGS/event-wait.md") ;;
    bench)
        timeout $(limit 150) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 32 128 --len 128 --repeats 3 --no-progress --json-out "$LOGS/bench.json" \
            > "$LOGS/bench.md" 2>"$LOGS/bench.err"; rc=$?
        show+=("$LOGS/bench.md") ;;
    bench-thread)  # the same, with the loop woken by a pool thread instead of a host function
        timeout $(limit 150) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 32 128 --len 128 --repeats 3 --no-progress --event-wait thread \
            > "$LOGS/bench-thread.md" 2>"$LOGS/bench-thread.err"; rc=$?
        show+=("$LOGS/bench-thread.md") ;;
    peer)
        timeout $(limit 240) python3 tools/peer_bench.py --device cuda --dtype bfloat16 --json-out "$LOGS/peer.json" \
            > "$LOGS/peer.md" 2>"$LOGS/peer.err"; rc=$?
        show+=("$LOGS/peer.md") ;;
    profile)
        timeout $(limit 60) python3 tools/profile_forward_cuda.py > "$LOGS/profile.md" 2>"$LOGS/profile.err"; rc=$?
        show+=("$LOGS/profile.md") ;;
    smoke)
        timeout $(limit 100) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 --len 32 --repeats 1 --no-progress > "$LOGS/smoke-bench.md" 2>"$LOGS/smoke-bench.err"; rc=$?
        timeout $(limit 150) python3 tools/peer_bench.py --device cuda --dtype bfloat16 --concurrency 1 8 --output-len 32 \
            --repeats 1 > "$LOGS/smoke-peer.md" 2>"$LOGS/smoke-peer.err"; rc=$((rc | $?))
        show+=("$LOGS/smoke-bench.md" "$LOGS/smoke-peer.md") ;;
    *) echo "gpu_check: unknown stage $stage" >&2; exit 2 ;;
    esac
    echo "stage $stage: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOGS/gpu.txt"
done
for f in "${show[@]}"; do echo "== ${f##*/}"; cat "$f"; done
for f in "$LOGS"/*.err; do [ -s "$f" ] && { echo "== ${f##*/} (last lines)"; tail -8 "$f"; }; done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
cp "$LOGS"/*.md "$LOGS"/*.json "$OUT"/ 2>/dev/null
exit 0
