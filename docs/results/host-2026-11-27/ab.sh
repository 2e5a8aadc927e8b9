#!/usr/bin/env bash
# tools/bench_host.py before (main 99596d0, a worktree at $BEFORE) and after (this checkout),
# alternated in one invocation on the same machine: before, after, before, after.
#   BEFORE=/tmp/before bash docs/results/host-2026-11-27/ab.sh
set -euo pipefail
AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
BEFORE=${BEFORE:-/tmp/before}
OUT=$AFTER/docs/results/host-2026-11-27
PY=${PY:-/work/main/.venv/bin/python}
ARGS=${ARGS:---streams 1 8 32 128 256 512 --len 128 --repeats 3 --quiet}
for pair in 1 2; do
    for side in before after; do
        tree=$BEFORE; [[ $side == after ]] && tree=$AFTER
        uptime > "$OUT/bench_host_${side}_${pair}.txt"
        (cd "$tree" && PYTHONPATH=$tree nice -n 10 "$PY" tools/bench_host.py $ARGS \
            --note "A/B pair $pair, $side (docs/results/host-2026-11-27/ab.sh)" \
            --json-out "$OUT/bench_host_${side}_${pair}.json") >> "$OUT/bench_host_${side}_${pair}.txt"
        uptime >> "$OUT/bench_host_${side}_${pair}.txt"
    done
done
