#!/usr/bin/env bash
# Where the CPU of one steady N = 1 decode step goes, before (main 99596d0 at $BEFORE, with this
# branch's tools/step_profile.py copied in: tools only) and after, alternated: before, after, then
# the same with --functions (cProfile by function).
#   BEFORE=/tmp/before bash docs/results/host-2026-11-27/profile.sh
set -euo pipefail
AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
BEFORE=${BEFORE:-/tmp/before}
OUT=$AFTER/docs/results/host-2026-11-27
PY=${PY:-/work/main/.venv/bin/python}
cp "$AFTER/tools/step_profile.py" "$BEFORE/tools/step_profile.py"
for extra in "" "--functions"; do
    for side in before after; do
        tree=$BEFORE; [[ $side == after ]] && tree=$AFTER
        name=step_profile_n1_${side}${extra:+_functions}.txt
        (cd "$tree" && PYTHONPATH=$tree nice -n 10 "$PY" tools/step_profile.py --streams 1 --len 2000 --repeats 3 $extra) \
            > "$OUT/$name"
        uptime >> "$OUT/$name"
    done
done
