"""Where the CPU time of one steady decode step goes: every thread, split by what ran on it.

The workload is tools/bench_host.py's (the real engine driven by its null model, CPU device, depth 2,
N greedy streams of L tokens), and so is the choice of steady steps (full-batch decode steps with
full-batch decode neighbours). Over those intervals the process's CPU time is split, per step:

  loop thread   by asyncio task, each task's CPU measured around every resumption (a task factory
                wraps each coroutine): the engine loop's task (its tick, split into plan / launch /
                commit / finalize from the step's own timings, and the rest of the task: the commit's
                await, the yield between ticks), the output stage's task, the stream consumers'
                tasks (the engine's RequestStream and the tool's loop over it), other tasks; what
                is left of the thread's CPU ran outside any task (the event loop itself: polling,
                callbacks, cross-thread wake-ups)
  stream threads  by the label of each launched work item (forward, sample, d2h, ...), its CPU
                measured around the item; what is left of the thread's CPU is the stream's own
                plumbing (waiting for work, event operations, waking the loop)

All figures are thread CPU time (CLOCK_THREAD_CPUTIME_ID), so other processes on a shared machine
do not inflate them; the measuring itself adds two clock reads per task resumption and per work
item. The seams are the ones bench_host.py names, plus `engine._parts.device` (its compute, copy and
upload streams: `launch(fn, label)`), and asyncio's task factory.

    python tools/step_profile.py                    # N = 1, L = 2000, 3 repeats
    python tools/step_profile.py --streams 256 --len 200
    python tools/step_profile.py --py-spy 500       # also: where in the code, by function

With --py-spy RATE the tool runs itself under py-spy (sampling every thread RATE times a second,
the venv's py-spy or one on PATH) and adds, per thread, the functions under slipstream/ with their
share of the thread's samples taken while the engine ran (inclusive: the function and what it
called; self: its own code, torch and C calls it made not below another slipstream function),
converted into µs per step with the thread's CPU per step from the table. Sampling is
statistical and costs the process time of its own; the table above it is the precise part.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the slipstream of this checkout, not an installed one
sys.path.insert(0, str(ROOT / "tools"))


class Accounts:
    """CPU seconds by (thread, what), written by the thread that spent them (dict updates are atomic)."""

    def __init__(self) -> None:
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)
        self.threads: dict[str, int] = {}  # thread name -> its CPU clock (any thread may read it)

    def add(self, thread: str, what: str, seconds: float) -> None:
        self.cpu[(thread, what)] += seconds

    def snapshot(self) -> dict[tuple[str, str], float]:
        snap = dict(self.cpu)
        for name, clock in self.threads.items():
            snap[(name, "total")] = time.clock_gettime(clock)
        return snap


def _own_clock() -> int:
    return time.pthread_getcpuclockid(threading.get_ident())


class _Timed:
    """Awaitable proxy of a coroutine that adds the CPU of each of its resumptions to an account."""

    def __init__(self, coro, accounts: Accounts, what: str):
        self.coro, self.accounts, self.what = coro, accounts, what

    def __await__(self):
        it = self.coro.__await__()
        clock, add, what = time.thread_time, self.accounts.add, self.what
        value, error = None, None
        while True:
            t0 = clock()
            try:
                out = it.throw(error) if error is not None else it.send(value)
            except StopIteration as stop:
                add("loop", what, clock() - t0)
                return stop.value
            except BaseException:
                add("loop", what, clock() - t0)
                raise
            add("loop", what, clock() - t0)
            try:
                value, error = (yield out), None
            except BaseException as e:  # noqa: BLE001 - thrown into the task: pass it on
                value, error = None, e


def _task_kind(coro) -> str:
    name = getattr(coro, "__qualname__", "") or type(coro).__name__
    if "run_stage" in name:
        return "output stage"
    if "_run_loop" in name or "EngineLoop.run" in name:
        return "engine loop task"
    if "consume" in name or "__anext__" in name:
        return "stream consumers"
    return "other tasks"


def install_task_factory(loop, accounts: Accounts) -> None:
    async def wrapped(coro, what):
        return await _Timed(coro, accounts, what)

    def factory(loop, coro, **kw):
        return asyncio.Task(wrapped(coro, _task_kind(coro)), loop=loop, **kw)

    loop.set_task_factory(factory)


def instrument_streams(device, accounts: Accounts) -> None:
    """Time every launched work item on the stream's thread, by label; record each thread's id."""
    for stream in dict.fromkeys((device.compute, device.copy, device.upload)):
        name = f"stream {stream.name}"
        inner = stream.launch

        def launch(fn, label: str = "", inner=inner, name=name):
            def timed() -> None:
                t0 = time.thread_time()
                try:
                    fn()
                finally:
                    accounts.add(name, label or "event ops", time.thread_time() - t0)

            return inner(timed, label)

        stream.launch = launch  # (instance attribute: this engine only)
        done = threading.Event()

        def register(name=name) -> None:
            accounts.threads[name] = _own_clock()
            done.set()

        inner(register)
        done.wait()


async def profile(n: int, length: int, repeats: int, depth: int) -> tuple[list[dict], int]:
    """Per steady interval: {(thread, what): CPU seconds}; and the number of steady steps."""
    from bench_host import PROMPT_LEN, StepRecord, null_model, run_once, steady  # noqa: F401

    from slipstream.api.engine import Engine
    from slipstream.params import EngineConfig

    accounts = Accounts()
    accounts.threads["loop"] = _own_clock()
    install_task_factory(asyncio.get_running_loop(), accounts)
    config = EngineConfig(model="tiny-random", device="cpu", pipeline_depth=depth, batch_invariant=False,
                          max_batch_size=n, max_num_batched_tokens=max(512, n * PROMPT_LEN),
                          kv_cache_tokens=2 * n * (PROMPT_LEN + length + 16))
    with null_model(max_rows=n + 1):
        engine = await Engine(config).start()
    instrument_streams(engine._parts.device, accounts)
    intervals: list[dict] = []
    snaps: dict[int, dict] = {}
    timings: dict[int, dict] = {}
    engine.loop.observers.append(lambda step: (snaps.__setitem__(step.step_id, accounts.snapshot()),
                                               timings.__setitem__(step.step_id, dict(step.timings))))
    try:
        await run_once(engine, n, min(length, 64))  # warm-up
        for _ in range(repeats):
            snaps.clear()
            timings.clear()
            records, _ = await run_once(engine, n, length)
            for rec, *_ in steady(records, n):
                a, b = snaps[rec.step_id - 1], snaps[rec.step_id]
                delta = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
                tm = timings[rec.step_id]
                for phase in ("plan", "launch", "commit", "finalize"):
                    delta[("tick", phase)] = tm.get(phase, 0.0)
                intervals.append(delta)
    finally:
        await engine.close()
    return intervals, len(intervals)


def report(intervals: list[dict], n: int, depth: int, length: int) -> str:
    keys = sorted({k for iv in intervals for k in iv})
    mean = {k: statistics.fmean(iv.get(k, 0.0) for iv in intervals) * 1e6 for k in keys}
    med = {k: statistics.median(iv.get(k, 0.0) for iv in intervals) * 1e6 for k in keys}
    threads = sorted({t for t, _ in keys if t != "tick"}, key=lambda t: (t != "loop", t))
    lines = [f"CPU µs per steady decode step, N={n}, depth {depth}, L={length}, null model, CPU device "
             f"({len(intervals)} steady steps; mean, and median where it differs)", "",
             "| thread | what | µs mean | µs median |", "|---|---|---:|---:|"]
    total = 0.0
    for t in threads:
        whole = mean.get((t, "total"), 0.0)
        total += whole
        parts = sorted((w for tt, w in keys if tt == t and w != "total"), key=lambda w: -mean[(t, w)])
        lines.append(f"| **{t}** | **total** | **{whole:.1f}** | {med.get((t, 'total'), 0.0):.1f} |")
        inside = 0.0
        for w in parts:
            inside += mean[(t, w)]
            lines.append(f"| {t} | {w} | {mean[(t, w)]:.1f} | {med[(t, w)]:.1f} |")
            if t == "loop" and w == "engine loop task":
                for phase in ("commit", "plan", "launch", "finalize"):
                    lines.append(f"| {t} | · tick {phase} (wall) | {mean[('tick', phase)]:.1f} | "
                                 f"{med[('tick', phase)]:.1f} |")
        label = "outside tasks (the event loop itself)" if t == "loop" else "outside work items (stream plumbing)"
        lines.append(f"| {t} | {label} | {whole - inside:.1f} | |")
    lines += ["", f"all threads: {total:.1f} µs per step",
              "", "tick phases are wall (perf_counter) inside the engine loop task's CPU; a task's CPU covers its "
                  "resumptions (the engine loop task: the tick plus its awaits' bookkeeping)"]
    return "\n".join(lines)


def fold_samples(raw: str, per_step: dict[str, float], top: int = 18) -> str:
    """py-spy's raw stacks -> per thread, the slipstream functions' shares in µs per step."""
    import re

    def frame(f: str) -> tuple[str, str]:
        m = re.match(r"(.*) \((.*?):\d+\)$", f)
        return (m.group(1), m.group(2)) if m else (f, "")

    pkg = str(ROOT / "slipstream") + "/"
    incl: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    own: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    total: dict[str, int] = defaultdict(int)
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [frame(f) for f in stack.split(";")]
        name = frames[0][0]
        thread = ("loop" if "MainThread" in name else "stream compute" if "slipstream-compute" in name
                  else "stream copy" if "slipstream-copy" in name else None)
        ours = [f"{file[len(pkg):]}:{fn}" for fn, file in frames[1:] if file.startswith(pkg)]
        if thread is None or thread == "loop" and "Runner.run" not in stack:
            continue  # (not the event loop's run: imports)
        total[thread] += int(n)
        for o in dict.fromkeys(ours):
            incl[thread][o] += int(n)
        if ours:
            own[thread][ours[-1]] += int(n)
    lines = ["", "by function (py-spy samples of the whole run, steady or not; µs per step = share of the thread's "
                 "samples × its CPU per step above)"]
    for thread in ("loop", "stream compute", "stream copy"):
        if not total[thread]:
            continue
        scale = per_step.get(thread, 0.0) / total[thread]
        lines += ["", f"{thread} ({total[thread]} samples)", "", "| function | µs inclusive | µs self |", "|---|---:|---:|"]
        for fn, c in sorted(incl[thread].items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| {fn} | {c * scale:.1f} | {own[thread].get(fn, 0) * scale:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--len", type=int, default=2000, dest="length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2, choices=[1, 2])
    ap.add_argument("--no-header", action="store_true")
    ap.add_argument("--py-spy", type=int, default=0, metavar="RATE", help="also sample with py-spy at RATE Hz")
    ap.add_argument("--emit-totals", metavar="PATH", help=argparse.SUPPRESS)  # (the run under py-spy)
    args = ap.parse_args(argv)
    if args.py_spy:
        return _under_py_spy(args, argv)
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    if not args.no_header:
        from provenance import header

        print(header(" ".join(["python", "tools/step_profile.py", *argv])), end="")
    import uvloop

    intervals, _ = uvloop.run(profile(args.streams, args.length, args.repeats, args.depth))
    if not intervals:
        raise SystemExit("no steady steps: raise --len")
    print(report(intervals, args.streams, args.depth, args.length))
    if args.emit_totals:
        totals = {t: statistics.fmean(iv.get((t, "total"), 0.0) for iv in intervals) * 1e6
                  for t in {t for iv in intervals for t, w in iv if w == "total"}}
        Path(args.emit_totals).write_text(__import__("json").dumps(totals))
    return 0


def _under_py_spy(args, argv: list[str]) -> int:
    import json
    import os
    import shutil
    import subprocess
    import tempfile

    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if spy is None:
        raise SystemExit("py-spy not found (pip install py-spy)")
    rest = [a for i, a in enumerate(argv) if a != "--py-spy" and (i == 0 or argv[i - 1] != "--py-spy")
            and not a.startswith("--py-spy=")]
    with tempfile.TemporaryDirectory() as tmp:
        raw, totals = os.path.join(tmp, "raw.txt"), os.path.join(tmp, "totals.json")
        subprocess.run([spy, "record", "-r", str(args.py_spy), "--threads", "-f", "raw", "-o", raw, "--",
                        sys.executable, __file__, *rest, "--emit-totals", totals], check=True,
                       stderr=subprocess.DEVNULL)
        print(fold_samples(Path(raw).read_text(), json.loads(Path(totals).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
