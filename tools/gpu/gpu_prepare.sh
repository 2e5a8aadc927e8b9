#!/usr/bin/env bash
# Everything a lent GPU machine needs and cannot fetch, into .whl/ (ignored; carried with run(carry=[".whl"])):
#   1. the Python wheels its image lacks (tools/gpu/gpu_wheels.sh);
#   2. the git state of this checkout (the copy sent there has no .git): .whl/provenance-git.json, read by
#      slipstream/provenance.py, so raw outputs name the commit that really ran and whether it was dirty;
#   3. llama.cpp: the prebuilt CUDA dist (sm_90, ~tens of MB, built on a CPU machine: tools/peers/llamacpp_peer.sh
#      toolkit + dist) from $LLAMACPP_DIST when it is set, else the first that is there of
#      /work/wt/llamacpp-cuda/llamacpp-cuda-sm90.tar.xz and /tmp/llcuda/llamacpp-cuda-sm90.tar.xz (where the
#      build of docs/results/llamacpp-cuda-2026-11-27/README.md writes it; a truncated one is refused), else a
#      trimmed source snapshot, .whl/llamacpp-src.tgz, from $LLAMACPP_SRC (default /work/wt/llamacpp-src,
#      outside this repository; made if missing), which tools/gpu/gpu_check.sh then builds on the GPU machine,
#      detached, while the tests run (budget >= 420 s). LLAMACPP=0 skips it (the `tests` stages need only 1, 2).
# Run it right before the device call: a stamp written before a later commit would misname the run.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root
bash tools/gpu/gpu_wheels.sh
# by path, not `-m slipstream.provenance`: importing the package needs msgspec, torch, ... (-P: not its folder on sys.path)
"${PYTHON:-python3}" -P slipstream/provenance.py stamp
rm -f .whl/llamacpp-src.tgz .whl/llamacpp-cuda-sm90.tar.xz
if [[ ${LLAMACPP:-1} != 0 ]]; then
    dist=${LLAMACPP_DIST:-}
    if [[ -z $dist ]]; then
        for dist in /work/wt/llamacpp-cuda/llamacpp-cuda-sm90.tar.xz /tmp/llcuda/llamacpp-cuda-sm90.tar.xz; do
            [[ -f $dist ]] && break
        done
    fi
    # (whole: a dist still being written, or cut short, would cost the GPU call its llama.cpp stage)
    if [[ -f $dist ]] && ! tar -tJf "$dist" 2>/dev/null | grep '^\./bin/llama-batched-bench$' >/dev/null; then  # (not -q: pipefail)
        echo "gpu_prepare: $dist is not a whole dist (no bin/llama-batched-bench in it, or a truncated archive)" >&2
        exit 1
    fi
    if [[ -f $dist ]]; then
        cp "$dist" .whl/llamacpp-cuda-sm90.tar.xz
        echo "llama.cpp: prebuilt dist $dist ($(du -h "$dist" | cut -f1))"
    else
        echo "llama.cpp: no prebuilt dist (LLAMACPP_DIST=${LLAMACPP_DIST:-}): the source snapshot instead"
        src=${LLAMACPP_SRC:-/work/wt/llamacpp-src}
        [[ -f $src/CMakeLists.txt ]] || bash tools/peers/llamacpp_peer.sh source "$src"
        bash tools/peers/llamacpp_peer.sh pack "$src" .whl/llamacpp-src.tgz
    fi
fi
du -sh .whl
