#!/usr/bin/env bash
# llama.cpp as a peer: take a source snapshot, build only the benchmark targets, run tools/peers/llamacpp_bench.py.
# The snapshot lives OUTSIDE this repository (the project never vendors llama.cpp).
#
#   tools/peers/llamacpp_peer.sh source DIR     # a trimmed ggml-org/llama.cpp tree in DIR (no models/, docs/, tests/, ...)
#   tools/peers/llamacpp_peer.sh pack DIR TGZ   # that tree as a tarball small enough to carry to a lent GPU
#   tools/peers/llamacpp_peer.sh build DIR BUILD  # cmake + ninja: llama-batched-bench (+ llama-server if LLAMACPP_SERVER=1)
#   tools/peers/llamacpp_peer.sh bench BUILD [llamacpp_bench.py args...]
#   tools/peers/llamacpp_peer.sh toolkit TK  # a CUDA toolkit to build against WITHOUT a GPU: this machine's nvcc
#                                            # ($CUDA_HOME, default /usr/local/cuda, else the nvcc on PATH; its lib/
#                                            # or lib64/, whichever it has) + cuBLAS 13 headers/libs from the
#                                            # nvidia-cublas wheel (or an installed one: CUBLAS_DIR=.../nvidia/cu13)
#                                            # + a link-time libcuda stub (the driver's, at run time)
#   tools/peers/llamacpp_peer.sh dist SRC BUILD TXZ  # with TK's toolkit (LLAMACPP_TOOLKIT=TK): llama-batched-bench and
#                                            # llama-server for sm_90, shared ggml libs (one copy of the CUDA code),
#                                            # no -march=native, stripped, RPATH $ORIGIN -> TXZ (bin/ + .snapshot-*)
#
# Where the source comes from (first that is set / works):
#   LLAMACPP_GIT_DIR   a git directory of ggml-org/llama.cpp (e.g. from the search tool's fetch) -> `git archive`
#   otherwise          the llama.cpp tree vendored in the llama-cpp-python sdist from PyPI (pip download,
#                      version $LLAMACPP_PY_VERSION, default 0.3.36): a snapshot of ggml-org/llama.cpp (MIT);
#                      its commit is read from the sdist's submodule and written to DIR/.snapshot-commit.
# A dist runs on the GPU image against its torch's cuBLAS 13 / cudart 13 (nvidia/cu13/lib, `cu13_libs` below puts
# them on LD_LIBRARY_PATH) and the driver's libcuda.so.1; built with nvcc 13.0 (= the image's driver's CUDA).
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

toolkit() {
    # cuBLAS 13.0.0.19: the oldest 13.x, so the binaries need no symbol a newer libcublas.so.13 (torch's) lacks
    local tk=$1 home=${CUDA_HOME:-} ver=${CUBLAS_VERSION:-13.0.0.19} dl lib stub="libcuda stub"
    if [[ -z $home ]]; then  # /usr/local/cuda, else the toolkit of the nvcc on PATH
        home=/usr/local/cuda
        [[ -x $home/bin/nvcc ]] || home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    fi
    [[ -x $home/bin/nvcc ]] || { echo "toolkit: no nvcc in $home/bin (set CUDA_HOME)" >&2; return 1; }
    home=$(cd "$home" && pwd -P)
    rm -rf "$tk" && mkdir -p "$(dirname "$tk")" && cp -a "$home" "$tk"
    # the libraries' folder: lib/ in a toolkit made of wheels (this machine's), lib64 -> targets/x86_64-linux/lib
    # in NVIDIA's packages (the GPU image's; 2026-11-27 on the H200: "ln: target '/tmp/llamacpp-tk/lib/'")
    lib=$tk/lib
    [[ -d $lib || ! -d $tk/lib64 ]] || lib=$tk/lib64
    mkdir -p "$tk/include" "$lib/stubs"
    if [[ -n ${CUBLAS_DIR:-} ]]; then  # an installed nvidia-cublas (e.g. torch's nvidia/cu13 on the GPU image)
        ver="from $CUBLAS_DIR"
        ln -sf "$CUBLAS_DIR"/include/cublas*.h "$tk/include/"
        ln -sf "$CUBLAS_DIR"/lib/libcublas.so.13 "$CUBLAS_DIR"/lib/libcublasLt.so.13 "$lib/"
    else
        dl=$(mktemp -d)
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$dl" "nvidia-cublas==$ver"
        (cd "$dl" && unzip -q -o ./*.whl 'nvidia/cu13/include/*' 'nvidia/cu13/lib/libcublas.so.13' \
            'nvidia/cu13/lib/libcublasLt.so.13')
        cp "$dl"/nvidia/cu13/include/* "$tk/include/" && cp "$dl"/nvidia/cu13/lib/* "$lib/"
        rm -rf "$dl"
    fi
    (cd "$lib" && ln -sf libcublas.so.13 libcublas.so && ln -sf libcublasLt.so.13 libcublasLt.so)
    # libcuda.so.1 comes with the driver, absent here: a stub with its soname and the driver calls ggml-cuda makes
    # (VMM pool), only for linking; at run time the loader takes the real one. A full toolkit brings its own.
    if [[ -f $lib/stubs/libcuda.so ]]; then
        stub="the toolkit's libcuda stub"
    else
        local fns="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate
                   cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap"
        for f in $fns; do echo "int $f(void) { return 999; }"; done > "$lib/stubs/cuda_stub.c"
        gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/stubs/libcuda.so" "$lib/stubs/cuda_stub.c"
    fi
    echo "CUDA toolkit in $tk (libraries in ${lib#"$tk"/}): nvcc $("$tk/bin/nvcc" --version | grep -o 'release [0-9.]*'), cuBLAS $ver, $stub"
}

dist() {
    local src=$1 bld=$2 txz=$3 tk=${LLAMACPP_TOOLKIT:?set LLAMACPP_TOOLKIT to a toolkit dir (toolkit TK)} t0=$SECONDS
    [[ -x $tk/bin/nvcc ]] || { echo "no nvcc in $tk" >&2; return 1; }
    local flags=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
                 -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF
                 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF
                 -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}-real" -DBUILD_SHARED_LIBS=ON
                 -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" -DCUDAToolkit_ROOT="$tk" -DCMAKE_BUILD_RPATH='$ORIGIN'
                 -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--as-needed
                 # the programs link against libggml-cuda, whose cuBLAS and driver symbols this machine
                 # resolves only through stubs: they are the GPU image's to provide at run time
                 "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed -Wl,--allow-shlib-undefined")
    mkdir -p "$bld"
    cmake -S "$src" -B "$bld" "${flags[@]}" > "$bld.configure.log" 2>&1 || { tail -30 "$bld.configure.log"; return 1; }
    cmake --build "$bld" --target llama-batched-bench llama-server -j "${JOBS:-$(nproc)}" > "$bld.build.log" 2>&1 \
        || { tail -40 "$bld.build.log"; return 1; }
    local stage
    stage=$(mktemp -d)
    mkdir -p "$stage/bin"
    cp "$bld"/bin/llama-batched-bench "$bld"/bin/llama-server "$stage/bin/"
    cp -P "$bld"/bin/*.so* "$stage/bin/"
    # OpenMP (ggml-cpu) travels too: the GPU image need not have GCC's runtime (libstdc++ it has, newer)
    local lib
    for lib in $(objdump -p "$stage"/bin/* 2>/dev/null | awk '/NEEDED/ && $2 ~ /^libgomp/ {print $2}' | sort -u); do
        cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')" "$stage/bin/$lib"
    done
    strip --strip-unneeded "$stage"/bin/*
    cp "$src/.snapshot-commit" "$src/.snapshot-origin" "$stage/"
    { echo "built $(date -u +%FT%TZ) in $((SECONDS - t0)) s on $(uname -m), $(nproc) cores"
      echo "nvcc: $("$tk/bin/nvcc" --version | tail -2 | head -1)"; echo "cmake ${flags[*]}"
      echo "needs: $(objdump -p "$stage"/bin/*.so* "$stage"/bin/llama-* 2>/dev/null | awk '/NEEDED/ {print $2}' | sort -u | tr '\n' ' ')"
    } > "$stage/BUILD-INFO"
    tar -C "$stage" -cJf "$txz.partial" . && mv "$txz.partial" "$txz" && rm -rf "$stage"  # (whole or absent)
    cat "$bld.configure.log" | grep -i "cuda\|cublas" | head -5 >&2 || true
    echo "dist $txz: $(du -h "$txz" | cut -f1) (llama-batched-bench, llama-server, ggml libs, sm_${CUDA_ARCH:-90}) in $((SECONDS - t0)) s"
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
toolkit) toolkit "$2" ;;
dist)   dist "$2" "$3" "$4" ;;
bench)  bld=$2; shift 2; exec "$PY" "$here/llamacpp_bench.py" --build "$bld" "$@" ;;
*) sed -n '2,24p' "$0"; exit 2 ;;
esac
