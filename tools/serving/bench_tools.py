"""Tool calls' cost to throughput: 32 concurrent chat requests, half with tool_choice "required",
against the same load without a grammar, in one run (`slipstream serve`, CPU).

    python tools/serving/bench_tools.py [--model smollm2-135m] [--pairs 3] [--rounds 4] [--out FILE]
    python tools/serving/bench_tools.py --engine --device cuda --model random-smollm2-135m   # no HTTP (a GPU machine)

Both loads send the same request bodies (the same tools, so the same prompt) and generate the same
number of tokens: the plain request has tool_choice "none" (the tools are in its prompt, nothing
constrains it) and ignore_eos; the tool request has tool_choice "required" and a function whose one
argument is a string of at least 400 characters, so every one of its tokens is constrained and it
reaches max_tokens inside the call. The only difference is the grammar on half of the rows.
Load A: 32 clients send plain requests; load B: 16 send plain, 16 tool requests. Each client sends
`rounds` requests back to back. A and B alternate (A B A B ...) after a warm-up of each, so drift on a
shared machine hits both; the table gives tokens/s (wall) and the server's CPU seconds per 1,000
tokens (/proc/PID/stat), median, mean and p90 over the pairs, and B/A per pair. `--engine` sends the
same requests to an in-process Engine (Engine.chat with tools; CPU seconds are this process's),
for machines without the `serve` extra.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(_HERE, "..", "common")]  # bench_http beside it, the shared helpers
from bench_lines import emit, pct, report, stop  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "write_note", "description": "Save a note for the user",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}},
                   "required": ["text"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Write a long note about the history of Paris and save it."}]
CLIENTS = 32


def body(tools: bool, max_tokens: int) -> dict:
    b = {"model": "m", "messages": MESSAGES, "tools": [TOOL], "max_tokens": max_tokens, "temperature": 0.7}
    if tools:
        return {**b, "tool_choice": "required", "parallel_tool_calls": False}
    return {**b, "tool_choice": "none", "ignore_eos": True}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def load(http, pid: int, tool_clients: int, rounds: int, max_tokens: int, seed: int):
    """(tokens, wall seconds, server CPU seconds, finish reasons of the tool requests)."""
    finishes: list[str] = []

    async def client(i: int) -> int:
        tokens = 0
        for r in range(rounds):
            tools = i < tool_clients
            request = {**body(tools, max_tokens), "seed": seed + 1000 * i + r}
            resp = await http.post("/v1/chat/completions", json=request)
            resp.raise_for_status()
            out = resp.json()
            tokens += out["usage"]["completion_tokens"]
            if tools:
                finishes.append(out["choices"][0]["finish_reason"])
        return tokens

    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(i) for i in range(CLIENTS))))
    return tokens, time.perf_counter() - t0, cpu_seconds(pid) - cpu0, finishes


async def engine_load(engine, tool_clients: int, rounds: int, max_tokens: int, seed: int):
    """`load` on an in-process Engine: the same requests through Engine.chat."""
    from slipstream import SamplingParams

    finishes: list[str] = []

    async def client(i: int) -> int:
        tokens = 0
        for r in range(rounds):
            b = body(i < tool_clients, max_tokens)
            params = SamplingParams(max_tokens=max_tokens, temperature=b["temperature"], seed=seed + 1000 * i + r,
                                    ignore_eos=b.get("ignore_eos", False))
            out = await engine.chat(b["messages"], params, tools=b["tools"], tool_choice=b["tool_choice"],
                                    parallel_tool_calls=b.get("parallel_tool_calls", True))
            tokens += len(out.token_ids)
            if i < tool_clients:
                finishes.append(out.finish_reason)
        return tokens

    cpu0, t0 = time.process_time(), time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(i) for i in range(CLIENTS))))
    return tokens, time.perf_counter() - t0, time.process_time() - cpu0, finishes


async def bench(args, lines: list[str]) -> None:
    if args.engine:
        from slipstream import Engine, EngineConfig

        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_batch_size=CLIENTS)
        async with Engine(config) as engine:
            await run_pairs(args, lines, lambda *a: engine_load(engine, *a), "in-process Engine")
        return
    import httpx  # (not on a GPU machine's image: --engine needs none of the serve extra)
    from bench_http import start_server, wait_ready

    from slipstream import EngineConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = start_server(EngineConfig(model=args.model, device=args.device, max_batch_size=CLIENTS), port)
    try:
        await wait_ready(url, proc)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            await run_pairs(args, lines, lambda *a: load(http, proc.pid, *a), "slipstream serve")
    finally:
        stop(proc)


async def run_pairs(args, lines: list[str], run, where: str) -> None:
    emit(lines, f"model {args.model} ({args.dtype}), {args.device}, {where}, {CLIENTS} clients x {args.rounds} "
                f"requests of max_tokens {args.max_tokens}; A: all plain, B: {CLIENTS // 2} plain + "
                f"{CLIENTS // 2} tool_choice required; {args.pairs} A/B pairs after a warm-up of each")
    for tool_clients in (0, CLIENTS // 2):  # warm-up: compiles the grammar, caches the prompt's pages
        await run(tool_clients, 1, args.max_tokens, 0)
    runs: dict[str, list[tuple[int, float, float]]] = {"A": [], "B": []}
    finishes: list[str] = []
    for pair in range(args.pairs):
        for side, tool_clients in (("A", 0), ("B", CLIENTS // 2)):
            tokens, wall, cpu, fin = await run(tool_clients, args.rounds, args.max_tokens, 100_000 * (pair + 1))
            runs[side].append((tokens, wall, cpu))
            finishes += fin
            emit(lines, f"pair {pair} {side}: {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tokens/s; "
                        f"CPU {cpu:.2f} s = {cpu / tokens * 1000:.2f} s per 1k tokens")
    emit(lines, f"tool requests' finish reasons: {dict((f, finishes.count(f)) for f in sorted(set(finishes)))}")
    emit(lines)
    table(lines, runs)


def table(lines: list[str], runs: dict) -> None:
    emit(lines, "| load | tokens/s median | mean | p90 | CPU s / 1k tokens median | mean | p90 |")
    emit(lines, "|---|---:|---:|---:|---:|---:|---:|")
    for side, name in (("A", "32 plain"), ("B", "16 plain + 16 tool_choice required")):
        tps = [t / w for t, w, _ in runs[side]]
        cpk = [c / t * 1000 for t, _, c in runs[side]]
        emit(lines, f"| {name} | {statistics.median(tps):.1f} | {statistics.fmean(tps):.1f} | {pct(tps, 0.9):.1f} "
                    f"| {statistics.median(cpk):.2f} | {statistics.fmean(cpk):.2f} | {pct(cpk, 0.9):.2f} |")
    ratios = [(tb / wb) / (ta / wa) for (ta, wa, _), (tb, wb, _) in zip(runs["A"], runs["B"])]
    emit(lines)
    emit(lines, f"B/A tokens/s per pair: {', '.join(f'{r:.3f}' for r in ratios)}; "
                f"median {statistics.median(ratios):.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engine", action="store_true", help="an in-process Engine instead of `slipstream serve`")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="with --engine")
    p.add_argument("--out", default=None, help="also write the provenance header and the lines to this file")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def body_lines() -> list[str]:
        lines: list[str] = []
        asyncio.run(bench(args, lines))
        return lines

    report(body_lines, None if args.out is None else Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
