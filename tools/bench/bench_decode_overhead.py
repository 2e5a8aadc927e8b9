"""Where a batch-1 `generate` token goes beyond the forward: checkouts side by side, interleaved.

    python tools/bench/bench_decode_overhead.py --checkouts /work/main . --rounds 3 --tokens 128 \
        [--out docs/results/quant-2026-11-27/decode_overhead.md]

Each run is a child process with PYTHONPATH at one checkout: an Engine with trace=True (the tracer
exists on every checkout compared) generates --tokens greedy tokens for the README's chat prompt, one
stream, after a warm-up request. Reported per run, medians over its steady decode steps (slipstream/
trace.py): the step period (forward start to next forward start), the forward's span on the compute
stream, period − forward (the time per token beyond the forward), the compute stream's idle time,
the host's own time; the stream's tokens/s; and the process's CPU time per token, split by thread
(the forward's stream thread, the loop thread, the copy stream, the rest). Checkouts alternate in
order each round, and the load average is recorded before each run: wall times on a shared machine
move with its load, the CPU times much less.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if "--child" not in sys.argv:  # a child imports the slipstream of its checkout (PYTHONPATH), not this one's
    sys.path[:0] = [str(ROOT / "tools" / "common"), str(ROOT)]

PROMPT = "Write a short poem about the sea."


def _thread_cpu() -> dict[str, float]:
    import threading

    names = {str(t.native_id): t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(tid, "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def _child(tokens: int) -> dict:
    from slipstream import Engine, SamplingParams
    from slipstream.params import EngineConfig

    import slipstream

    assert Path(slipstream.__file__).resolve().is_relative_to(Path.cwd().resolve()), slipstream.__file__
    async with Engine(EngineConfig(trace=True)) as engine:
        prompt = await engine.chat_prompt([{"role": "user", "content": PROMPT}])
        async for _ in engine.stream(prompt, SamplingParams(max_tokens=8, temperature=0)):
            pass
        engine.tracer.clear()
        stamps: list[float] = []
        cpu0, threads0 = time.process_time(), _thread_cpu()
        async for delta in engine.stream(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)):
            stamps.extend([time.perf_counter()] * len(delta.token_ids))
        cpu, threads1 = time.process_time() - cpu0, _thread_cpu()
        steps = [s for s in engine.tracer.steps if s.contiguous and s.num_tokens == 1]
    n = len(stamps)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    per_thread = {k: (threads1.get(k, 0.0) - threads0.get(k, 0.0)) / n * 1e3 for k in threads1}
    return {"steps": len(steps), "period_ms": med([s.period for s in steps]),
            "forward_ms": med([s.forward for s in steps]),
            "beyond_forward_ms": med([s.period - s.forward for s in steps]),
            "idle_ms": med([s.idle for s in steps]), "host_active_ms": med([s.host_active for s in steps]),
            "tok_s": (n - 1) / (stamps[-1] - stamps[0]), "cpu_ms_per_token": cpu / n * 1e3,
            "thread_cpu_ms_per_token": {k: round(v, 3) for k, v in per_thread.items() if v > 0.005}}


def run(checkout: Path, tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(tokens)], capture_output=True,
                         text=True, env=env, cwd=checkout, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{checkout}: child failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkouts", type=Path, nargs="+", default=[ROOT])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(asyncio.run(_child(args.tokens))))
        return 0
    from bench_lines import emit, pct, report

    checkouts = [c.resolve() for c in args.checkouts]
    def commit(c: Path) -> str:
        return subprocess.run(["git", "-C", str(c), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()

    labels = {c: f"{c} ({commit(c)})" for c in checkouts}
    results: dict[Path, list[dict]] = {c: [] for c in checkouts}

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"one stream, {args.tokens} greedy tokens of {PROMPT!r} (chat template), EngineConfig defaults + "
                    f"trace=True; {args.rounds} rounds, checkouts alternating\n")
        emit(lines, "| round | checkout | load before | period ms | forward ms | beyond forward ms | idle ms | "
                    "tok/s | CPU ms / token | by thread (ms / token) |")
        emit(lines, "|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
        for r in range(args.rounds):
            for c in (checkouts if r % 2 == 0 else checkouts[::-1]):
                load = "/".join(f"{x:.2f}" for x in os.getloadavg())
                res = run(c, args.tokens)
                res["load_before"] = load
                results[c].append(res)
                threads = ", ".join(f"{k} {v:.2f}" for k, v in sorted(res["thread_cpu_ms_per_token"].items(),
                                                                        key=lambda kv: -kv[1]))
                emit(lines, f"| {r + 1} | {labels[c]} | {load} | {res['period_ms']:.2f} | {res['forward_ms']:.2f} | "
                            f"{res['beyond_forward_ms']:.2f} | {res['idle_ms']:.2f} | {res['tok_s']:.1f} | "
                            f"{res['cpu_ms_per_token']:.2f} | {threads} |")
        emit(lines, "\nSummary over rounds (median, mean, p90)\n")
        emit(lines, "| checkout | period ms | forward ms | beyond forward ms | tok/s | CPU ms / token |")
        emit(lines, "|---|---|---|---|---|---|")
        for c, rs in results.items():
            cols = []
            for key in ("period_ms", "forward_ms", "beyond_forward_ms", "tok_s", "cpu_ms_per_token"):
                xs = [x[key] for x in rs]
                cols.append(f"{statistics.median(xs):.2f} / {statistics.fmean(xs):.2f} / {pct(xs, 0.9):.2f}")
            emit(lines, f"| {labels[c]} | " + " | ".join(cols) + " |")
        emit(lines, f"\nload average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
        return lines

    report(body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
