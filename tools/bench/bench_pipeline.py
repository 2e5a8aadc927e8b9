"""Blocking (depth 1) vs pipelined (depth 2) decode for several models; wraps `slipstream bench`.

    python tools/bench/bench_pipeline.py [--models smollm2-135m tiny-random] [slipstream bench options]
"""
from __future__ import annotations

import sys

from slipstream.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    models = ["smollm2-135m", "tiny-random"]
    if "--models" in args:
        i = args.index("--models")
        j = next((k for k in range(i + 1, len(args)) if args[k].startswith("--")), len(args))
        models, args = args[i + 1 : j], args[:i] + args[j:]
    for m in models:
        print(f"\n### {m}\n", flush=True)
        main(["bench", "--model", m, *args])
