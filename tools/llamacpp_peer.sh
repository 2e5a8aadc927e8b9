#!/usr/bin/env bash
# llama.cpp as a peer: take a source snapshot, build only the benchmark targets, run tools/llamacpp_bench.py.
# The snapshot lives OUTSIDE this repository (the project never vendors llama.cpp).
#
#   tools/llamacpp_peer.sh source DIR     # a trimmed ggml-org/llama.cpp tree in DIR (no models/, docs/, tests/, ...)
#   tools/llamacpp_peer.sh pack DIR TGZ   # that tree as a tarball small enough to carry to a lent GPU
#   tools/llamacpp_peer.sh build DIR BUILD  # cmake + ninja: llama-batched-bench (+ llama-server if LLAMACPP_SERVER=1)
#   tools/llamacpp_peer.sh bench BUILD [llamacpp_bench.py args...]
#
# Where the source comes from (first that is set / works):
#   LLAMACPP_GIT_DIR   a git directory of ggml-org/llama.cpp (e.g. from the search tool's fetch) -> `git archive`
#   otherwise          the llama.cpp tree vendored in the llama-cpp-python sdist from PyPI (pip download,
#                      version $LLAMACPP_PY_VERSION, default 0.3.36): a snapshot of ggml-org/llama.cpp (MIT);
#                      its commit is read from the sdist's submodule and written to DIR/.snapshot-commit.
# CUDA is built when nvcc and a GPU are found (LLAMACPP_CUDA=0/1 overrides) (-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}); else a CPU build.
# LLAMACPP_NATIVE=0: no -march=native; AVX2/FMA/F16C/BMI2 and AVX-512 (F, VBMI, VNNI, BF16) + AVX-VNNI named
#   instead (the 2-core development machine: its native build segfaulted in ggml's AMX path).
# LLAMACPP_BENCH=1 also builds llama-bench (token generation at batch 1, threads and flash attention swept).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
# Not needed to build or run the two targets; models/ alone holds ~75 MB of vocab files.
# tools/ui: only its CMake files and templates are needed (no web UI is built).
TRIM=(models docs media tests examples benches .devops .github tools/ui/src tools/ui/tests tools/ui/package-lock.json
      tools/mtmd/tests gguf-py/tests pocs skills app)

source_tree() {
    local dest=$1
    mkdir -p "$dest"
    if [[ -n ${LLAMACPP_GIT_DIR:-} ]]; then
        git --git-dir="$LLAMACPP_GIT_DIR" archive --format=tar HEAD | tar -x -C "$dest"
        git --git-dir="$LLAMACPP_GIT_DIR" log -1 --format='%H %cI' > "$dest/.snapshot-commit"
        echo "ggml-org/llama.cpp from $LLAMACPP_GIT_DIR" > "$dest/.snapshot-origin"
    else
        local ver=${LLAMACPP_PY_VERSION:-0.3.36} dl
        dl=$(mktemp -d)
        "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d "$dl"
        tar -xzf "$dl"/llama_cpp_python-"$ver".tar.gz -C "$dl"
        local vend="$dl/llama_cpp_python-$ver/vendor/llama.cpp"
        (cd "$vend" && git log -1 --format='%H %cI' 2>/dev/null || echo unknown) > "$dest/.snapshot-commit"
        echo "ggml-org/llama.cpp vendored in llama-cpp-python $ver (PyPI sdist)" > "$dest/.snapshot-origin"
        tar -C "$vend" --exclude=.git -cf - . | tar -x -C "$dest"
        rm -rf "$dl"
    fi
    for d in "${TRIM[@]}"; do rm -rf "${dest:?}/$d"; done
    echo "llama.cpp source in $dest: $(cat "$dest/.snapshot-origin"), commit $(cat "$dest/.snapshot-commit"), $(du -sh "$dest" | cut -f1)"
}

build() {
    local src=$1 bld=$2 cuda=OFF targets=(llama-batched-bench) server=OFF
    # a GPU and nvcc, unless LLAMACPP_CUDA=0/1 says otherwise (a machine may have nvcc but no GPU, nor cuBLAS)
    command -v nvcc >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && cuda=ON
    [[ -n ${LLAMACPP_CUDA:-} ]] && { [[ $LLAMACPP_CUDA == 1 ]] && cuda=ON || cuda=OFF; }
    [[ ${LLAMACPP_SERVER:-0} == 1 ]] && { server=ON; targets+=(llama-server); }
    local flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
                 -DLLAMA_BUILD_SERVER=$server -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF
                 -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DGGML_CUDA=$cuda -DBUILD_SHARED_LIBS=OFF)
    [[ $cuda == ON ]] && flags+=(-DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}")
    [[ ${LLAMACPP_NATIVE:-1} == 0 ]] && flags+=(-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
                                                 -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON)
    [[ ${LLAMACPP_BENCH:-0} == 1 ]] && targets+=(llama-bench)
    cmake -S "$src" -B "$bld" "${flags[@]}" > "$bld.configure.log" 2>&1 || { tail -30 "$bld.configure.log"; return 1; }
    cmake --build "$bld" --target "${targets[@]}" -j "${JOBS:-$(nproc)}" > "$bld.build.log" 2>&1 || { tail -40 "$bld.build.log"; return 1; }
    echo "built ${targets[*]} (GGML_CUDA=$cuda) in $bld"
}

case ${1:-} in
source) source_tree "$2" ;;
pack)   tar -C "$2" -czf "$3" . && du -h "$3" ;;
build)  build "$2" "$3" ;;
bench)  bld=$2; shift 2; exec "$PY" "$here/llamacpp_bench.py" --build "$bld" "$@" ;;
*) sed -n '2,16p' "$0"; exit 2 ;;
esac
