#!/usr/bin/env bash
# Drive `slipstream serve` with an outside OpenAI-compatible load generator (NVIDIA aiperf) on loopback.
#
#   AIPERF=/path/to/venv/bin/aiperf tools/serving/run_aiperf.sh [MODEL] [OUT_DIR]
#
# aiperf goes in its own virtualenv (`python -m venv /tmp/lg && /tmp/lg/bin/pip install aiperf`): it pins
# packages (pyzmq, pandas, ...) that should not move in slipstream's environment; it pulls no torch.
# It counts tokens with a Hugging Face tokenizer folder, written here from the model's GGUF.
# Bounded: --request-count requests at --concurrency, fixed input/output lengths, ignore_eos.
set -euo pipefail
MODEL=${1:-smollm2-135m}
OUT=${2:-docs/results/cpu-$(date -u +%F)}
AIPERF=${AIPERF:-aiperf}
PY=${PY:-python}
REQUESTS=${REQUESTS:-32}
CONCURRENCY=${CONCURRENCY:-4}
ISL=${ISL:-64}
OSL=${OSL:-32}
mkdir -p "$OUT"
work=$(mktemp -d)
port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
$PY tools/serving/export_tokenizer.py "$MODEL" "$work/tokenizer" >/dev/null
$PY -m slipstream.cli serve --model "$MODEL" --port "$port" --log-level warning >"$work/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 "$server" || { cat "$work/serve.log"; exit 1; }
  sleep 0.2
done
cmd=("$AIPERF" profile --model "$MODEL" --tokenizer "$work/tokenizer" --url "http://127.0.0.1:$port"
     --endpoint-type chat --streaming --concurrency "$CONCURRENCY" --request-count "$REQUESTS"
     --num-warmup-requests 2 --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0
     --output-tokens-mean "$OSL" --output-tokens-stddev 0 --extra-inputs ignore_eos:true --random-seed 1
     --artifact-dir "$work/aiperf" --ui-type none)
report="$OUT/aiperf-$MODEL-c$CONCURRENCY.txt"
{
  $PY tools/common/provenance.py "slipstream serve --model $MODEL --port $port (loopback)  +  ${cmd[*]}"
  echo "load generator: aiperf $("$AIPERF" --version 2>/dev/null | tail -1) (its own venv; token counts from the exported tokenizer)"
  echo
} >"$report"
"${cmd[@]}" >"$work/aiperf.log" 2>&1 || { tail -40 "$work/aiperf.log"; exit 1; }
cat "$work/aiperf/profile_export_console.txt" >>"$report"
cp "$work/aiperf/profile_export_aiperf.json" "$OUT/aiperf-$MODEL-c$CONCURRENCY.json"
echo "$report"
