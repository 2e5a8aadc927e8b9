"""HTTP (`slipstream serve`) vs in-process Engine: overhead per streamed token, in one run.

    python tools/serving/bench_http.py [--model tiny-random] [--repeats 5] [--out FILE]

Starts `slipstream serve` as a subprocess with the same engine settings as an in-process Engine,
runs each scenario on both, alternating (ABAB, so drift on a shared machine hits both), and
prints a markdown table with a provenance header. The HTTP client is raw httpx reading SSE (no
OpenAI SDK parsing): what is measured is the server's cost plus one loopback hop.
Overhead per token = (HTTP wall time - in-process wall time) / tokens, per ABAB pair; the table
gives the median, mean and p90 over pairs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import uvloop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))  # the shared helpers
from bench_lines import stop  # noqa: E402
from provenance import header  # noqa: E402

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402


@dataclass
class Scenario:
    name: str
    requests: int
    concurrency: int
    max_tokens: int


SCENARIOS = [
    Scenario("1 stream x 256 tokens", 1, 1, 256),
    Scenario("8 streams x 128 tokens", 8, 8, 128),
    Scenario("32 streams x 64 tokens", 32, 32, 64),
    Scenario("128 streams x 16 tokens, 32 at a time", 128, 32, 16),
]


def prompt(i: int) -> str:
    return f"request {i}: " + "lorem ipsum " * 4


async def run_engine(engine: Engine, sc: Scenario) -> tuple[float, int]:
    params = SamplingParams(max_tokens=sc.max_tokens, temperature=0.0, ignore_eos=True)
    sem = asyncio.Semaphore(sc.concurrency)

    async def one(i: int) -> int:
        async with sem:
            return sum([len(d.token_ids) async for d in engine.stream(prompt(i), params)])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(sc.requests))))
    return time.perf_counter() - t0, tokens


async def run_http(http: httpx.AsyncClient, sc: Scenario) -> tuple[float, int]:
    sem = asyncio.Semaphore(sc.concurrency)
    body = {"max_tokens": sc.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(i: int) -> int:
        async with sem:
            async with http.stream("POST", "/v1/completions", json={**body, "prompt": prompt(i)}) as r:
                last = b""
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = line
                return json.loads(last[6:])["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(sc.requests))))
    return time.perf_counter() - t0, tokens


def start_server(config: EngineConfig, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream.cli", "serve", "--port", str(port), "--model", config.model,
           "--device", config.device, "--max-batch-size", str(config.max_batch_size),
           "--max-num-batched-tokens", str(config.max_num_batched_tokens), "--log-level", "warning"]
    return subprocess.Popen(cmd, stderr=subprocess.DEVNULL)


async def wait_ready(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        for _ in range(1200):
            if proc.poll() is not None:
                raise SystemExit("slipstream serve exited")
            try:
                if (await http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("slipstream serve did not start")


async def bench(args) -> list:
    config = EngineConfig(model=args.model, device="cpu", max_batch_size=32, max_num_batched_tokens=512)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(config, port)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url, proc)
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with Engine(config) as engine, httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            await run_engine(engine, Scenario("warmup", 4, 4, 8))
            await run_http(http, Scenario("warmup", 4, 4, 8))
            rows = []
            for sc in SCENARIOS:
                pairs = []
                for _ in range(args.repeats):
                    te, tokens = await run_engine(engine, sc)
                    th, tokens_h = await run_http(http, sc)
                    assert tokens == tokens_h, (tokens, tokens_h)
                    pairs.append((te, th))
                rows.append((sc, tokens, pairs))
                print(f"  {sc.name}: done", file=sys.stderr)
            return rows
    finally:
        stop(proc)


def table(rows) -> str:
    lines = ["| scenario | tokens | in-process median | HTTP median | overhead µs/token median | mean | p90 |"
             " HTTP tokens/s (median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for sc, tokens, pairs in rows:
        over = [(th - te) / tokens * 1e6 for te, th in pairs]
        p90 = statistics.quantiles(over, n=10)[-1] if len(over) > 1 else over[0]
        te = statistics.median(p[0] for p in pairs)
        th = statistics.median(p[1] for p in pairs)
        lines.append(f"| {sc.name} | {tokens} | {te * 1e3:.0f} ms | {th * 1e3:.0f} ms | {statistics.median(over):+.0f} "
                     f"| {statistics.fmean(over):+.0f} | {p90:+.0f} | {tokens / th:.0f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the header and table to this file")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    head = header()
    rows = uvloop.run(bench(args))  # the loop `slipstream serve` runs the engine on
    text = (f"{head}\nmodel {args.model}, cpu, greedy, ignore_eos, max_batch_size 32; {args.repeats} ABAB pairs "
            f"per scenario; both sides on uvloop\n\n{table(rows)}\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
