"""What the host executes for one steady decode step: files, functions, calls, frame depth, types.

The engine is the real one (Engine API, Planner, EngineLoop, ModelRunner, CPU device) driven by the
null model of tools/bench/bench_host.py (no math in the forward), on the CPU at depth 2 with N streams.
The tool replaces `engine.loop.tick` on the instance with a wrapper that turns `sys.setprofile` on
at the tick's start and off at its end, so one traced window is one tick: the commit of the oldest
step, the plan and launch of the next, its finalize. The tick is a coroutine: while it awaits the
step's copy event other tasks run on the loop thread, so an event counts only when the tick's own
frame is among its frame's callers (the profile hook walks `f_back`). Work on other threads (the
CPU device's stream threads, a threaded output stage) and the output stage's passes are not part of
the tick and are not counted.

With --scope interval the window is the loop thread from one tick's start to the next one's: the
tick plus what runs beside it on the asyncio loop between ticks (the output stage's passes with the
default output_stage "loop": detokenising, stop checks, stream delivery; the stream consumers;
asyncio itself). Every event on the loop thread counts then, and depth is the longest chain of
slipstream frames on the stack.

With --scope step (the default) the window is the interval's, and the CPU device's stream threads
are traced too while it is open: the forward, the sampling, the copy and the events that ran on
them in that window (in a steady state, one step's device work). This is everything one steady
decode step crosses: the tick, the output stage and the stream consumers on the loop, and the
device's side. `depth` stays the loop thread's.

A tick is kept when it committed a full-batch decode step and launched one (N rows both), after a
few warm ticks; the tool traces --ticks of them and prints each one's counts and, for the median one
(by slipstream calls), the files with their functions and the deepest slipstream call chain.

Counted, within one tick:
  * files / functions: distinct source files under slipstream/ (and their functions, by qualified
    name) whose Python code ran;
  * slipstream calls: Python function calls whose code lives under slipstream/ (a coroutine or
    generator resumed counts once: calls are distinct frames);
  * Python calls: every Python function call (stdlib asyncio, numpy and torch Python code too);
    C calls: builtins and C functions (torch ops among them), for scale;
  * depth: the longest chain of slipstream frames from the tick down (the tick is 1);
  * types: classes defined under slipstream/ whose methods (or functions nested in them) ran.

Sampling path (static, no engine): the files on the way from the API to the sampler — slipstream/
params.py, api/, scheduler/, runtime/ (serve/ and commands/ only translate their input into
SamplingParams and are left out) — whose code names a per-row sampling field: an attribute
`.temperature`, a keyword `temperature=`, a string "temperature", or an annotated field, for the
fields in SAMPLER_FIELDS (the ones only the sampler consumes; `seed`, `logprobs` and `max_tokens`
also mean other things and are left out). Docstrings and comments do not count. A file that passes
the parameters along as one object without naming a field is not listed, so this is a lower bound
on the files the parameters cross; it counts the files a renamed field touches.

    python tools/profile/step_trace.py             # N=8, depth 2, 5 traced ticks
    python tools/profile/step_trace.py --streams 32 --ticks 3 --depth 1
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the slipstream of this checkout, not an installed one
sys.path[:0] = [str(ROOT / "tools" / "bench"), str(ROOT / "tools" / "common")]  # bench_host, provenance

PKG = ROOT / "slipstream"
PKG_PREFIX = str(PKG) + "/"
SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "top_logprobs")
SAMPLING_PATH = ("params.py", "api", "scheduler", "runtime")
WARM_TICKS = 4


@dataclass
class TickTrace:
    tick: int
    calls: dict[tuple[str, str], int] = field(default_factory=dict)  # (file, qualname) -> slipstream calls
    python_calls: int = 0
    c_calls: int = 0
    max_depth: int = 0
    deepest: list[str] = field(default_factory=list)
    types: set[str] = field(default_factory=set)
    committed: tuple[str, int] | None = None  # (kind, rows) of the step this tick committed
    launched: tuple[str, int] | None = None

    @property
    def files(self) -> set[str]:
        return {f for f, _ in self.calls}

    @property
    def slipstream_calls(self) -> int:
        return sum(self.calls.values())


def _rel(filename: str) -> str | None:
    return filename[len(str(ROOT)) + 1:] if filename.startswith(PKG_PREFIX) else None


def _type_of(code, module_globals) -> str | None:
    """The slipstream class a code object belongs to (methods and functions nested in them)."""
    head = code.co_qualname.split(".")[0]
    obj = module_globals.get(head)
    return f"{module_globals.get('__name__', '?')}.{head}" if isinstance(obj, type) else None


class Tracer:
    """The sys.setprofile hook for one tick: counts events whose frame descends from the tick's frame."""

    def __init__(self, trace: TickTrace | None, whole_thread: bool = False):
        self.trace = trace  # None (a stream thread's hook between windows): nothing counts
        self.whole_thread = whole_thread  # --scope interval: every event on this thread counts
        self.root = None  # the tick coroutine's frame, set on its first event
        self.seen: list = []  # frames already counted (kept alive so their ids stay unique)
        self.seen_ids: set[int] = set()
        self.device = False  # a stream thread's hook: its frames do not count towards the depth

    def _chain(self, frame) -> list | None:
        """Frames from `frame` up to the tick's frame, or None when the tick is not a caller."""
        chain = []
        f = frame
        while f is not None:
            chain.append(f)
            if f is self.root:
                return chain
            f = f.f_back
        return chain if self.whole_thread else None

    def __call__(self, frame, event, arg) -> None:
        if self.trace is None:
            return
        if self.root is None and not self.whole_thread:
            if event == "call" and frame.f_code.co_name == "tick" and _rel(frame.f_code.co_filename):
                self.root = frame
            else:
                return
        if event == "c_call":
            if self._chain(frame) is not None:
                self.trace.c_calls += 1
            return
        if event != "call" or id(frame) in self.seen_ids:
            return
        chain = self._chain(frame)
        if chain is None or frame.f_code.co_filename == __file__:  # (this tool's wrapper and observer)
            return
        self.seen.append(frame)
        self.seen_ids.add(id(frame))
        self.trace.python_calls += 1
        code = frame.f_code
        rel = _rel(code.co_filename)
        if rel is None:
            return
        key = (rel, code.co_qualname)
        self.trace.calls[key] = self.trace.calls.get(key, 0) + 1
        kind = _type_of(code, frame.f_globals)
        if kind:
            self.trace.types.add(kind)
        ours = [f for f in reversed(chain) if _rel(f.f_code.co_filename)]
        if not self.device and len(ours) > self.trace.max_depth:
            self.trace.max_depth = len(ours)
            self.trace.deepest = [f"{_rel(f.f_code.co_filename)}:{f.f_code.co_qualname}" for f in ours]


async def trace_ticks(n: int, depth: int, ticks: int, length: int, scope: str = "tick",
                      drafts: int = 0) -> list[TickTrace]:
    """`drafts` > 0: speculation on (n-gram, that many drafts on every step, adaptive off), and the
    steady step traced is a speculating one."""
    from bench_host import PROMPT_LEN, null_model, prompts

    from slipstream.api.engine import Engine
    from slipstream.params import EngineConfig, SamplingParams, SpeculativeConfig

    spec = SpeculativeConfig(num_drafts=drafts, adaptive=False) if drafts else None
    config = EngineConfig(model="tiny-random", device="cpu", pipeline_depth=depth, batch_invariant=False,
                          max_batch_size=n, max_num_batched_tokens=max(512, n * PROMPT_LEN),
                          kv_cache_tokens=2 * n * (PROMPT_LEN + (drafts + 1) * length + 16), speculative=spec)
    kind = "speculating" if drafts else "decode"
    with null_model(max_rows=(n + 1) * (drafts + 1)):  # (a speculating step samples k + 1 positions a row)
        engine = await Engine(config).start()
    loop = engine.loop
    real_tick = loop.tick
    kept: list[TickTrace] = []
    count = [0]
    committed: list = []
    loop.observers.append(lambda step: committed.append(_shape(step)))

    open_interval: list[TickTrace] = []  # --scope interval/step: the window still being traced
    windowed = scope in ("interval", "step")
    streams = _device_hooks(engine) if scope == "step" else []  # the stream threads' hooks (step)

    def set_window(trace: TickTrace | None) -> None:
        for hook in streams:
            hook.trace = trace

    def close_interval() -> None:
        sys.setprofile(None)
        set_window(None)
        if open_interval and open_interval.pop().committed == (kind, n):
            kept.append(trace_of[0])

    trace_of: list[TickTrace] = [TickTrace(0)]

    async def traced_tick() -> bool:
        count[0] += 1
        if windowed:
            close_interval()
        if count[0] <= WARM_TICKS or len(kept) >= ticks:
            return await real_tick()
        trace = trace_of[0] = TickTrace(count[0])
        committed.clear()
        sys.setprofile(Tracer(trace, whole_thread=windowed))
        set_window(trace)
        try:
            result = await real_tick()
        finally:
            if scope == "tick":
                sys.setprofile(None)
        inflight = loop.pipeline.inflight
        if committed and inflight:
            trace.committed = committed[-1]
            trace.launched = _shape(inflight[-1])
        steady = trace.committed == trace.launched == (kind, n)
        if windowed:
            if steady:
                open_interval.append(trace)  # kept when the next tick starts
            else:
                sys.setprofile(None)
                set_window(None)
        elif steady:
            kept.append(trace)
        return result

    loop.tick = traced_tick
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)

    async def consume(prompt: list[int]) -> None:
        async for _ in engine.stream(prompt, params):
            pass

    try:
        await asyncio.gather(*(consume(p) for p in prompts(n)))
    finally:
        sys.setprofile(None)
        set_window(None)
        loop.tick = real_tick
        await engine.close()
    if len(kept) < ticks:
        raise RuntimeError(f"only {len(kept)} steady ticks of {ticks}: raise --len")
    return kept


def _shape(step) -> tuple[str, int]:
    """(kind, rows) of a step, read from its plain fields: the tool's own reads call no slipstream code."""
    kind = "prefill" if step.chunks else "speculating" if step.drafts else "decode"
    return kind, len(step.decode) + len(step.chunk_seqs)


def _device_hooks(engine) -> list[Tracer]:
    """A profile hook on each of the CPU device's stream threads (installed by work launched on the
    stream, so it runs on that thread), counting into the open window's trace while one is open."""
    device = engine._parts.device
    hooks = []
    for stream in dict.fromkeys((device.compute, device.copy, device.upload)):
        hook = Tracer(None, whole_thread=True)
        hook.device = True
        stream.launch(lambda hook=hook: sys.setprofile(hook))
        hooks.append(hook)
    for stream in dict.fromkeys((device.compute, device.copy, device.upload)):
        stream.record().synchronize()
    return hooks


def sampling_files() -> dict[str, list[str]]:
    """File -> the sampler fields it names (ast: attributes, keywords, strings, annotated fields)."""
    wanted = set(SAMPLER_FIELDS)
    out: dict[str, list[str]] = {}
    paths = []
    for part in SAMPLING_PATH:
        p = PKG / part
        paths += [p] if p.is_file() else sorted(p.rglob("*.py"))
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names.add(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        hit = sorted(names & wanted)
        if hit:
            out[str(path.relative_to(ROOT))] = hit
    return out


def report(traces: list[TickTrace], n: int, depth: int, scope: str = "tick", drafts: int = 0) -> str:
    what = {"tick": "one steady decode tick (commit + plan + launch + finalize)",
            "interval": "the loop thread from one steady decode tick's start to the next's (the tick + output "
                        "stage + asyncio)",
            "step": "one steady decode step: the loop thread from one steady tick's start to the next's (the tick, "
                    "the output stage, the stream consumers) and the device's stream threads meanwhile"}[scope]
    if drafts:
        what = what.replace("decode", f"speculating ({drafts} n-gram drafts a row)")
    lines = [f"{what}, N={n}, depth {depth}, null model, CPU", "",
             "| tick | files | functions | slipstream calls | Python calls | C calls | depth | types |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in traces:
        lines.append(f"| {t.tick} | {len(t.files)} | {len(t.calls)} | {t.slipstream_calls} | {t.python_calls} | "
                     f"{t.c_calls} | {t.max_depth} | {len(t.types)} |")
    rep = sorted(traces, key=lambda t: t.slipstream_calls)[len(traces) // 2]
    med = {k: statistics.median(v) for k, v in {
        "files": [len(t.files) for t in traces], "functions": [len(t.calls) for t in traces],
        "calls": [t.slipstream_calls for t in traces], "python": [t.python_calls for t in traces],
        "depth": [t.max_depth for t in traces], "types": [len(t.types) for t in traces]}.items()}
    lines += ["", f"median: {med['files']:g} files, {med['functions']:g} functions, {med['calls']:g} slipstream "
                  f"calls ({med['python']:g} Python calls), {med['depth']:g} slipstream frames deep, "
                  f"{med['types']:g} types", "",
              f"tick {rep.tick} (the median by slipstream calls), files: functions / calls"]
    per_file: dict[str, Counter] = defaultdict(Counter)
    for (f, q), c in rep.calls.items():
        per_file[f][q] += c
    for f in sorted(per_file):
        fns = per_file[f]
        lines.append(f"  {f}: {len(fns)} / {sum(fns.values())}  " + ", ".join(
            f"{q}" + (f"×{c}" if c > 1 else "") for q, c in sorted(fns.items())))
    lines += ["", f"types ({len(rep.types)}): " + ", ".join(sorted(rep.types)), "",
              f"deepest slipstream chain ({rep.max_depth}):"] + [f"  {x}" for x in rep.deepest]
    files = sampling_files()
    lines += ["", f"sampling path (static): {len(files)} files under slipstream/{{{','.join(SAMPLING_PATH)}}} "
                  f"name a sampler field ({', '.join(SAMPLER_FIELDS)})"]
    lines += [f"  {f}: {', '.join(names)}" for f, names in files.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--depth", type=int, default=2, choices=[1, 2])
    ap.add_argument("--ticks", type=int, default=5, help="steady ticks to trace")
    ap.add_argument("--len", type=int, default=32, dest="length", help="output tokens per stream")
    ap.add_argument("--scope", choices=["step", "tick", "interval"], default="step",
                    help="step: the loop thread from tick to tick and the device's threads meanwhile; tick: the "
                         "tick's own call tree; interval: the loop thread from tick to tick")
    ap.add_argument("--drafts", type=int, default=0,
                    help="trace a steady speculating step instead: n-gram drafts, this many on every step")
    ap.add_argument("--no-header", action="store_true", help="no provenance header")
    args = ap.parse_args(argv)
    if args.length < WARM_TICKS + 2 * args.ticks + 4:
        ap.error(f"--len must be at least {WARM_TICKS + 2 * args.ticks + 4} for {args.ticks} steady ticks")
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    if not args.no_header:
        from provenance import header

        print(header(" ".join(["python", "tools/profile/step_trace.py", *argv])), end="")
    t0 = time.perf_counter()
    traces = asyncio.run(trace_ticks(args.streams, args.depth, args.ticks, args.length, args.scope, args.drafts))
    print(report(traces, args.streams, args.depth, args.scope, args.drafts))
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
