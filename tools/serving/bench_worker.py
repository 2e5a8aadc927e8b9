"""Worker mode vs in-process Engine: per-token overhead (µs/token) and requests/s of small requests.

    python tools/serving/bench_worker.py [--model tiny-random] [--address ipc:///tmp/x.sock] [--repeats 5]

Starts a `slipstream worker` subprocess with the same engine settings as the in-process Engine,
runs each scenario on both (alternating; best of --repeats, the least disturbed run on a shared
machine), and prints a markdown table.
Overhead per token = (worker wall time - in-process wall time) / tokens delivered.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import os as _os
import sys as _sys

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
_sys.path[:0] = [_ROOT, _os.path.join(_ROOT, "tools", "common")]  # this checkout, the shared helpers

from bench_lines import stop  # noqa: E402 (tools/common)

from slipstream import Client, Engine, EngineConfig, SamplingParams  # noqa: E402


@dataclass
class Scenario:
    name: str
    requests: int
    concurrency: int
    prompt_len: int
    max_tokens: int
    stream: bool


SCENARIOS = [
    Scenario("1 stream x 256 tokens", 1, 1, 8, 256, True),
    Scenario("8 streams x 128 tokens", 8, 8, 8, 128, True),
    Scenario("32 streams x 64 tokens", 32, 32, 8, 64, True),
    Scenario("512 small requests (complete, 2 tokens), 32 at a time", 512, 32, 8, 2, False),
]


async def run_scenario(api, sc: Scenario) -> tuple[float, int]:
    """Wall seconds and tokens delivered for one scenario on an Engine or a Client (same API)."""
    params = SamplingParams(max_tokens=sc.max_tokens, temperature=0.0, ignore_eos=True)
    sem = asyncio.Semaphore(sc.concurrency)

    async def one(i: int) -> int:
        prompt = [3 + (i * 7 + k) % 250 for k in range(sc.prompt_len)]
        async with sem:
            if sc.stream:
                return sum([len(d.token_ids) async for d in api.stream(prompt, params)])
            return len((await api.complete(prompt, params)).token_ids)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(sc.requests))))
    return time.perf_counter() - t0, tokens


def start_worker(args, config: EngineConfig) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream.cli", "worker", "--bind", args.address, "--model", config.model,
           "--device", config.device, "--max-batch-size", str(config.max_batch_size),
           "--max-num-batched-tokens", str(config.max_num_batched_tokens), "--max-queued", "1024",
           "--log-level", "warning"]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


async def bench(args) -> list[tuple[Scenario, float, float, int]]:
    config = EngineConfig(model=args.model, device=args.device, max_batch_size=32, max_num_batched_tokens=512)
    proc = start_worker(args, config)
    try:
        rows = []
        async with Engine(config) as engine, Client(args.address, timeout=60, connect_timeout=120) as client:
            for api in (engine, client):  # warm both paths once
                await run_scenario(api, Scenario("warmup", 4, 4, 8, 8, True))
            for sc in SCENARIOS:
                times = {"engine": [], "worker": []}
                for _ in range(args.repeats):
                    for name, api in (("engine", engine), ("worker", client)):  # alternate: drift hits both
                        seconds, tokens = await run_scenario(api, sc)
                        times[name].append(seconds)
                rows.append((sc, min(times["engine"]), min(times["worker"]), tokens))  # best of: least disturbed
                print(f"  {sc.name}: engine {rows[-1][1]:.3f} s, worker {rows[-1][2]:.3f} s", file=sys.stderr)
        return rows
    finally:
        stop(proc)


def table(rows) -> str:
    lines = ["| scenario | tokens | in-process | worker | overhead µs/token | in-process req/s | worker req/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for sc, t_eng, t_wrk, tokens in rows:
        over = (t_wrk - t_eng) / tokens * 1e6
        lines.append(f"| {sc.name} | {tokens} | {t_eng * 1e3:.0f} ms | {t_wrk * 1e3:.0f} ms | {over:+.0f} | "
                     f"{sc.requests / t_eng:.0f} | {sc.requests / t_wrk:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--address", default=None, help="default: an ipc socket in a temporary folder")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from slipstream.provenance import header, provenance  # noqa: E402

    print(header(provenance()), flush=True)
    args.address = args.address or f"ipc://{tempfile.mkdtemp(prefix='swb')}/w.sock"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = asyncio.run(bench(args))
    print(f"{time.strftime('%Y-%m-%d')}, {platform.node() or 'host'}: {os.cpu_count()} CPUs, model {args.model}, "
          f"{args.device}, {args.address.split(':')[0]} socket, best of {args.repeats}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
