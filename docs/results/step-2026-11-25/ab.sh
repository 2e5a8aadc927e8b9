#!/bin/bash
# alternating before/after pairs of the host-only benchmark in one invocation (issue 28 must-show 1)
PY=/work/main/.venv/bin/python
echo "# command: bash ab.sh  (3 pairs; each side: tools/bench_host.py --streams 32 256 --len 128 --repeats 3 --quiet)"
echo "# date: $(date -u +%FT%TZ)  host: $(uname -n) $(nproc) cores  python: $($PY -V)  torch: $($PY -c 'import torch;print(torch.__version__)')"
for pair in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then tree=/tmp/before-28; else tree=/work/main; fi
    echo "=== pair $pair $side: commit $(git -C $tree rev-parse --short HEAD), dirty=$(git -C $tree status --porcelain --untracked-files=no | wc -l), load: $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $tree && PYTHONPATH=$tree $PY tools/bench_host.py --streams 32 256 --len 128 --repeats 3 --quiet) 2>&1
  done
done
echo "=== step trace"
for side in before after; do
  if [ $side = before ]; then tree=/tmp/before-28; else tree=/work/main; fi
  echo "--- $side: commit $(git -C $tree rev-parse --short HEAD), dirty=$(git -C $tree status --porcelain --untracked-files=no | wc -l)"
done
