"""Wake-up latency of the ways the asyncio loop can await a CUDA event (needs a GPU).

For each strategy of slipstream/runtime/devices/cuda_device.py (host_func, thread, poll) we enqueue a
kernel of known length, record an event after it, await it from a uvloop loop, and measure the
time from the event's completion on the GPU (a timing event, mapped to the host clock) to the
moment the awaiting coroutine resumes. Medians and p90 over --repeats after --warmup waits.

    python tools/gpu/bench_event_wait.py --repeats 500
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import uvloop

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))))  # this checkout

from slipstream.runtime.devices.cuda_device import CUDADevice  # noqa: E402


async def measure(device: CUDADevice, repeats: int, warmup: int, spin_ms: float) -> list[float]:
    stream = device.compute.stream
    cycles = int(spin_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    lat = []
    for i in range(warmup + repeats):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)  # keeps the GPU busy so the wait really waits
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        ev = device.compute.record()
        await ev.wait_async()
        woke = time.perf_counter()
        if i >= warmup:
            lat.append((woke - device.host_time(done)) * 1e6)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--spin-ms", type=float, default=0.2, help="GPU busy time before each event")
    args = ap.parse_args()
    from slipstream.provenance import header, provenance  # noqa: E402

    print(header(provenance()), flush=True)
    rows = []
    for strategy in ("host_func", "thread", "poll"):
        try:
            device = CUDADevice(event_wait=strategy)
        except RuntimeError as e:
            rows.append(f"| {strategy} | unavailable: {e} | | |")
            continue
        device.start_clock()
        lat = uvloop.run(measure(device, args.repeats, args.warmup, args.spin_ms))
        q = statistics.quantiles(lat, n=10)
        rows.append(f"| {strategy} | {statistics.median(lat):.1f} | {q[8]:.1f} | {min(lat):.1f} |")
        device.close()
    print(f"{torch.cuda.get_device_name()}, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, "
          f"torch {torch.__version__}, {args.repeats} waits each\n")
    print("| event_wait | median wake-up (µs) | p90 (µs) | min (µs) |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
