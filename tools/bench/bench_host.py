"""Host-only cost per step: the real engine driven by a model whose forward takes no time.

Everything on the host path is the real code — Engine API, Planner, EngineLoop (plan / launch /
commit / finalize), pack_step, the ModelRunner's StepArena fill and StepSlot staging, sampling
launch, the OutputProcessor (detokenise, stop checks, stream delivery), the CPU device's stream
threads and events. Only the model is replaced: `NullModel` has LlamaForCausalLM's call signature
and returns a view of a preallocated logits tensor, so the "device" work of a step is a few tiny
tensor ops (the last-token gather, an argmax over [N, 512], two small copies) that run on the CPU
device's stream threads, beside the loop. What remains in the wall time per step is the host.

Workload: N concurrent streams (8-token prompts, greedy, ignore_eos, L output tokens each) on one
engine at depth 2 (or --depth 1), max_batch_size = the largest N, batch_invariant off (no CPU row
padding). Steady state only: commit-to-commit intervals of full-batch decode steps whose
neighbours are full-batch decode steps too (the prefill step, the first decode step after it and
the drain at the end are left out). A warm-up run per N, then --repeats runs; the table pools the
steady steps of all repeats. Two clocks per interval: wall (perf_counter) and the process's CPU
time (all threads). With a device that takes no time the process is never idle, so on a quiet
machine the two agree; on a shared machine other processes inflate the wall, not the CPU time.
Least-squares lines through the per-N medians and means give intercept µs + slope µs per extra
sequence per step. Garbage collection is left on (it is part of the host's cost).

A per-step median can misdescribe a bursty loop: when the output stage falls behind, one pass
delivers several tokens per request and the steps between passes look cheap. So beside the
per-step figures: the whole run's CPU time (process, and the loop's thread) ÷ its output tokens
(N × L, prefill and drain included), and the output stage's request-passes (one request's new
tokens turned into text and delivered) per step, with the tokens per delta a consumer received.

    python tools/bench/bench_host.py                # N = 1 8 32 128 256 512, L = 128, 3 repeats
    python tools/bench/bench_host.py --streams 1 4 --repeats 1 --len 16

The seam (what this tool depends on, so it survives refactors of the scheduler and runtime):
  * `slipstream.api.assemble.build_model(spec, dtype, torch_device, seed, pack=..., ...) -> (model, tokenizer,
    ModelConfig)`, patched for the duration of `Engine.start()` to return a NullModel;
  * the model contract: called as `model(batch, kv)` with `batch.sample_indices` (one row per
    sampled token) and returns logits [len(sample_indices), vocab]; `model.config.vocab_size`
    (if the runner starts calling other model methods, NullModel needs them too);
  * `slipstream.models.llama.build.RANDOM["tiny-random"]` (the config) and
    `slipstream.models.tokenizers.byte_tokenizer.ByteTokenizer` / `OFFSET`;
  * the public API: Engine, EngineConfig (max_batch_size, max_num_batched_tokens,
    kv_cache_tokens, batch_invariant, pipeline_depth), SamplingParams, `engine.stream`;
  * `engine.loop.outputs.token_observers` (called once per request and output-stage pass, with
    (token_times, start, end, arrival, prompt_len)); without it the pass columns read 0;
  * `engine.loop.observers` (called with each committed step) and, on the step, `step_id`,
    `kind`, `seqs` and the `timings` dict (plan / launch / commit / commit_wait / finalize seconds);
    missing timing keys only blank the breakdown columns, the per-step figure does not use them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout, not an installed one

import torch  # noqa: E402
from torch import nn  # noqa: E402

PROMPT_LEN = 8
PHASES = ("plan", "launch", "commit", "finalize", "commit_wait")
DEFAULT_STREAMS = (1, 8, 32, 128, 256, 512)


# --- the null model ------------------------------------------------------------------------------

class NullModel(nn.Module):
    """A `Model` (slipstream/models/base.py) with no math: logits are a view of a preallocated tensor.

    Row i's argmax is a lowercase letter (byte tokenizer ids), so outputs are real text and the
    detokeniser does its ordinary work; neighbouring rows get different letters.
    """

    backend = "reference"  # (never moves: no mixed graphs, no compiled CPU kernels)
    backends = ("reference",)
    carry_heads = None
    vision = None

    def __init__(self, config, max_rows: int, device: torch.device):
        super().__init__()
        self.config = config
        from slipstream.models.tokenizers.byte_tokenizer import OFFSET

        logits = torch.zeros(max_rows, config.vocab_size, dtype=torch.float32, device=device)
        rows = torch.arange(max_rows, device=device)
        logits[rows, OFFSET + ord("a") + rows % 26] = 1.0
        self.register_buffer("logits", logits, persistent=False)

    def forward(self, batch, kv) -> torch.Tensor:
        return self.logits[: batch.sample_indices.shape[0]]

    def set_kernel_backend(self, backend: str, options=None) -> None:  # assemble calls it on CUDA
        pass

    def encode_image(self, image, mask=None) -> torch.Tensor:
        raise TypeError("the null model takes no images")

    def set_attention_dtype(self, dtype) -> None:  # assemble calls it with batch_invariant on the CPU
        pass


@contextlib.contextmanager
def null_model(max_rows: int):
    """Within the block, engines assembled from a random-weight spec get a NullModel."""
    from slipstream.api import assemble
    from slipstream.models.llama.build import RANDOM
    from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

    if not hasattr(assemble, "build_model"):
        raise RuntimeError("slipstream.api.assemble.build_model is gone: move the seam of tools/bench/bench_host.py")
    real = assemble.build_model

    def build(spec: str, dtype: str, device: torch.device, seed: int = 0, pack: bool = False, **_):
        config = RANDOM[spec]()
        return NullModel(config, max_rows, device), ByteTokenizer(config.vocab_size), config

    assemble.build_model = build
    try:
        yield
    finally:
        assemble.build_model = real


# --- one run ---------------------------------------------------------------------------------

@dataclass
class StepRecord:
    step_id: int
    kind: str
    num_seqs: int
    t_commit: float  # wall clock (perf_counter) at the commit's observer call
    cpu_commit: float  # process CPU time (every thread) at the same moment
    loop_cpu_commit: float  # CPU time of the loop's own thread (the observer runs on it)
    phases: dict[str, float]
    passes: int = 0  # the output stage's request-passes so far in the run, at this commit


@dataclass
class RunTotals:
    """One run from submission to the last stream's end (prefill and drain included)."""
    wall_s: float
    cpu_s: float  # process CPU time (every thread)
    loop_cpu_s: float  # the loop thread's CPU time
    tokens: int  # output tokens (N × L)
    steps: int  # steps committed
    passes: int  # output-stage request-passes
    deltas: int  # stream deltas the consumers received


@dataclass
class NResult:
    streams: int
    step_us: list[float] = field(default_factory=list)  # steady commit-to-commit wall intervals, all repeats
    cpu_us: list[float] = field(default_factory=list)  # process CPU time over the same intervals
    loop_cpu_us: list[float] = field(default_factory=list)  # the loop thread's CPU time over them
    phase_us: dict[str, list[float]] = field(default_factory=dict)
    run_wall_per_token_us: list[float] = field(default_factory=list)  # per repeat: run wall / L (public API only)
    passes: list[float] = field(default_factory=list)  # output-stage request-passes in each steady interval
    runs: list[dict] = field(default_factory=list)  # per repeat: RunTotals as a dict

    def per_run(self, what: str) -> list[float]:
        """Per repeat: cpu_per_token_us, loop_cpu_per_token_us, passes_per_step or tokens_per_delta."""
        div = {"cpu_per_token_us": lambda r: 1e6 * r["cpu_s"] / r["tokens"],
               "loop_cpu_per_token_us": lambda r: 1e6 * r["loop_cpu_s"] / r["tokens"],
               "passes_per_step": lambda r: r["passes"] / r["steps"],
               "tokens_per_delta": lambda r: r["tokens"] / r["deltas"]}[what]
        return [div(r) for r in self.runs]

    def stats(self, cpu: bool = False) -> tuple[float, float, float]:
        xs = self.cpu_us if cpu else self.step_us
        return statistics.median(xs), statistics.fmean(xs), _p90(xs)


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[8] if len(xs) > 1 else xs[0]


def prompts(n: int) -> list[list[int]]:
    return [[100 + (7 * i + j) % 150 for j in range(PROMPT_LEN)] for i in range(n)]


def steady(records: list[StepRecord], n: int) -> list[tuple[StepRecord, float, float, float]]:
    """(step, wall, process CPU and loop-thread CPU time since the previous commit) of full-batch
    decode steps with full-batch decode neighbours: the loop was planning, launching and committing
    N rows the whole interval."""
    full = [r.kind == "decode" and r.num_seqs == n for r in records]
    out = []
    for i in range(1, len(records) - 1):
        consecutive = records[i - 1].step_id + 1 == records[i].step_id == records[i + 1].step_id - 1
        if full[i - 1] and full[i] and full[i + 1] and consecutive:
            prev, cur = records[i - 1], records[i]
            out.append((cur, cur.t_commit - prev.t_commit, cur.cpu_commit - prev.cpu_commit,
                        cur.loop_cpu_commit - prev.loop_cpu_commit, cur.passes - prev.passes))
    return out


async def run_once(engine, n: int, length: int) -> tuple[list[StepRecord], RunTotals]:
    """N streams of `length` tokens; returns the committed steps and the run's totals (submission to
    the last stream's end, prefill and drain included: its wall ÷ L is a public-API cross-check)."""
    from slipstream.params import SamplingParams

    records: list[StepRecord] = []
    passes = [0]
    deltas = [0]

    def observe(step) -> None:
        tm = getattr(step, "timings", {}) or {}
        records.append(StepRecord(step.step_id, step.kind, len(step.seqs), time.perf_counter(), time.process_time(),
                                  time.thread_time(),
                                  {p: tm[p] for p in PHASES if p in tm}, passes[0]))

    def on_pass(token_times, start, end, arrival, prompt_len) -> None:
        passes[0] += 1

    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)

    async def consume(prompt: list[int]) -> None:
        got = 0
        async for delta in engine.stream(prompt, params):
            got += len(delta.token_ids)
            deltas[0] += bool(delta.token_ids)
        if got != length:
            raise AssertionError(f"a stream got {got} tokens, expected {length}")

    stage = getattr(engine.loop.outputs, "token_observers", None)
    engine.loop.observers.append(observe)
    if stage is not None:
        stage.append(on_pass)
    t0, cpu0, loop0 = time.perf_counter(), time.process_time(), time.thread_time()  # (this runs on the loop)
    try:
        await asyncio.gather(*(consume(p) for p in prompts(n)))
    finally:
        engine.loop.observers.remove(observe)
        if stage is not None:
            stage.remove(on_pass)
    totals = RunTotals(time.perf_counter() - t0, time.process_time() - cpu0, time.thread_time() - loop0,
                       n * length, len(records), passes[0] if stage is not None else 0, deltas[0])
    return records, totals


async def bench(streams: list[int], length: int, repeats: int, depth: int, on_run=None,
                output_stage: str | None = None) -> list[NResult]:
    from slipstream.api.engine import Engine
    from slipstream.params import EngineConfig

    top = max(streams)
    extra = {} if output_stage is None else {"output_stage": output_stage}  # (older checkouts lack it)
    config = EngineConfig(model="tiny-random", device="cpu", pipeline_depth=depth, batch_invariant=False,
                          max_batch_size=top, max_num_batched_tokens=max(512, top * PROMPT_LEN),
                          kv_cache_tokens=2 * top * (PROMPT_LEN + length + 16), **extra)
    with null_model(max_rows=top + 1):  # a step samples at most one row per sequence
        engine = await Engine(config).start()
    results = []
    try:
        await run_once(engine, top, min(length, 8))  # first touch of every buffer at the largest batch
        for n in streams:
            res = NResult(n, phase_us={p: [] for p in PHASES})
            await run_once(engine, n, length)  # warm-up at this N
            for rep in range(repeats):
                records, totals = await run_once(engine, n, length)
                rows = steady(records, n)
                res.step_us += [_us(row[1]) for row in rows]
                res.cpu_us += [_us(row[2]) for row in rows]
                res.loop_cpu_us += [_us(row[3]) for row in rows]
                res.passes += [row[4] for row in rows]
                for r, *_ in rows:
                    for p, v in r.phases.items():
                        res.phase_us[p].append(_us(v))
                res.run_wall_per_token_us.append(_us(totals.wall_s / length))
                res.runs.append({k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(totals).items()})
                if on_run is not None:
                    on_run(n, rep, rows, totals)
            if not res.step_us:
                raise RuntimeError(f"no steady-state decode steps at N={n}: raise --len")
            results.append(res)
    finally:
        await engine.close()
    return results


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)  # 0.1 µs: finer than the clocks' real resolution; keeps the JSON small


# --- fit and tables --------------------------------------------------------------------------

def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a, b). One point: (y, 0)."""
    if len(xs) < 2:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def fits(results: list[NResult]) -> dict[str, tuple[float, float]]:
    """(intercept µs, slope µs per extra sequence per step) through the per-N medians and means."""
    ns = [r.streams for r in results]
    return {"wall median": fit_line(ns, [r.stats()[0] for r in results]),
            "wall mean": fit_line(ns, [r.stats()[1] for r in results]),
            "CPU median": fit_line(ns, [r.stats(cpu=True)[0] for r in results]),
            "CPU mean": fit_line(ns, [r.stats(cpu=True)[1] for r in results])}


def format_report(results: list[NResult]) -> str:
    lines = ["host µs per decode step, steady state (steps of all repeats pooled)", "",
             "| N | steps | wall median | wall mean | wall p90 | CPU median | CPU mean | CPU p90 "
             "| loop-thread CPU mean | run wall / L |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        med, mean, p90 = r.stats()
        cmed, cmean, cp90 = r.stats(cpu=True)
        lines.append(f"| {r.streams} | {len(r.step_us)} | {med:.0f} | {mean:.0f} | {p90:.0f} | {cmed:.0f} | "
                     f"{cmean:.0f} | {cp90:.0f} | {statistics.fmean(r.loop_cpu_us):.0f} | "
                     f"{statistics.fmean(r.run_wall_per_token_us):.0f} |")
    lines += ["", "wall: commit-to-commit interval; CPU: process CPU time (all threads) over the same interval, "
                  "which other processes on the machine cannot inflate; loop-thread CPU: the part spent on the "
                  "asyncio loop's thread; run wall / L: one run's wall (submission to last token, prefill and "
                  "drain included) ÷ output length, mean of repeats", ""]
    for name, (a, b) in fits(results).items():
        lines.append(f"fit on the {name + 's:':<13} intercept {a:7.0f} µs, slope {b:6.2f} µs per extra sequence "
                     "per step")
    lines.append("")
    if any(r.phase_us.get(p) for r in results for p in PHASES):
        lines += ["loop phases per step, medians (µs): plan / launch / commit / finalize are host work "
                  "(EngineLoop step timings); commit_wait is the await of the step's copy event", "",
                  "| N | plan | launch | commit | finalize | sum | commit_wait | wall median − sum |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results:
            med = {p: statistics.median(v) if v else float("nan") for p, v in r.phase_us.items()}
            total = sum(med[p] for p in PHASES[:4])
            lines.append(f"| {r.streams} | " + " | ".join(f"{med[p]:.0f}" for p in PHASES[:4])
                         + f" | {total:.0f} | {med['commit_wait']:.0f} | {r.stats()[0] - total:.0f} |")
        lines += ["", "wall median − sum: the step's time outside the four phases (stream consumers, the asyncio "
                      "loop, the commit wait, this tool's observer)"]
    lines += ["", "whole runs and the output stage (per run: mean of the repeats, (min–max) with several; per step: "
                  "steady steps pooled)", "",
              "| N | CPU µs / token | loop-thread CPU µs / token | passes / step median | passes / step mean "
              "| passes / step p90 | passes / step (run) | tokens / delta |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        med, mean, p90 = (statistics.median(r.passes), statistics.fmean(r.passes), _p90(r.passes)) if r.passes \
            else (float("nan"),) * 3
        cpu, loop, runs, delta = (_spread(r.per_run(w), d) for w, d in (
            ("cpu_per_token_us", 1), ("loop_cpu_per_token_us", 1), ("passes_per_step", 1), ("tokens_per_delta", 2)))
        lines.append(f"| {r.streams} | {cpu} | {loop} | {med:.0f} | {mean:.1f} | {p90:.0f} | {runs} | {delta} |")
    lines += ["", "CPU µs / token: the run's process CPU time (all threads; loop-thread: the asyncio loop's "
                  "thread alone), submission to the last token, ÷ its N × L output tokens; a pass: the output "
                  "stage turning one request's new tokens into text and delivering them; passes / step: in each "
                  "steady interval (median, mean, p90) and over the whole run (its passes ÷ its steps); "
                  "tokens / delta: output tokens ÷ the stream deltas the consumers received (1.0: a delta every "
                  "step; more: the stage batches steps, the loop is bursty)"]
    return "\n".join(lines)


def _spread(xs: list[float], digits: int) -> str:
    """Mean, and the repeats' range when there are several (a bursty loop differs run to run)."""
    mean = f"{statistics.fmean(xs):.{digits}f}"
    return mean if len(xs) < 2 else f"{mean} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


def provenance(argv: list[str]) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {"command": shlex.join(["python", "tools/bench/bench_host.py", *argv]),
            "git_commit": git("rev-parse", "--short", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": platform.platform(), "cpu": _cpu_name(),
            "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_start": os.getloadavg(),
            "slipstream": str(Path(__import__("slipstream").__file__).parent)}


def format_header(meta: dict, args) -> str:
    dirty = " (dirty: uncommitted changes to tracked files)" if meta["git_dirty"] else " (clean)"
    lines = [f"# command:  {meta['command']}",
             f"# code:     git {meta['git_commit']}{dirty}; slipstream imported from {meta.get('slipstream', '?')}",
             f"# date:     {meta['date_utc']}, {meta['seconds']} s",
             f"# machine:  {meta['machine']}, {meta['cpu']}, {meta['cores']} cores; "
             f"load average (1/5/15 min) at start {_load(meta['load_avg_start'])}, "
             f"at end {_load(meta['load_avg_end'])}",
             f"# versions: python {meta['python']}, torch {meta['torch']} ({meta['torch_threads']} threads), "
             f"uvloop {meta['uvloop']}",
             f"# workload: null model (tiny-random config, byte tokenizer), CPU device, depth {args.depth}, "
             f"L={args.length}, {args.repeats} repeat(s) per N after one warm-up run, greedy, ignore_eos, "
             f"output stage {args.output_stage or 'default'}"]
    lines += [f"# note:     {line}" for line in args.note]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _load(avg) -> str:
    return "/".join(f"{x:.2f}" for x in avg)


def to_json(doc: dict) -> str:
    """One line per top-level key: diffable, and small with thousands of intervals."""
    return "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items()) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=list(DEFAULT_STREAMS))
    ap.add_argument("--len", type=int, default=128, dest="length", help="output tokens per stream (ignore_eos)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2, choices=[1, 2])
    ap.add_argument("--output-stage", choices=["loop", "thread"], default=None,
                    help="EngineConfig.output_stage (default: the engine's default)")
    ap.add_argument("--json-out", metavar="PATH", help="also write every interval and the fit as JSON")
    ap.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")
    ap.add_argument("--note", action="append", default=[], help="a line for the output's header (repeatable)")
    args = ap.parse_args(argv)
    if min(args.streams) < 1 or args.length < 5 or args.repeats < 1:
        ap.error("--streams >= 1, --len >= 5 (steady steps need neighbours) and --repeats >= 1")
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    meta = provenance(argv)

    def on_run(n, rep, rows, totals) -> None:
        if not args.quiet:
            wall = [row[1] * 1e6 for row in rows] or [float("nan")]
            print(f"  N={n} repeat {rep + 1}/{args.repeats}: {len(rows)} steady steps, wall median "
                  f"{statistics.median(wall):.0f} µs, mean {statistics.fmean(wall):.0f} µs; run wall / L "
                  f"{totals.wall_s * 1e6 / args.length:.0f} µs, CPU {totals.cpu_s * 1e6 / totals.tokens:.1f} µs "
                  f"per token, {totals.passes / totals.steps:.1f} passes per step, "
                  f"{totals.tokens / max(totals.deltas, 1):.2f} tokens per delta", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    import uvloop  # the engine's loop of choice, as in the CLI

    results = uvloop.run(bench(sorted(set(args.streams)), args.length, args.repeats, args.depth, on_run,
                               args.output_stage))
    meta.update(seconds=round(time.perf_counter() - t0, 1), load_avg_end=os.getloadavg(), uvloop=uvloop.__version__,
                note=args.note)
    print(format_header(meta, args), flush=True)
    print(format_report(results))
    if args.json_out:
        doc = {**meta, "depth": args.depth, "len": args.length, "repeats": args.repeats, "fits": fits(results),
               "results": [asdict(r) for r in results]}
        with open(args.json_out, "w") as f:
            f.write(to_json(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
