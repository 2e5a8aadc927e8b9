"""llama.cpp served: `llama-server` with N parallel slots and continuous batching, driven like peer_bench.

    python tools/peers/llamacpp_server_bench.py --build BUILD --dtype f16 --concurrency 1 8 32 128

Unlike llama-batched-bench (tools/peers/llamacpp_bench.py), the server samples (greedy: top_k 1), streams
each token to its client and schedules requests itself — the same work slipstream's engine does.
Per N: one fresh server process with N slots (`-np N`) and the KV budget of peer_bench per slot,
one warm-up round, then --repeats rounds of N requests submitted at once, each a prompt of
--prompt-len token ids and exactly --output-len tokens (`ignore_eos`), streamed (SSE). TTFT = first
streamed token − submission, ITL = (last − first) / (L − 1) per request (medians over requests);
tokens/s = N·L / wall. Memory: llama.cpp's buffers from its log and, on a GPU, the process peak.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(os.path.dirname(_TOOLS))]  # this room, this checkout's slipstream

from llamacpp_bench import BUFFER_RE, GpuPeak, llamacpp_commit  # noqa: E402

from slipstream.provenance import header, provenance  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_ids(n: int, length: int, vocab: int = 49152) -> list[list[int]]:
    return [[3 + (97 * i + 31 * j) % (vocab - 3) for j in range(length)] for i in range(n)]


def one_request(port: int, prompt: list[int], length: int, t0: float, out: dict) -> None:
    body = json.dumps({"prompt": prompt, "n_predict": length, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                       "stream": True, "cache_prompt": False, "return_tokens": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    times, tokens = [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        chunk = json.loads(line[6:])
        n = len(chunk.get("tokens") or [])
        if n:
            times.extend([time.perf_counter()] * n)
            tokens += n
        if chunk.get("stop"):
            break
    conn.close()
    out.update(tokens=tokens, ttft=times[0] - t0 if times else None,
               itl=(times[-1] - times[0]) / (length - 1) if len(times) > 1 else None)


def one_round(port: int, batch: list[list[int]], length: int) -> dict:
    outs = [dict() for _ in batch]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=one_request, args=(port, p, length, t0, o)) for p, o in zip(batch, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(o.get("tokens") != length for o in outs):
        raise RuntimeError(f"llama-server returned {[o.get('tokens') for o in outs]} tokens, not {length} each")
    return {"tok_s": len(batch) * length / wall, "wall_s": wall,
            "ttft_ms": statistics.median(o["ttft"] for o in outs) * 1e3,
            "itl_ms": statistics.median(o["itl"] for o in outs) * 1e3}


def greedy(port: int, prompt: list[int], length: int) -> list[int]:
    body = json.dumps({"prompt": prompt, "n_predict": length, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                       "cache_prompt": False, "return_tokens": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out["tokens"]


def slipstream_greedy(spec: str, prompts: list[list[int]], length: int) -> list[list[int]]:
    """The same prompts through slipstream (float32, CPU): the reference the GGUF must reproduce."""
    import asyncio

    from slipstream import Engine, EngineConfig, SamplingParams
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")  # engine info lines to stderr, never into the raw table on stdout

    async def go():
        cfg = EngineConfig(model=spec, device="cpu", dtype="float32", seed=0, max_batch_size=len(prompts),
                           kv_cache_tokens=4 * len(prompts) * (len(prompts[0]) + length))
        async with Engine(cfg) as e:
            params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
            return [o.token_ids for o in await asyncio.gather(*(e.complete(p, params) for p in prompts))]

    return asyncio.run(go())


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_n(args, model: str, n: int, reference: list[list[int]] | None = None) -> dict:
    port = free_port()
    ctx = 2 * n * (args.prompt_len + args.output_len + 16)
    cmd = [os.path.join(args.build, "bin", "llama-server"), "-m", model, "-c", str(ctx), "-np", str(n),
           "-b", str(args.batch_tokens), "-ub", str(args.ubatch), "-ngl", "999", "-fa", args.flash_attn,
           "--host", "127.0.0.1", "--port", str(port), "-lv", "4"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak = GpuPeak(proc.pid)
        try:
            deadline = time.time() + args.timeout
            while True:  # /health answers 200 once the model is loaded
                try:
                    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        break
                except OSError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"llama-server did not come up:\n{log.read()[-3000:]}")
                time.sleep(0.2)
            batch = prompt_ids(n, args.prompt_len)
            agreement = None
            if reference is not None:  # greedy tokens equal to slipstream's before the first difference
                agreement = [agree(greedy(port, p, len(ref)), ref)
                             for p, ref in zip(prompt_ids(len(reference), args.prompt_len), reference)]
            one_round(port, batch, args.output_len)  # warm-up
            reps = [one_round(port, batch, args.output_len) for _ in range(args.repeats)]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            gpu_peak = peak.stop()
        log.seek(0)
        text = log.read()
    out = {k: statistics.median(r[k] for r in reps) for k in ("tok_s", "ttft_ms", "itl_ms")}
    xs = sorted(r["tok_s"] for r in reps)
    out["tok_s_mean"] = statistics.fmean(xs)
    out["tok_s_p90"] = statistics.quantiles(xs, n=10, method="inclusive")[8] if len(xs) > 1 else xs[0]
    buffers: dict[str, float] = {}
    for dev, kind, mib in BUFFER_RE.findall(text):
        buffers[f"{kind} ({dev})"] = buffers.get(f"{kind} ({dev})", 0.0) + float(mib)
    out.update(buffers_mib=buffers, buffers_total_mib=sum(buffers.values()), gpu_process_peak_mib=gpu_peak,
               repeats=reps, command=" ".join(cmd), agreement=agreement)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--model", help="a GGUF; default: the one tools/peers/llamacpp_bench.py writes next to the build")
    ap.add_argument("--spec", default="random-smollm2-135m")
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120, help="seconds for a server to come up")
    ap.add_argument("--agreement", action=argparse.BooleanOptionalAction, default=True,
                    help="compare 4 greedy continuations (16 tokens) with slipstream's float32 ones")
    ap.add_argument("--json-out", metavar="PATH")
    args = ap.parse_args(argv)
    commit = llamacpp_commit(args.build)
    prov = provenance([os.path.basename(sys.executable), "tools/peers/llamacpp_server_bench.py", *argv],
                      extra={"llama.cpp": commit})
    model = args.model or os.path.join(args.build, f"{args.spec}-{args.dtype}.gguf")
    if not os.path.exists(model):
        from random_gguf import write

        write(args.spec, args.dtype, model)
    reference = slipstream_greedy(args.spec, prompt_ids(4, args.prompt_len), 16) if args.agreement else None
    res = {}
    for i, n in enumerate(args.concurrency):
        res[n] = run_n(args, model, n, reference if i == 0 else None)
        print(f"  llama-server N={n}: {res[n]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    print(header(prov))
    print(f"llama-server ({commit}), {args.spec} ({args.dtype}, random weights), prompt {args.prompt_len}, output "
          f"{args.output_len} tokens, greedy, streamed; {args.repeats} rounds after one warm-up, a fresh server per N\n")
    print("| N | system | tokens/s (median / mean / p90) | ITL ms | TTFT ms | buffers MiB | process peak GPU MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n, r in res.items():
        gpu = "n/a" if r["gpu_process_peak_mib"] is None else str(r["gpu_process_peak_mib"])
        print(f"| {n} | llama-server | {r['tok_s']:.1f} / {r['tok_s_mean']:.1f} / {r['tok_s_p90']:.1f} | "
              f"{r['itl_ms']:.2f} | {r['ttft_ms']:.1f} | {r['buffers_total_mib']:.0f} | {gpu} |")
    first = res[args.concurrency[0]]["agreement"]
    if first is not None:
        print(f"\ngreedy agreement with slipstream (float32, CPU), tokens equal before the first difference, of 16: "
              f"{first} (llama.cpp in {args.dtype}, KV cache f16: a near-tie may flip)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"provenance": prov, "args": vars(args), "model": model,
                       "results": {str(n): r for n, r in res.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
