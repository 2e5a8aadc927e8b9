"""Where the CPU time of one steady decode step goes: every thread, split by what ran on it.

The workload is tools/bench/bench_host.py's (the real engine driven by its null model, CPU device, depth 2,
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

    python tools/profile/step_profile.py            # N = 1, L = 2000, 3 repeats
    python tools/profile/step_profile.py --streams 256 --len 200
    python tools/profile/step_profile.py --functions        # also: where in the code, by function

With --functions the measured runs go under cProfile on the loop's thread and on the compute
stream's thread, with each thread's CPU clock as the timer, and the functions (Python and C: torch
ops, builtins) that took the most CPU are listed per thread in µs per step (self: their own time;
with callees: cumulative), with their calls per step. A deterministic profiler charges its own
cost to every call it sees (about a microsecond on this machine), so these figures exceed the
table's: they say where, the table says how much. (A sampling profiler is the other way; py-spy
on this machine counts a stream thread asleep in its queue as busy, so it cannot tell which
thread's time is CPU.) Divided by all steps of the measured runs, prefill and drain included.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the slipstream of this checkout, not an installed one
sys.path[:0] = [str(ROOT / "tools" / "bench"), str(ROOT / "tools" / "common")]  # bench_host, provenance


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


async def profile(n: int, length: int, repeats: int, depth: int, functions: bool = False
                  ) -> tuple[list[dict], "Functions | None", int]:
    """Per steady interval: {(thread, what): CPU seconds}; the profiles by function (--functions) and
    the steps of the measured runs."""
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
    sampler = Functions(engine._parts.device) if functions else None
    steps = 0
    try:
        await run_once(engine, n, min(length, 64))  # warm-up
        for _ in range(repeats):
            snaps.clear()
            timings.clear()
            if sampler is not None:
                sampler.on()
            records, _ = await run_once(engine, n, length)
            if sampler is not None:
                sampler.off()
            steps += len(records)
            for rec, *_ in steady(records, n):
                a, b = snaps[rec.step_id - 1], snaps[rec.step_id]
                delta = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
                tm = timings[rec.step_id]
                for phase in ("plan", "launch", "commit", "finalize"):
                    delta[("tick", phase)] = tm.get(phase, 0.0)
                intervals.append(delta)
    finally:
        await engine.close()
    return intervals, sampler, steps


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


class Functions:
    """cProfile on the loop's thread and on the compute stream's thread (see --functions)."""

    def __init__(self, device):
        import cProfile

        self.device = device
        self.loop = cProfile.Profile(time.thread_time)
        self.compute = cProfile.Profile(time.thread_time)

    def on(self) -> None:
        self.device.compute.launch(self.compute.enable)
        self.device.compute.record().synchronize()
        self.loop.enable()

    def off(self) -> None:
        self.loop.disable()
        self.device.compute.launch(self.compute.disable)
        self.device.compute.record().synchronize()

    def report(self, steps: int, top: int = 22) -> str:
        import pstats

        lines = ["", f"by function (cProfile, each thread's CPU clock; the measured runs' {steps} steps, prefill and "
                     "drain included; µs per step, calls per step; this tool's own instruments left out)"]
        for name, prof in (("loop", self.loop), ("stream compute", self.compute)):
            stats = pstats.Stats(prof).stats  # (file, line, function) -> (cc, nc, tottime, cumtime, callers)
            mine = (__file__, "<built-in method time.thread_time>")  # (this tool's own instruments)
            rows = sorted(((k, v) for k, v in stats.items() if k[0] != mine[0] and k[2] != mine[1]),
                          key=lambda kv: -kv[1][2])[:top]
            lines += ["", name, "", "| function | µs self | µs with callees | calls |", "|---|---:|---:|---:|"]
            for (file, line, fn), (_, nc, tt, ct, _) in rows:
                where = file[file.rindex("/slipstream/") + 12:] + ":" if "/slipstream/" in file else \
                    ("" if file == "~" else file.rsplit("/", 1)[-1] + ":")
                lines.append(f"| {where}{fn} | {1e6 * tt / steps:.1f} | {1e6 * ct / steps:.1f} | {nc / steps:.1f} |")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--len", type=int, default=2000, dest="length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2, choices=[1, 2])
    ap.add_argument("--no-header", action="store_true")
    ap.add_argument("--functions", action="store_true", help="also: CPU by function (cProfile)")
    args = ap.parse_args(argv)
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    if not args.no_header:
        from provenance import header

        print(header(" ".join(["python", "tools/profile/step_profile.py", *argv])), end="")
    import uvloop

    intervals, sampler, steps = uvloop.run(profile(args.streams, args.length, args.repeats, args.depth,
                                                   args.functions))
    if not intervals:
        raise SystemExit("no steady steps: raise --len")
    print(report(intervals, args.streams, args.depth, args.length))
    if sampler is not None:
        print(sampler.report(steps))
    return 0

if __name__ == "__main__":
    sys.exit(main())
