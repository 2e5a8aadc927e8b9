"""A huge prompt over HTTP while another stream runs: how long does the stream stall?

    python tools/serving/bench_http_bigprompt.py [--model tiny-random] [--sizes 10000000,5000000,900000] [--repeats 3]
    python tools/serving/bench_http_bigprompt.py --detokenize --sizes 4100000,4096,2048   # issue 37, item 8

Starts `slipstream serve` (127.0.0.1, a free port) and, per repeat and prompt size, runs one
streamed completion (ignore_eos, --tokens tokens) and measures the gaps between its SSE chunks:
once alone (baseline) and once with a big /v1/completions body sent mid-stream from a thread on a
raw socket (the body is built before the stream starts, so the client's own encoding is not
measured). /health is polled every 10 ms meanwhile. With the defaults a 10 MB body is over
--max-body-bytes (413), 5 MB is under it but over max_prompt_chars (400 before tokenizing) and
900 KB is tokenized (off the loop) and then refused as longer than the model context.
Prints a markdown table with a provenance header; the goal (issue 27) is a stall under 50 ms in the
column "max gap while it was outstanding" (from sending it until 50 ms after its answer; 0.0: no
chunk arrived in that window, which is shorter than one decode step), and in /health's. The whole
stream's max gap is given too: on tiny-random/CPU every stream has one ~0.3-0.8 s gap near its 46th
token, with or without a big request (seen in-process too; not this tool's doing).

--detokenize sends a /detokenize body of `size` token ids instead (id 7, two bytes each with its comma:
4.1 M ids fit the default 8 MiB body limit).
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
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))  # the shared helpers
from provenance import header  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def big_request(port: int, size: int, detokenize: bool = False) -> bytes:
    if detokenize:
        path, body = "/detokenize", b'{"tokens": [' + b",".join([b"7"] * size) + b"]}"
    else:
        path, body = "/v1/completions", json.dumps({"prompt": "lorem ipsum " * (size // 12), "max_tokens": 4}).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def send_raw(port: int, data: bytes, result: dict) -> None:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        try:
            s.sendall(data)
        except OSError:  # the server answered 413 and closed before reading all of it
            pass
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except OSError:  # reset after the answer (the rest of the body was never read)
            pass
    result["status"] = int(reply.split(b" ", 2)[1]) if reply else 0
    result["seconds"] = time.perf_counter() - t0


async def stream_gaps(http: httpx.AsyncClient, tokens: int, big: bytes | None, port: int) -> dict:
    """Inter-chunk gaps of one stream; with `big`, sent once 20 chunks have arrived."""
    gaps, last, sent, result, health, thread = [], None, None, {}, [], None
    stop_health = asyncio.Event()

    async def poll_health():
        while not stop_health.is_set():
            t = time.perf_counter()
            await http.get("/health")
            health.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)

    poller = asyncio.create_task(poll_health())
    body = {"prompt": "hello there", "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0, "stream": True}
    window = []  # gaps while the big request was outstanding
    async with http.stream("POST", "/v1/completions", json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
                if thread is not None and (thread.is_alive() or now - sent < 0.05 + result.get("seconds", 0)):
                    window.append(now - last)
            last, n = now, n + 1
            if big is not None and n == 20:
                thread = threading.Thread(target=send_raw, args=(port, big, result))
                sent = time.perf_counter()
                thread.start()
    if thread is not None:
        thread.join()
    stop_health.set()
    await poller
    return {"max_gap": max(gaps), "median_gap": statistics.median(gaps), "window_max": max(window or [0.0]),
            "status": result.get("status"), "big_s": result.get("seconds"), "health_max": max(health)}


async def bench(args) -> list[tuple]:
    port = free_port()
    cmd = [sys.executable, "-m", "slipstream.cli", "serve", "--port", str(port), "--model", args.model,
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    rows = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise SystemExit("slipstream serve exited")
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("slipstream serve did not start")
                await asyncio.sleep(0.2)
            await stream_gaps(http, 20, None, port)  # warm-up
            for size in args.sizes:
                big = big_request(port, size, args.detokenize)
                for _ in range(args.repeats):
                    alone = await stream_gaps(http, args.tokens, None, port)
                    loaded = await stream_gaps(http, args.tokens, big, port)
                    rows.append((size, alone, loaded))
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def table(rows, detokenize: bool = False) -> str:
    out = [f"| {'token ids' if detokenize else 'prompt bytes'} | answer | answer ms | stream max gap alone, ms (median) | stream max gap beside it, ms "
           "| max gap while it was outstanding, ms | /health max ms beside it |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for size, alone, loaded in rows:
        out.append(f"| {size:,} | {loaded['status']} | {loaded['big_s'] * 1e3:.1f} | {alone['max_gap'] * 1e3:.1f} "
                   f"({alone['median_gap'] * 1e3:.1f}) | {loaded['max_gap'] * 1e3:.1f} | "
                   f"{loaded['window_max'] * 1e3:.1f} | {loaded['health_max'] * 1e3:.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--sizes", default="10000000,5000000,900000", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--detokenize", action="store_true", help="sizes are /detokenize token ids, not prompt bytes")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = asyncio.run(bench(args))
    print(header("python tools/serving/bench_http_bigprompt.py " + " ".join(sys.argv[1:])))
    print(table(rows, args.detokenize))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
