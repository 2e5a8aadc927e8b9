"""Throughput of slipstream on Ray Serve with 1 vs 2 (or more) engine replicas, in one run.

    python tools/serving/bench_replicas.py [--model smollm2-135m] [--replicas 1 2] [--requests 32]
        [--concurrency 16] [--max-tokens 64] [--repeats 3] [--num-cpus 2] [--out FILE]

One local Ray cluster (`--num-cpus`); for each replica count the Serve application is deployed
(each replica num_cpus=1, torch limited to one thread so replicas do not fight over cores), warmed
up, then `--requests` streamed greedy completions with distinct prompts (no shared prefix: this
measures spreading, not cache affinity) are sent `--concurrency` at a time over HTTP, `--repeats`
times; the replica counts alternate per repeat (ABAB) so drift on a shared machine hits both.
Output tokens/s and requests/s per round; the table gives median, mean and p90 per replica count.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the slipstream of this checkout, not an installed one
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))  # the shared helpers
from provenance import header  # noqa: E402

import httpx  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(http, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def _round(url: str, n: int, concurrency: int, max_tokens: int, tag: str) -> tuple[float, int, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def go(i):
            async with sem:
                return await _one(http, f"{i * 7919 + len(tag)} {tag}: write a short story about a lighthouse",
                                  max_tokens)
        t0 = time.perf_counter()
        toks = await asyncio.gather(*(go(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return sum(toks) / wall, sum(toks), n / wall


def _p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ["OMP_NUM_THREADS"] = "1"  # one core per replica (Ray sets it too for num_cpus=1 actors)
    import ray
    from ray import serve

    from slipstream.params import EngineConfig
    from slipstream.serve.ray_app import RayServeOptions, build_app

    head = header().rstrip("\n") + f"\nray: {importlib.metadata.version('ray')}"
    config = EngineConfig(model=args.model, max_batch_size=32, max_num_batched_tokens=256)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results: dict[int, list[tuple[float, int, float]]] = {n: [] for n in args.replicas}
    try:
        for rep in range(args.repeats):
            for n in args.replicas:
                serve.run(build_app(config, RayServeOptions(replicas=n, num_cpus=1)), name="bench", route_prefix="/")
                asyncio.run(_round(url, 2 * n, 2 * n, 8, "warmup"))
                results[n].append(asyncio.run(_round(url, args.requests, args.concurrency, args.max_tokens,
                                                     f"r{rep}")))
                print(f"repeat {rep} replicas {n}: {results[n][-1][0]:.1f} tok/s", file=sys.stderr, flush=True)
                serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()

    lines = [head, "", f"model {args.model}, {args.requests} streamed greedy requests x {args.max_tokens} tokens "
             f"(ignore_eos), {args.concurrency} at a time, distinct prompts; Ray cluster num_cpus={args.num_cpus}, "
             f"each replica num_cpus=1; {args.repeats} rounds per replica count, alternating", "",
             "| replicas | tokens/s median | mean | p90 | requests/s median | rounds (tok/s) |",
             "|---:|---:|---:|---:|---:|---|"]
    base = statistics.median(r[0] for r in results[args.replicas[0]])
    for n, rs in results.items():
        tps = [r[0] for r in rs]
        lines.append(f"| {n} | {statistics.median(tps):.1f} | {statistics.mean(tps):.1f} | {_p90(tps):.1f} | "
                     f"{statistics.median(r[2] for r in rs):.2f} | {', '.join(f'{x:.1f}' for x in tps)} |")
    for n, rs in list(results.items())[1:]:
        lines.append(f"\nspeed-up {n} vs {args.replicas[0]} replica(s) (medians): "
                     f"{statistics.median(r[0] for r in rs) / base:.2f}x")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
