#!/usr/bin/env bash
# Everything a lent GPU machine needs and cannot fetch, into .whl/ (ignored; carried with run(carry=[".whl"])):
#   1. the Python wheels its image lacks (tools/gpu_wheels.sh);
#   2. the git state of this checkout (the copy sent there has no .git): .whl/provenance-git.json, read by
#      slipstream/provenance.py, so raw outputs name the commit that really ran and whether it was dirty;
#   3. a trimmed llama.cpp source snapshot (tools/llamacpp_peer.sh: no models/ or docs/), .whl/llamacpp-src.tgz,
#      from $LLAMACPP_SRC (default /work/wt/llamacpp-src, outside this repository; made if missing).
#      LLAMACPP=0 skips it (the `tests` stage needs only 1 and 2).
# Run it right before the device call: a stamp written before a later commit would misname the run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/gpu_wheels.sh
# by path, not `-m slipstream.provenance`: importing the package needs msgspec, torch, ... (-P: not its folder on sys.path)
"${PYTHON:-python3}" -P slipstream/provenance.py stamp
if [[ ${LLAMACPP:-1} != 0 ]]; then
    src=${LLAMACPP_SRC:-/work/wt/llamacpp-src}
    [[ -f $src/CMakeLists.txt ]] || bash tools/llamacpp_peer.sh source "$src"
    bash tools/llamacpp_peer.sh pack "$src" .whl/llamacpp-src.tgz
fi
du -sh .whl
