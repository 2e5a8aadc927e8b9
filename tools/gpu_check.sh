#!/usr/bin/env bash
# Everything this project measures on a GPU, in one device call (run from the repo root there):
#   run(command="bash tools/gpu_check.sh", carry=[".whl"])   after tools/gpu_wheels.sh here.
# Writes logs and tables under $OUT; prints the short tables last.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
date -u +%FT%TZ >> "$OUT/gpu.txt"
python3 -m pytest -q -m cuda -p no:cacheprovider tests/ > "$OUT/cuda-tests.log" 2>&1
python3 tools/bench_event_wait.py --repeats 300 > "$OUT/event-wait.md" 2>"$OUT/event-wait.err"
python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 --streams 1 8 32 \
    --len 128 --repeats 3 --no-progress --json-out "$OUT/bench.json" > "$OUT/bench.md" 2>"$OUT/bench.err"
if [ -f tools/peer_bench.py ]; then
    python3 tools/peer_bench.py --device cuda --dtype bfloat16 --json-out "$OUT/peer.json" > "$OUT/peer.md" 2>"$OUT/peer.err"
fi
cat "$OUT/gpu.txt"; tail -5 "$OUT/cuda-tests.log"; cat "$OUT/event-wait.md" "$OUT/bench.md"
[ -f "$OUT/peer.md" ] && cat "$OUT/peer.md"
