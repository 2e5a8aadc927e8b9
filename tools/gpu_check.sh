#!/usr/bin/env bash
# Everything this project measures on a GPU (run from the repo root there). Here, right before the call:
#   bash tools/gpu_prepare.sh          # wheels, git stamp, llama.cpp source -> .whl/ (~25 MB; LLAMACPP=0: no source)
# The cuda tests, one call of their own (run(command="bash tools/gpu_check.sh tests", carry=[".whl"], timeout_s=600)):
#   tests = tests-kernels, then tests-engine, each a pytest process of its own:
#     tests-kernels  `pytest -m cuda tests/ --ignore-glob='tests/*cuda*.py'`: the compiled kernels against their
#                    references (attention, fused kernels and model, launch counts, logits processing, grammar
#                    masks); cold, most of its time is Triton compiling. Limit 230 s.
#     tests-engine   `pytest -m cuda tests/*cuda*.py`: whole engines (depth 2 == depth 1, graph replay == eager,
#                    no hidden sync, warmup, event waits, mixed graphs); ~15 engine starts, each capturing its
#                    graphs. Limit 320 s. Engine-level CUDA tests go in files named *cuda*.py.
#   Each is stopped with SIGINT 15 s before its limit (pytest then prints its summary and writes its XML; a
#   hung process gets SIGKILL at the limit) and, where the image has pytest-timeout, a single test with
#   SIGALRM after 240 s. As they run: $OUT/cuda-tests-kernels.log, $OUT/cuda-tests-engine.log (pytest's output,
#   unbuffered), then $OUT/cuda-tests-*.xml (JUnit) and $OUT/gpu.txt (GPU, provenance, each stage's rc and
#   time); everything else in $OUT/logs.tgz at the end. Tests that need a package the image lacks (fastapi,
#   uvicorn, openai, ray) skip; tests/test_gpu_image_collect.py checks on the CPU that no cuda test does.
#   A stage cut short says rc=124 in gpu.txt (its log ends with "KeyboardInterrupt"); then a second call on the
#   still warm machine (Triton's cache is kept) runs that stage alone with the whole budget:
#   `ENGINE_LIMIT=560 bash tools/gpu_check.sh tests-engine` (or KERNELS_LIMIT=560 ... tests-kernels).
# The issue-16 figures in two device calls (each under 600 s; run(..., carry=[".whl"], timeout_s=600)):
#   1. LLAMACPP_SERVER=1 bash tools/gpu_check.sh llamacpp bench   # llama.cpp (CUDA, sm_90): batched-bench bf16/f16
#      and llama-server bf16 tables; slipstream bench (mean/p90 idle, the prediction from depth 1)
#   2. bash tools/gpu_check.sh peer             # slipstream d1/d2 vs transformers' configurations, fresh processes
# If call 1's build ate the budget and `bench` was skipped, a third call: `bash tools/gpu_check.sh bench`.
# Issues 14 and 15 (host path at 256 streams; kernels and mixed graphs), after the tests call:
#   1. bash tools/gpu_check.sh bench profile profile-mixed   # idle mean/p90 at 1..256 streams, host vs forward;
#      kernels/step + replay at batch 1/32/128/256; mixed-step host launch eager vs graph
#   2. bash tools/gpu_check.sh peer                          # tokens/s and TTFT, depth 1 vs 2
# Stages: tests (= tests-kernels tests-engine) peer bench llamacpp profile profile-mixed events bench-thread smoke
# (default: tests). Each stage has its own time limit, cut to what is left of $BUDGET seconds (default 570), so a
# hang costs one stage and the logs always come back. Every raw table starts with a provenance header
# (slipstream/provenance.py).
set -uo pipefail
# The device tool returns at most 8 files from $OUT: the test logs and gpu.txt are written there as they go,
# every other log goes into $OUT/logs.tgz at the end, plus one table per stage while files are left.
OUT=${OUT:-/tmp/gpu-out}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
GPU_TXT=$OUT/gpu.txt
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl > "$LOGS/wheels.log" 2>&1; then
        { echo "gpu_check: installing the carried wheels failed"; tail -20 "$LOGS/wheels.log"; } | tee "$GPU_TXT"; exit 1
    fi
    export PYTHONPATH=/tmp/site:$PWD
fi
stages=${*:-tests}
stages=$(echo " $stages " | sed 's/ tests / tests-kernels tests-engine /g')
# provenance.py by path (-P: not its folder on sys.path): the header needs no third-party package
prov() { python3 -P slipstream/provenance.py "$@"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  prov
  date -u +%FT%TZ; echo "stages:$stages"; } > "$GPU_TXT" 2>&1
show=("$GPU_TXT")
LLAMA_BUILD=${LLAMA_BUILD:-build/llamacpp}  # ignored, not carried: kept between calls while the machine is warm
# LLAMA_ARGS: extra tools/llamacpp_bench.py arguments (e.g. a short CPU check of this script);
# LLAMACPP_SERVER=1: also build llama-server and run tools/llamacpp_server_bench.py (bf16)

BUDGET=${BUDGET:-570}
limit() { local left=$((BUDGET - SECONDS)); echo $(($1 < left ? $1 : (left > 1 ? left : 1))); }
for stage in $stages; do
    start=$SECONDS
    if ((SECONDS >= BUDGET - 5)); then echo "stage $stage: skipped, budget spent" | tee -a "$GPU_TXT"; continue; fi
    case $stage in
    tests-kernels|tests-engine)
        if [[ $stage == tests-kernels ]]; then t=$(limit "${KERNELS_LIMIT:-230}"); sel=(tests/ --ignore-glob='tests/*cuda*.py')
        else t=$(limit "${ENGINE_LIMIT:-320}"); sel=(tests/*cuda*.py); fi
        per_test=()
        python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 240 --timeout-method signal)
        # SIGINT first (pytest prints its summary and writes the XML), SIGKILL 15 s later if that hangs
        timeout -s INT -k 15 $((t > 30 ? t - 15 : t)) python3 -m pytest -m cuda -p no:cacheprovider -q -rfEs \
            --durations=15 "${per_test[@]}" --junitxml="$OUT/cuda-$stage.xml" "${sel[@]}" 2>&1 \
            | tee "$OUT/cuda-$stage.log"; rc=${PIPESTATUS[0]}
        { prov; echo; tail -40 "$OUT/cuda-$stage.log"; } > "$LOGS/cuda-$stage.md"; show+=("$LOGS/cuda-$stage.md") ;;
    events)
        timeout $(limit 60) python3 tools/bench_event_wait.py --repeats 300 > "$LOGS/event-wait.md" 2>"$LOGS/event-wait.err"; rc=$?
        show+=("$LOGS/event-wait.md") ;;
    bench)  # mean/p90 idle, the prediction from depth 1 made before depth 2 runs, the accounting identity
        timeout $(limit 170) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 32 128 256 --len 128 --repeats 3 --no-progress --json-out "$LOGS/bench.json" \
            > "$LOGS/bench.md" 2>"$LOGS/bench.err"; rc=$?
        show+=("$LOGS/bench.md") ;;
    bench-thread)  # the same, with the loop woken by a pool thread instead of a host function
        timeout $(limit 150) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 32 128 --len 128 --repeats 3 --no-progress --event-wait thread \
            > "$LOGS/bench-thread.md" 2>"$LOGS/bench-thread.err"; rc=$?
        show+=("$LOGS/bench-thread.md") ;;
    peer)  # a fresh process per system; transformers: cb-auto, cb-graphs, static-compile (tools/peer_hf.py, last:
           # it compiles per batch size); peer.json is rewritten after every system, so a cut-off run keeps the rest
        timeout $(limit 560) python3 tools/peer_bench.py --device cuda --dtype bfloat16 --json-out "$LOGS/peer.json" \
            > "$LOGS/peer.md" 2>"$LOGS/peer.err"; rc=$?
        show+=("$LOGS/peer.md") ;;
    llamacpp)  # build from the carried snapshot (outside the repo's tracked tree), then bf16 and f16 rows
        rc=0
        if [[ ! -x $LLAMA_BUILD/bin/llama-batched-bench || ( ${LLAMACPP_SERVER:-0} == 1 && ! -x $LLAMA_BUILD/bin/llama-server ) ]]; then
            rm -rf /tmp/llamacpp-src && mkdir -p /tmp/llamacpp-src && tar -xzf .whl/llamacpp-src.tgz -C /tmp/llamacpp-src
            mkdir -p "$(dirname "$LLAMA_BUILD")"
            JOBS=$(nproc) timeout $(limit 420) bash tools/llamacpp_peer.sh build /tmp/llamacpp-src "$LLAMA_BUILD" \
                > "$LOGS/llamacpp-build.log" 2>&1; rc=$?
            cp "$LLAMA_BUILD".build.log "$LLAMA_BUILD".configure.log "$LOGS"/ 2>/dev/null
        fi
        if ((rc == 0)); then
            for dt in bf16 f16; do
                timeout $(limit 75) python3 tools/llamacpp_bench.py --build "$LLAMA_BUILD" --dtype $dt ${LLAMA_ARGS:-} \
                    --json-out "$LOGS/llamacpp-$dt.json" > "$LOGS/llamacpp-$dt.md" 2>"$LOGS/llamacpp-$dt.err"; rc=$((rc | $?))
                show+=("$LOGS/llamacpp-$dt.md")
            done
            if [[ ${LLAMACPP_SERVER:-0} == 1 ]]; then  # llama-server: sampling, streaming, its own scheduler
                timeout $(limit 150) python3 tools/llamacpp_server_bench.py --build "$LLAMA_BUILD" --dtype bf16 ${LLAMA_ARGS:-} \
                    --json-out "$LOGS/llamacpp-server.json" > "$LOGS/llamacpp-server.md" 2>"$LOGS/llamacpp-server.err"; rc=$((rc | $?))
                show+=("$LOGS/llamacpp-server.md")
            fi
        else
            show+=("$LOGS/llamacpp-build.log")
        fi ;;
    profile)
        timeout $(limit 60) python3 tools/profile_forward_cuda.py > "$LOGS/profile.md" 2>"$LOGS/profile.err"; rc=$?
        show+=("$LOGS/profile.md") ;;
    profile-mixed)  # issue 15: host launch cost of mixed steps, eager vs mixed-graph replay
        timeout $(limit 120) python3 tools/profile_mixed_cuda.py > "$LOGS/profile-mixed.md" 2>"$LOGS/profile-mixed.err"; rc=$?
        show+=("$LOGS/profile-mixed.md") ;;
    smoke)
        timeout $(limit 100) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 --len 32 --repeats 1 --no-progress > "$LOGS/smoke-bench.md" 2>"$LOGS/smoke-bench.err"; rc=$?
        timeout $(limit 150) python3 tools/peer_bench.py --device cuda --dtype bfloat16 --concurrency 1 8 --output-len 32 \
            --repeats 1 > "$LOGS/smoke-peer.md" 2>"$LOGS/smoke-peer.err"; rc=$((rc | $?))
        show+=("$LOGS/smoke-bench.md" "$LOGS/smoke-peer.md") ;;
    *) echo "gpu_check: unknown stage $stage" >&2; exit 2 ;;
    esac
    echo "stage $stage: rc=$rc in $((SECONDS - start)) s" | tee -a "$GPU_TXT"
done
for f in "${show[@]}"; do echo "== ${f##*/}"; cat "$f"; done
for f in "$LOGS"/*.err; do [ -s "$f" ] && { echo "== ${f##*/} (last lines)"; tail -8 "$f"; }; done
cp "$GPU_TXT" "$LOGS"/ 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$LOGS" .
n=$(find "$OUT" -type f | wc -l)
for f in "${show[@]}"; do
    [[ $f == "$OUT"/* || -e $OUT/${f##*/} || ${f##*/} == cuda-tests-* ]] && continue  # tests: their .log is there
    ((n < 8)) && cp "$f" "$OUT"/ && n=$((n + 1))
done
exit 0
