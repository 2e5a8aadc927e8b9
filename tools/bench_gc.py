"""What a full garbage collection costs with an engine started, and after gc.freeze().

    python tools/bench_gc.py [--model tiny-random]

Starts an engine (CPU), then times gc.collect() (process CPU time) three times with the heap as it
is, and twice after freezing it, as Engine.start does (slipstream/gc_freeze.py). Prints the tracked
object counts beside the times.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's slipstream


async def main_async(model: str) -> None:
    from slipstream import Engine, EngineConfig

    async with Engine(EngineConfig(model=model, device="cpu", freeze_gc=False)):
        print("| heap | tracked objects | gc.collect() CPU ms |\n|---|---:|---:|")
        for frozen in (False, True):
            if frozen:
                gc.freeze()
            for _ in range(3 if not frozen else 2):
                t0 = time.process_time()
                gc.collect()
                ms = (time.process_time() - t0) * 1e3
                print(f"| {'frozen' if frozen else 'as is'} | {len(gc.get_objects())} | {ms:.1f} |", flush=True)
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    args = ap.parse_args(argv)
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    asyncio.run(main_async(args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
