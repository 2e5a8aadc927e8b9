"""Cold start with and without the converted-weights cache: first start (empty cache) vs second start.

Each start is a fresh Python process, timed from the parent (interpreter start and imports included):
  weights  - `build_model(spec, weights=W, pack=True)`: the model is built as the engine builds it on the
             CPU (W "quantized", the default: the GGUF's quantized matrices kept, the compiled CPU kernels
             built at the first start; "dequantized": float32, projections packed for oneDNN), ready
             for a forward; its RSS right after the build is recorded beside the peak
  (--weights lists the modes; each runs its own first and second starts)
  generate - `slipstream generate PROMPT --max-tokens 1`: a whole CLI run to the first token
Peak RSS is each child's own (os.wait4).
The cache lives in a temporary directory (SLIPSTREAM_CACHE_DIR), emptied before every first start, so
the user's own cache is never touched. Prints a provenance header and a markdown table.

    python tools/bench/cold_start.py --repeats 3 [--model smollm2-135m] [--out docs/results/.../cold-start.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, time
t0 = time.perf_counter()
import torch
from slipstream.models.loading.build import build_model
t1 = time.perf_counter()
build_model({spec!r}, "float32", torch.device("cpu"), pack=True, weights={weights!r})  # as the engine builds it
rss = int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
print(json.dumps({{"import_s": t1 - t0, "build_s": time.perf_counter() - t1, "rss_after_build_mb": rss}}))
"""


def provenance(argv: list[str]) -> str:
    sys.path.insert(0, str(ROOT))  # this checkout's slipstream
    from slipstream.provenance import header, provenance as prov

    return header(prov(["python", "tools/bench/cold_start.py", *argv]))


def start(kind: str, spec: str, env: dict[str, str], weights: str) -> dict[str, float]:
    if kind == "weights":
        cmd = [sys.executable, "-c", CHILD.format(spec=spec, weights=weights)]
    else:
        cmd = [sys.executable, "-m", "slipstream.cli", "generate", "Hi", "--max-tokens", "1", "--model", spec,
               "--weights", weights]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS, not all children's
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{stderr[-2000:]}")
    row = {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}  # Linux: ru_maxrss is in KiB
    if kind == "weights":
        row.update(json.loads(stdout.strip().splitlines()[-1]))
    else:  # what the CLI told the user about its slow first-start phases (logging_setup.first_start_phase)
        row["phase_lines"] = [line for line in stderr.splitlines() if " in " in line and "(once:" in line]
    return row


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, round(0.9 * (len(xs) - 1)))]
    return f"{statistics.median(xs):.2f} | {statistics.mean(xs):.2f} | {p90:.2f} | {xs[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["weights", "generate"], choices=["weights", "generate"])
    ap.add_argument("--weights", nargs="+", default=["quantized"], choices=["quantized", "dequantized"])
    ap.add_argument("--out", type=Path, help="also write the report (header + table + raw rows) here")
    args = ap.parse_args()
    head = provenance(sys.argv[1:])  # (the load average before this tool's own starts)
    cache = Path(tempfile.mkdtemp(prefix="slipstream-cold-"))
    env = dict(os.environ, SLIPSTREAM_CACHE_DIR=str(cache), SLIPSTREAM_WEIGHT_CACHE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows: list[dict] = []
    try:
        for kind in args.kinds:
            for rep in range(args.repeats):
                for weights in args.weights:  # modes interleaved within a repeat
                    shutil.rmtree(cache, ignore_errors=True)
                    for which in ("first", "second"):
                        r = start(kind, args.model, env, weights)
                        rows.append({"kind": kind, "weights": weights, "repeat": rep, "start": which, **r})
                        print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    lines = [head, f"end (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}, "
             f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}", "",
             f"model {args.model}, {args.repeats} repeats, seconds", "",
             "| weights | start | what | wall median | mean | p90 | min | build_model median | mean | p90 | min "
             "| RSS after build MB median | peak RSS MB median | max |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in args.kinds:
        for weights in args.weights:
            for which in ("first", "second"):
                sel = [r for r in rows if r["kind"] == kind and r["start"] == which and r["weights"] == weights]
                build = summary([r["build_s"] for r in sel]) if kind == "weights" else "- | - | - | -"
                after = f"{statistics.median(r['rss_after_build_mb'] for r in sel):.0f}" if kind == "weights" else "-"
                rss = [r["peak_rss_mb"] for r in sel]
                lines.append(f"| {weights} | {which} | {kind} | {summary([r['wall_s'] for r in sel])} | {build} "
                             f"| {after} | {statistics.median(rss):.0f} | {max(rss):.0f} |")
    lines += ["", "raw rows:", *(json.dumps(r) for r in rows)]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
