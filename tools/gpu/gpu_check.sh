#!/usr/bin/env bash
# Everything this project measures on a GPU, in ONE device call (run from the repo root there). Here, right before:
#   bash tools/gpu/gpu_prepare.sh   # wheels, git stamp, llama.cpp (prebuilt CUDA dist, else its source) -> .whl/
# Then: run(command="bash tools/gpu/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# Default stages, in this order (issue 35), each cut to what is left of $BUDGET (default 540 s):
#   tests-engine   pytest -m cuda tests/*cuda*.py (whole engines; limit 150 s)
#   tests-kernels  pytest -m cuda on the rest (compiled kernels vs references; limit 110 s)
#   bench          slipstream bench, 1..256 streams, depth 1 and 2: period ÷ (forward+sampling), device idle
#                  median/mean/p90, the prediction from depth 1 (limit 80 s); then the same at the 1B shape
#                  (random-llama-3.2-1b, weights drawn on the GPU) at 1, 32, 256 streams, L = 64, 2 repeats
#                  (limit BENCH_1B_LIMIT, 60 s), appended to bench.md
#   profile        tools/gpu/profile_forward_cuda.py: kernels/step, replay vs floor at batch 1/32/128/256 (limit 50 s);
#                  then the 1B shape at batch 1/8/32, the 2,048-token prefill in TFLOP/s beside the bf16 peak,
#                  graphs captured on first use, variants fused (the default) and gemv (the split-K GEMV where
#                  measured faster; its kernels compile at start) (limit PROFILE_1B_LIMIT, 90 s): profile.md,
#                  one section per model
#   profile-mixed  tools/gpu/profile_mixed_cuda.py: mixed-step host launch, eager vs graph (limit 40 s)
#   peer           slipstream d1/d2 and transformers cb-graphs at N = 1, 8, fresh processes (limit 100 s)
#   llamacpp       llama.cpp (CUDA, sm_90) llama-batched-bench bf16 at N = 1, 8 (limit 80 s): the carried
#                  prebuilt dist (.whl/llamacpp-cuda-sm90.tar.xz, tools/peers/llamacpp_peer.sh dist), else the build
#                  from .whl/llamacpp-src.tgz, started detached (setsid) when this script starts, so it
#                  compiles while the tests run (only with BUDGET >= 420 s); this stage waits for it
#   peer-static    transformers static-compile at N = 1, 8 (~75 s of compiling per N): only if >= 180 s are left
# Time (H200, 2026-11-28, s): tests-engine 77, tests-kernels 95, bench 20, profile 20-25 (one variant),
# profile-mixed 14, peer 50, llamacpp ~40 from a dist: ~320 s, so peer-static ran in what was left. The 1B rows
# (estimated, not yet measured: engine starts with graph capture ~15 s each, 1.2 B bf16 weights drawn in ms)
# add ~40 s to bench and ~60 s to profile (two variants); at ~420 s fewer than 180 s are left and peer-static is skipped,
# its place in the default call taken by the 1B rows. The 1B shape can be left out with SHAPE_1B=0.
# Other stages, by name: tests (= tests-engine tests-kernels), peer-1b (slipstream d2 vs transformers cb-graphs at
# the 1B shape, N = 1, 8, 32, L = 64: ~100 s), llamacpp-1b (llama.cpp on a bf16 GGUF of the 1B shape written on
# the GPU by tools/peers/random_gguf.py, N = 1, 8, 32: ~80 s), ttft (slipstream d1/d2 at N = 1..128: issue 42),
# spec (tools/spec/bench_spec_gpu.py: speculation off/on at N = 1, 8, 32, 128, three workloads, acceptance, and the
# float32 / bf16 equality; ~90 s: issue 49; its table goes into peer.md, like ttft's),
# attention (tools/gpu/bench_attention_cuda.py, into peer.md), tests-engine-thin (the engine tests with
# SLIPSTREAM_THIN_LAUNCH=1; log in logs.tgz, summary in gpu.txt),
# events, bench-thread, llamacpp-server, smoke. PROFILE_ARGS / PROFILE_MIXED_ARGS pass options (e.g.
# --variants) to the profile tools, PROFILE_LIMIT / PROFILE_MIXED_LIMIT their time limits.
# A short call reruns what failed, e.g. the engine tests and llama.cpp from a prebuilt dist in ~150 s:
#   run(command="BUDGET=150 ENGINE_LIMIT=90 bash tools/gpu/gpu_check.sh tests-engine llamacpp", carry=[".whl"], timeout_s=200)
#
# What comes back ($OUT, at most 8 files): gpu.txt (GPU, provenance, each stage's rc and time, as they end),
# cuda-tests-engine.log, cuda-tests-kernels.log (pytest -v with tracebacks, live ERROR log lines with their
# exc_info, the short summary), bench.md, profile.md, profile-mixed.md, peer.md (peer, llama.cpp, static-compile
# tables, each with its provenance header, appended as each ends) and logs.tgz (JUnit XML, JSON, stderr, build
# logs; rewritten after every stage). Every file is written as its stage ends, so a call cut short keeps what ran.
# Without a GPU (a dry run here) the test stages collect and skip, every other stage says "skipped: no CUDA".
set -uo pipefail
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
stages=${*:-tests-engine tests-kernels bench profile profile-mixed peer llamacpp peer-static}
stages=$(echo " $stages " | sed 's/ tests / tests-engine tests-kernels /g')
prov() { python3 -P slipstream/provenance.py "$@"; }  # by path: the header needs no third-party package
HAVE_CUDA=0
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && HAVE_CUDA=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  prov
  date -u +%FT%TZ; echo "stages:$stages (budget ${BUDGET:-540} s, cuda=$HAVE_CUDA)"; } > "$GPU_TXT" 2>&1

BUDGET=${BUDGET:-540}
limit() { local left=$((BUDGET - SECONDS)); echo $(($1 < left ? $1 : (left > 1 ? left : 1))); }
save_logs() { cp "$GPU_TXT" "$LOGS"/ 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
append_peer() { [[ -s $1 ]] && { cat "$1"; echo; } >> "$OUT/peer.md"; }

# --- llama.cpp: a prebuilt dist, else a detached build that runs while the tests do -------------------
LLAMA=/tmp/llamacpp-cuda          # where the dist is unpacked (bin/ + .snapshot-*) or the build goes
LLAMA_DONE=$LOGS/llamacpp-build.done
cu13_libs() {  # torch's cuBLAS 13 / cudart 13 (nvidia/cu13/lib): what the dist links against
    python3 -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__
                for p in glob.glob(os.path.join(d, '*', 'lib', 'libcublas.so.*'))})))" 2>/dev/null
}
if [[ " $stages " == *" llamacpp"* ]]; then
    if [[ -f .whl/llamacpp-cuda-sm90.tar.xz ]]; then  # (a failed unpack ends the stage at once, not at the budget)
        rm -rf "$LLAMA" && mkdir -p "$LLAMA" && tar -xJf .whl/llamacpp-cuda-sm90.tar.xz -C "$LLAMA" && echo 0 > "$LLAMA_DONE" \
            || echo 1 > "$LLAMA_DONE"
        echo "llama.cpp: prebuilt dist ($(head -1 "$LLAMA/BUILD-INFO" 2>/dev/null)), unpack rc=$(cat "$LLAMA_DONE")" >> "$GPU_TXT"
    elif [[ -f .whl/llamacpp-src.tgz && $HAVE_CUDA == 1 && ${BUDGET:-540} -lt 420 ]]; then
        echo 1 > "$LLAMA_DONE"  # the build takes ~7 minutes of the machine's 16 cores
        echo "llama.cpp: no prebuilt dist and a budget of ${BUDGET} s (< 420): no build from source" >> "$GPU_TXT"
    elif [[ -f .whl/llamacpp-src.tgz && $HAVE_CUDA == 1 ]]; then
        rm -rf /tmp/llamacpp-src && mkdir -p /tmp/llamacpp-src && tar -xzf .whl/llamacpp-src.tgz -C /tmp/llamacpp-src
        # the same dist build as on a CPU machine (nvcc here, torch's cuBLAS 13), nice and 12 of 16 cores: the
        # tests, then the bench, share the machine with it (their host times may suffer: gpu.txt says when it ended)
        cublas=$(dirname "$(cu13_libs | cut -d: -f1)")
        setsid nohup bash -c "CUBLAS_DIR=$cublas bash tools/peers/llamacpp_peer.sh toolkit /tmp/llamacpp-tk \
            && LLAMACPP_TOOLKIT=/tmp/llamacpp-tk JOBS=12 nice -n 19 bash tools/peers/llamacpp_peer.sh dist /tmp/llamacpp-src \
               /tmp/llamacpp-build /tmp/llamacpp-dist.tar.xz && mkdir -p $LLAMA && tar -xJf /tmp/llamacpp-dist.tar.xz -C $LLAMA; \
            echo \$? > $LLAMA_DONE" > "$LOGS/llamacpp-build.log" 2>&1 < /dev/null &
        echo "llama.cpp: no prebuilt dist, building from source detached (started at ${SECONDS} s)" >> "$GPU_TXT"
    else
        echo 1 > "$LLAMA_DONE"; echo "llama.cpp: neither a dist nor a source snapshot in .whl/, or no CUDA" >> "$GPU_TXT"
    fi
fi

for stage in $stages; do
    start=$SECONDS
    if ((SECONDS >= BUDGET - 5)); then echo "stage $stage: skipped, budget spent" | tee -a "$GPU_TXT"; continue; fi
    if [[ $HAVE_CUDA == 0 && $stage != tests-* ]]; then
        echo "stage $stage: skipped: no CUDA device (torch.cuda.is_available() is False)" | tee -a "$GPU_TXT"; continue
    fi
    rc=0
    case $stage in
    tests-engine|tests-kernels)
        if [[ $stage == tests-kernels ]]; then t=$(limit "${KERNELS_LIMIT:-110}"); sel=(tests/ --ignore-glob='tests/*cuda*.py')
        else t=$(limit "${ENGINE_LIMIT:-150}"); sel=(tests/*cuda*.py); fi
        per_test=()
        python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 120 --timeout-method signal)
        # -v: each test's name; --tb=long: whole tracebacks; live ERROR lines (with exc_info) even for tests that
        # pass; SIGINT first (pytest prints its summary and writes the XML), SIGKILL 15 s later if that hangs
        timeout -s INT -k 15 $((t > 30 ? t - 15 : t)) python3 -m pytest -m cuda -p no:cacheprovider -v -rfEs \
            --tb=long -o log_cli=true --log-cli-level=ERROR --durations=15 "${per_test[@]}" \
            --junitxml="$LOGS/cuda-$stage.xml" "${sel[@]}" > "$OUT/cuda-$stage.log" 2>&1; rc=$?
        tail -25 "$OUT/cuda-$stage.log" ;;
    bench)  # mean/p90 idle, period ÷ (forward+sampling), the prediction from depth 1, the accounting identity
        timeout $(limit 80) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 32 128 256 --len 128 --repeats 3 --no-progress --json-out "$LOGS/bench.json" \
            > "$OUT/bench.md" 2>"$LOGS/bench.err"; rc=$?
        if [[ ${SHAPE_1B:-1} == 1 ]] && ((SECONDS < BUDGET - 5)); then  # issue 50: the 1B shape in every call
            t1=$SECONDS
            { echo; timeout $(limit ${BENCH_1B_LIMIT:-60}) python3 -m slipstream.cli bench --device cuda \
                --model random-llama-3.2-1b --dtype bfloat16 --streams 1 32 256 --len 64 --repeats 2 --no-progress \
                --json-out "$LOGS/bench-1b.json" 2>"$LOGS/bench-1b.err"; } >> "$OUT/bench.md"; rc1=$?
            echo "  bench random-llama-3.2-1b: rc=$rc1 in $((SECONDS - t1)) s" | tee -a "$GPU_TXT"; ((rc == 0)) && rc=$rc1
        fi ;;
    profile)
        timeout $(limit ${PROFILE_LIMIT:-50}) python3 tools/gpu/profile_forward_cuda.py ${PROFILE_ARGS:-} > "$OUT/profile.md" \
            2>"$LOGS/profile.err"; rc=$?
        if [[ ${SHAPE_1B:-1} == 1 ]] && ((SECONDS < BUDGET - 5)); then
            t1=$SECONDS
            { echo; timeout $(limit ${PROFILE_1B_LIMIT:-90}) python3 tools/gpu/profile_forward_cuda.py --model random-llama-3.2-1b \
                --variants fused gemv --batches 1 8 32 --repeats 20 --launch triton --no-warmup --prefill 2048 ${PROFILE_1B_ARGS:-} \
                2>"$LOGS/profile-1b.err"; } >> "$OUT/profile.md"; rc1=$?
            echo "  profile random-llama-3.2-1b: rc=$rc1 in $((SECONDS - t1)) s" | tee -a "$GPU_TXT"; ((rc == 0)) && rc=$rc1
        fi ;;
    profile-mixed)
        timeout $(limit ${PROFILE_MIXED_LIMIT:-40}) python3 tools/gpu/profile_mixed_cuda.py ${PROFILE_MIXED_ARGS:-} \
            > "$OUT/profile-mixed.md" 2>"$LOGS/profile-mixed.err"; rc=$? ;;
    peer)  # a fresh process per system; peer.json is rewritten after every system (a cut-off run keeps the rest)
        timeout $(limit 100) python3 tools/peers/peer_bench.py --device cuda --dtype bfloat16 --hf-configs cb-graphs \
            --systems 'slipstream d1' 'slipstream d2' 'transformers cb-graphs' --concurrency 1 8 --repeats 2 \
            --no-agreement --json-out "$LOGS/peer.json" > "$LOGS/peer.md" 2>"$LOGS/peer.err"; rc=$?
        append_peer "$LOGS/peer.md" ;;
    peer-1b)  # issue 50: the peer table at the 1B shape (llama.cpp's rows: stage llamacpp-1b)
        timeout $(limit ${PEER_1B_LIMIT:-120}) python3 tools/peers/peer_bench.py --arch llama-3.2-1b --device cuda \
            --dtype bfloat16 --hf-configs cb-graphs --systems 'slipstream d2' 'transformers cb-graphs' \
            --concurrency 1 8 32 --output-len 64 --repeats 2 --no-agreement --json-out "$LOGS/peer-1b.json" \
            > "$LOGS/peer-1b.md" 2>"$LOGS/peer-1b.err"; rc=$?
        append_peer "$LOGS/peer-1b.md" ;;
    attention)  # issue 42: the per-head decode attention kernel vs the grouped one (split-KV), beside the floor
        timeout $(limit 60) python3 tools/gpu/bench_attention_cuda.py --out "$LOGS/attention.md" > "$LOGS/attention.out" \
            2>"$LOGS/attention.err"; rc=$?
        append_peer "$LOGS/attention.md" ;;
    tests-engine-thin)  # the engine tests again with the thin Triton launcher on (its default waits for this)
        t=$(limit "${ENGINE_LIMIT:-150}")
        SLIPSTREAM_THIN_LAUNCH=1 timeout -s INT -k 15 $((t > 30 ? t - 15 : t)) python3 -m pytest -m cuda \
            -p no:cacheprovider -q -rfEs --tb=short tests/*cuda*.py > "$LOGS/cuda-tests-engine-thin.log" 2>&1; rc=$?
        tail -3 "$LOGS/cuda-tests-engine-thin.log" | tee -a "$GPU_TXT" ;;
    ttft)  # issue 42: time to first token at both depths, N = 1..128 (slipstream alone, fresh processes)
        timeout $(limit 120) python3 tools/peers/peer_bench.py --device cuda --dtype bfloat16 \
            --systems 'slipstream d1' 'slipstream d2' --concurrency 1 8 32 128 --repeats 2 --no-agreement \
            --json-out "$LOGS/ttft.json" > "$LOGS/ttft.md" 2>"$LOGS/ttft.err"; rc=$?
        append_peer "$LOGS/ttft.md" ;;
    spec)  # issue 49: speculation (n-gram, defaults) against none, one process, two engines; equality
        timeout $(limit ${SPEC_LIMIT:-90}) python3 tools/spec/bench_spec_gpu.py --device cuda --dtype bfloat16 \
            ${SPEC_ARGS:-} --out "$LOGS/spec.md" > "$LOGS/spec.out" 2>"$LOGS/spec.err"; rc=$?
        [[ -s $LOGS/spec.md ]] || cp "$LOGS/spec.out" "$LOGS/spec.md"  # (cut short: the rows printed so far)
        append_peer "$LOGS/spec.md" ;;
    llamacpp|llamacpp-server|llamacpp-1b)
        while [[ ! -f $LLAMA_DONE ]] && ((SECONDS < BUDGET - 40)); do sleep 2; done
        if [[ ! -f $LLAMA_DONE ]]; then rc=124; echo "stage $stage: the llama.cpp build did not end in time" >> "$GPU_TXT"
        elif [[ $(cat "$LLAMA_DONE") != 0 ]]; then rc=$(cat "$LLAMA_DONE")
        else
            export LD_LIBRARY_PATH=$(cu13_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
            if [[ $stage == llamacpp-1b ]]; then  # the GGUF is written here, on the GPU (tools/peers/random_gguf.py)
                timeout $(limit ${LLAMA_1B_LIMIT:-100}) python3 tools/peers/llamacpp_bench.py --build "$LLAMA" --dtype bf16 \
                    --spec random-llama-3.2-1b --concurrency 1 8 32 --output-len 64 --repeats 2 ${LLAMA_ARGS:-} \
                    --json-out "$LOGS/llamacpp-1b.json" > "$LOGS/llamacpp-1b.md" 2>"$LOGS/llamacpp-1b.err"; rc=$?
                append_peer "$LOGS/llamacpp-1b.md"
            elif [[ $stage == llamacpp ]]; then
                timeout $(limit 80) python3 tools/peers/llamacpp_bench.py --build "$LLAMA" --dtype bf16 --concurrency 1 8 \
                    --repeats 2 ${LLAMA_ARGS:-} --json-out "$LOGS/llamacpp-bf16.json" > "$LOGS/llamacpp-bf16.md" \
                    2>"$LOGS/llamacpp-bf16.err"; rc=$?
                append_peer "$LOGS/llamacpp-bf16.md"
            else  # llama-server: sampling, streaming, its own scheduler
                timeout $(limit 150) python3 tools/peers/llamacpp_server_bench.py --build "$LLAMA" --dtype bf16 --concurrency 1 8 \
                    ${LLAMA_ARGS:-} --json-out "$LOGS/llamacpp-server.json" > "$LOGS/llamacpp-server.md" \
                    2>"$LOGS/llamacpp-server.err"; rc=$?
                append_peer "$LOGS/llamacpp-server.md"
            fi
        fi
        cp /tmp/llamacpp-build.build.log /tmp/llamacpp-build.configure.log "$LOGS"/ 2>/dev/null ;;
    peer-static)  # compiles per batch size: only where its time allows
        if ((BUDGET - SECONDS < 180)); then echo "stage $stage: skipped, $((BUDGET - SECONDS)) s left (< 180)" \
            | tee -a "$GPU_TXT"; continue; fi
        timeout $(limit 200) python3 tools/peers/peer_bench.py --device cuda --dtype bfloat16 --hf-configs static-compile \
            --systems 'transformers static-compile' --concurrency 1 8 --repeats 2 --no-agreement \
            --json-out "$LOGS/peer-static.json" > "$LOGS/peer-static.md" 2>"$LOGS/peer-static.err"; rc=$?
        append_peer "$LOGS/peer-static.md" ;;
    events)
        timeout $(limit 60) python3 tools/gpu/bench_event_wait.py --repeats 300 > "$LOGS/event-wait.md" 2>"$LOGS/event-wait.err"; rc=$?
        append_peer "$LOGS/event-wait.md" ;;
    bench-thread)  # the loop woken by a pool thread instead of a host function
        timeout $(limit 150) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 32 128 --len 128 --repeats 3 --no-progress --event-wait thread \
            > "$LOGS/bench-thread.md" 2>"$LOGS/bench-thread.err"; rc=$?
        append_peer "$LOGS/bench-thread.md" ;;
    smoke)
        timeout $(limit 100) python3 -m slipstream.cli bench --device cuda --model random-smollm2-135m --dtype bfloat16 \
            --streams 1 8 --len 32 --repeats 1 --no-progress > "$LOGS/smoke-bench.md" 2>"$LOGS/smoke-bench.err"; rc=$?
        append_peer "$LOGS/smoke-bench.md" ;;
    *) echo "gpu_check: unknown stage $stage" >&2; exit 2 ;;
    esac
    echo "stage $stage: rc=$rc in $((SECONDS - start)) s" | tee -a "$GPU_TXT"
    save_logs
done
[[ -f $LLAMA_DONE ]] && echo "llama.cpp build: rc=$(cat "$LLAMA_DONE")" >> "$GPU_TXT"
save_logs
for f in "$LOGS"/*.err; do [[ -s $f ]] && { echo "== ${f##*/} (last lines)"; tail -6 "$f"; }; done
for f in "$OUT"/bench.md "$OUT"/profile-mixed.md "$OUT"/peer.md "$GPU_TXT"; do [[ -s $f ]] && { echo "== ${f##*/}"; cat "$f"; }; done
exit 0
