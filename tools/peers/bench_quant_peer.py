"""Decode speed on the CPU: slipstream's default (quantized GGUF, compiled kernels) against llama.cpp on the
same GGUF file, interleaved in one run, N sequences at once (N = 1 is a single `generate`).

    python tools/peers/bench_quant_peer.py --llamacpp build/llamacpp-cpu --rounds 3 --batches 1 8 32 \
        [--llamacpp-threads 1 2] [--out docs/results/quant-2026-11-27/peer.md]

Every round runs, for each N, each configuration once, as its own process, in an order that alternates
between rounds (A B C, then C B A, ...), so a change of the machine's load hits both sides alike; the
load average is recorded before every run. The workload for both: N sequences of --prompt-len token
ids prefilled together, then --gen tokens each, greedy; the decode rate is N x (gen - 1) tokens over
the time from the last sequence's first token to the end, the same quantity as llama-batched-bench's
S_TG (N x ntg / t_tg). CPU: the child process's user + system seconds per generated token (whole
process: load and prefill included, on both sides); with --marginal N each configuration also runs
with N more tokens per sequence, and the difference of the two runs' CPU seconds over the difference
of their tokens is the CPU cost of one more decoded token, free of start-up and prefill (CPU time
moves far less with the machine's load than wall time does; the start-up's own spread, ~0.3 s,
divided by N x sequences is its error).

  slipstream   an Engine (EngineConfig defaults: weights="quantized", the "cpu" kernel backend), the
               N requests submitted together as token ids, ignore_eos; `--slipstream-threads` sets
               torch's threads (the forward runs on one fewer, docs/models.md)
  llama.cpp    llama-batched-bench -npp P -ntg G-1 -npl N -t T -fa on|off, one process per run, its
               S_TG; `--llamacpp-threads` and `--llamacpp-fa` list the configurations tried (its best
               is the peer)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools" / "common"), str(ROOT)]

from bench_lines import emit, pct, report  # noqa: E402

DEFAULT_GGUF = "smollm2-135m"


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


async def _slipstream_child(args) -> dict:
    """In the child: one engine, a warm-up, then the measured batch."""
    import random

    from slipstream import Engine, SamplingParams
    from slipstream.params import EngineConfig

    cfg = EngineConfig(model=args.model, max_batch_size=max(32, args.batch), **json.loads(args.engine))
    rng = random.Random(0)
    async with Engine(cfg) as eng:
        vocab = eng.model_config.vocab_size
        prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        params = SamplingParams(max_tokens=args.gen, temperature=0, ignore_eos=True)

        async def one(p, stamps):
            async for _ in eng.stream(p, params):
                stamps.append(time.perf_counter())

        warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        await asyncio.gather(*(eng.complete(p, warm) for p in prompts[:2]))  # warm-up: short, so that the
        # process's CPU time (the --marginal difference) holds the measured tokens only
        cpu0, t0 = time.process_time(), time.perf_counter()
        stamps = [[] for _ in prompts]
        await asyncio.gather(*(one(p, s) for p, s in zip(prompts, stamps)))
        cpu, end = time.process_time() - cpu0, time.perf_counter()
    first = max(s[0] for s in stamps)
    tokens = sum(len(s) for s in stamps)
    decoded = sum(sum(1 for t in s if t > first) for s in stamps)
    return {"decode_tok_s": decoded / (end - first), "prefill_s": first - t0, "tokens": tokens,
            "cpu_ms_per_token": cpu / tokens * 1e3}


def run_slipstream(args, n: int, engine: dict, threads: int | None, gen: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--batch", str(n), "--prompt-len",
           str(args.prompt_len), "--gen", str(gen), "--engine", json.dumps(engine)]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"slipstream child failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res


def run_llamacpp(args, n: int, threads: int, fa: str, gguf: str, gen: int) -> dict:
    exe = Path(args.llamacpp) / "bin" / "llama-batched-bench"
    ctx = n * (args.prompt_len + gen + 16)
    cmd = [str(exe), "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(args.prompt_len),
           "-ntg", str(gen - 1), "-npl", str(n), "-t", str(threads), "-fa", fa, "--output-format", "jsonl"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    row = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")][-1]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tokens = n * gen
    return {"decode_tok_s": row["speed_tg"], "prefill_s": row["t_pp"], "tokens": tokens,
            "cpu_ms_per_token": cpu / tokens * 1e3, "process_cpu_s": cpu, "command": " ".join(cmd)}


def configurations(args) -> list[tuple[str, dict]]:
    confs = [(f"slipstream (threads {t or 'default'})", {"side": "slipstream", "threads": t, "engine": {}})
             for t in args.slipstream_threads]
    confs += [(f"llama.cpp -t {t} -fa {fa}", {"side": "llama.cpp", "threads": t, "fa": fa})
              for t in args.llamacpp_threads for fa in args.llamacpp_fa]
    return confs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp", help="llama.cpp build directory (tools/peers/llamacpp_peer.sh build)")
    ap.add_argument("--model", default=DEFAULT_GGUF, help="slipstream's spec of the GGUF (both sides load its file)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--slipstream-threads", type=int, nargs="+", default=[0],
                    help="torch threads (OMP_NUM_THREADS) of the slipstream process; 0: its default")
    ap.add_argument("--llamacpp-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--llamacpp-fa", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--marginal", type=int, default=0, metavar="EXTRA",
                    help="also run with EXTRA more tokens per sequence: CPU per extra token (0: off)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json-out", type=Path)
    # the child side of a slipstream run
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_slipstream_child(args))))
        return 0
    from slipstream.models.loading.loader import resolve_model_path

    gguf = str(resolve_model_path(args.model))
    confs = configurations(args) if args.llamacpp else [c for c in configurations(args) if c[1]["side"] == "slipstream"]
    results: dict[tuple[int, str], list[dict]] = {}

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"GGUF: {gguf}; prompt {args.prompt_len} token ids, {args.gen} generated per sequence, greedy; "
                    f"{args.rounds} rounds, configurations alternating in order\n")
        emit(lines, "| round | N | system | load before | decode tok/s | prefill s | CPU ms / token | "
                    "marginal CPU ms / token |")
        emit(lines, "|---:|---:|---|---|---:|---:|---:|---:|")

        def one(c: dict, n: int, gen: int) -> dict:
            if c["side"] == "slipstream":
                return run_slipstream(args, n, c["engine"], c["threads"], gen)
            return run_llamacpp(args, n, c["threads"], c["fa"], gguf, gen)

        for r in range(args.rounds):
            order = confs if r % 2 == 0 else confs[::-1]
            for n in args.batches:
                for name, c in order:
                    before = load()
                    res = one(c, n, args.gen)
                    res["load_before"] = before
                    if args.marginal:
                        long = one(c, n, args.gen + args.marginal)
                        res["marginal_cpu_ms_per_token"] = ((long["process_cpu_s"] - res["process_cpu_s"])
                                                            / (long["tokens"] - res["tokens"]) * 1e3)
                        res["long_decode_tok_s"] = long["decode_tok_s"]
                    results.setdefault((n, name), []).append(res)
                    marginal = f"{res['marginal_cpu_ms_per_token']:.2f}" if args.marginal else "-"
                    emit(lines, f"| {r + 1} | {n} | {name} | {before} | {res['decode_tok_s']:.1f} | "
                                f"{res['prefill_s']:.3f} | {res['cpu_ms_per_token']:.2f} | {marginal} |")
        emit(lines, "\nSummary (decode tok/s over rounds: median, mean, p90 / min-max; CPU ms per token median)\n")
        emit(lines, "| N | system | median | mean | p90 | min - max | CPU ms / token | marginal CPU ms / token |")
        emit(lines, "|---:|---|---:|---:|---:|---|---:|---:|")
        for (n, name), rs in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            xs = [x["decode_tok_s"] for x in rs]
            marginal = (f"{statistics.median(x['marginal_cpu_ms_per_token'] for x in rs):.2f}" if args.marginal
                        else "-")
            emit(lines, f"| {n} | {name} | {statistics.median(xs):.1f} | {statistics.fmean(xs):.1f} | "
                        f"{pct(xs, 0.9):.1f} | {min(xs):.1f} - {max(xs):.1f} | "
                        f"{statistics.median(x['cpu_ms_per_token'] for x in rs):.2f} | {marginal} |")
        emit(lines, f"\nload average at the end: {load()}")
        return lines

    report(body, args.out)
    if args.json_out:
        args.json_out.write_text(json.dumps({f"{n}|{name}": rs for (n, name), rs in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
