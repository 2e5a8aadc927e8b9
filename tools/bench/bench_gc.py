"""What a full garbage collection costs with an engine started, by what is frozen.

    python tools/bench/bench_gc.py [--model tiny-random]

Each heap in a fresh process (a CPU engine started, one request served), then gc.collect() timed
(process CPU time) three times, beside the tracked object count it walks:
  none    EngineConfig(freeze_gc=False)
  start   the engine's own freeze (slipstream/gc_freeze.py): what existed before it built its parts
  all     everything alive after the start frozen (what the engine did before issue 27)
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's slipstream

HEAPS = ("none", "start", "all")


async def measure(model: str, heap: str) -> None:
    from slipstream import Engine, EngineConfig, SamplingParams

    async with Engine(EngineConfig(model=model, device="cpu", freeze_gc=heap == "start")) as engine:
        await engine.complete("warm up", SamplingParams(max_tokens=4))
        if heap == "all":
            gc.collect()
            gc.freeze()
        for _ in range(3):
            t0 = time.process_time()
            gc.collect()
            ms = (time.process_time() - t0) * 1e3
            print(f"| {heap} | {gc.get_freeze_count()} | {len(gc.get_objects())} | {ms:.1f} |", flush=True)
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--heap", choices=HEAPS, help="(internal: one heap, in this process)")
    args = ap.parse_args(argv)
    if args.heap:
        asyncio.run(measure(args.model, args.heap))
        return 0
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    print("| frozen | frozen objects | tracked objects a collection walks | gc.collect() CPU ms |\n|---|---:|---:|---:|",
          flush=True)
    for heap in HEAPS:
        subprocess.run([sys.executable, __file__, "--model", args.model, "--heap", heap], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
