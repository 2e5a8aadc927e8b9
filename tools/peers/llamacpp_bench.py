"""llama.cpp as a peer: N parallel sequences through `llama-batched-bench`, the workload of tools/peers/peer_bench.py.

    python tools/peers/llamacpp_bench.py --build /tmp/llamacpp-build --dtype f16 --concurrency 1 8 32 128
    (normally through tools/peers/llamacpp_peer.sh bench BUILD ...; tools/gpu/gpu_check.sh stage `llamacpp`)

Model: slipstream's `random-smollm2-135m` written as a GGUF by tools/peers/random_gguf.py (identical
weights to slipstream's and transformers', seed 0). Workload per N: N sequences of --prompt-len
token ids prefilled together, then L − 1 decode steps of N tokens each (the prefill yields each
sequence's first token, as in peer_bench: L output tokens per sequence). One process per N (fresh
memory), the KV budget of peer_bench (every request twice over), per-step budget --batch-tokens;
the first pass at each N is a warm-up, then --repeats passes.

Reported per N: tokens/s = N·L / (prefill + decode time), ITL = decode time / (L − 1), TTFT = the
prefill time of all N prompts (every sequence's first token exists only when the whole batched
prefill is done), memory = llama.cpp's own buffers (model + KV + compute, from its log) and, on a
GPU, the process's peak as nvidia-smi sees it (CUDA context included).
Differences from slipstream's loop, stated, not corrected: batched-bench feeds random token ids
and does not sample (no argmax, no detokenisation, no stop checks), and synchronises after every
step (a blocking loop).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(os.path.dirname(_TOOLS))]  # this room, this checkout's slipstream

from slipstream.provenance import header, provenance  # noqa: E402

BUFFER_RE = re.compile(r"(\S+) +(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")


def llamacpp_commit(build: str) -> str:
    """The snapshot's commit as written by tools/peers/llamacpp_peer.sh source (next to the source tree, or in
    a prebuilt dist beside bin/: tools/peers/llamacpp_peer.sh dist)."""
    cache = os.path.join(build, "CMakeCache.txt")
    src = build if os.path.exists(os.path.join(build, ".snapshot-commit")) else None
    if src is None and os.path.exists(cache):
        for line in open(cache):
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                src = line.split("=", 1)[1].strip()
    files = [os.path.join(src, n) for n in (".snapshot-commit", ".snapshot-origin")] if src else []
    if not files or not all(os.path.exists(f) for f in files):
        return "unknown"
    return " / ".join(open(f).read().strip() for f in files)


class GpuPeak:
    """Polls nvidia-smi for one process's GPU memory (MiB) while it runs; None without a GPU."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, None, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.stdout.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip() == str(self.pid) and mib.strip().isdigit():
                    self.peak = max(self.peak or 0, int(mib))
            self._stop.wait(0.2)

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.peak


def parse_run(stdout: str, log: str, n: int, length: int) -> dict:
    """The jsonl lines of one batched-bench process: drop the warm-up pass, keep the repeats."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    rows = [r for r in rows if r["pl"] == n]
    if len(rows) < 2:
        raise RuntimeError(f"llama-batched-bench gave {len(rows)} result lines for N={n}; log tail:\n{log[-2000:]}")
    reps = []
    for r in rows[1:]:
        reps.append({"tok_s": n * length / (r["t_pp"] + r["t_tg"]), "ttft_ms": r["t_pp"] * 1e3,
                     "itl_ms": r["t_tg"] / (length - 1) * 1e3, "decode_tok_s": r["speed_tg"], "raw": r})
    buffers: dict[str, float] = {}
    for dev, kind, mib in BUFFER_RE.findall(log):
        key = f"{kind} ({dev})"
        buffers[key] = buffers.get(key, 0.0) + float(mib)
    out = {k: statistics.median(r[k] for r in reps) for k in ("tok_s", "ttft_ms", "itl_ms", "decode_tok_s")}
    out["tok_s_mean"] = statistics.fmean(r["tok_s"] for r in reps)
    xs = sorted(r["tok_s"] for r in reps)
    out["tok_s_p90"] = statistics.quantiles(xs, n=10, method="inclusive")[8] if len(xs) > 1 else xs[0]
    out.update(buffers_mib=buffers, buffers_total_mib=sum(buffers.values()), repeats=reps)
    return out


def run_one(args, model: str, n: int) -> dict:
    exe = os.path.join(args.build, "bin", "llama-batched-bench")
    kv = 2 * max(args.concurrency) * (args.prompt_len + args.output_len + 16)
    cmd = [exe, "-m", model, "-c", str(kv), "-b", str(args.batch_tokens), "-ub", str(args.ubatch),
           "-npp", str(args.prompt_len), "-ntg", str(args.output_len - 1),
           "-npl", ",".join([str(n)] * (args.repeats + 1)), "-ngl", "999", "-fa", args.flash_attn,
           "--output-format", "jsonl", "-lv", "4"]  # -lv 4: its info lines, buffer sizes among them
    if args.threads:
        cmd += ["-t", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = GpuPeak(proc.pid)
    stdout, stderr = proc.communicate(timeout=args.timeout)
    gpu_peak = peak.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr[-3000:]}")
    res = parse_run(stdout, stderr, n, args.output_len)
    res["gpu_process_peak_mib"] = gpu_peak
    res["command"] = " ".join(cmd)
    return res


def table(res: dict) -> str:
    lines = ["| N | system | tokens/s (median / mean / p90) | ITL ms | TTFT ms | buffers MiB (model+KV+compute) "
             "| process peak GPU MiB |", "|---:|---|---:|---:|---:|---:|---:|"]
    for n, r in res.items():
        gpu = "n/a" if r["gpu_process_peak_mib"] is None else str(r["gpu_process_peak_mib"])
        lines.append(f"| {n} | llama.cpp | {r['tok_s']:.1f} / {r['tok_s_mean']:.1f} / {r['tok_s_p90']:.1f} | "
                     f"{r['itl_ms']:.2f} | {r['ttft_ms']:.1f} | {r['buffers_total_mib']:.0f} | {gpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True, help="llama.cpp build directory (tools/peers/llamacpp_peer.sh build)")
    ap.add_argument("--model", help="a GGUF; default: write random-smollm2-135m in --dtype next to the build")
    ap.add_argument("--spec", default="random-smollm2-135m")
    ap.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512, help="llama.cpp's physical batch (its default)")
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: llama.cpp's default)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json-out", metavar="PATH")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1 or args.output_len < 2 or args.prompt_len < 1 or args.repeats < 1:
        print("llamacpp_bench: --concurrency >= 1, --output-len >= 2, --prompt-len >= 1, --repeats >= 1",
              file=sys.stderr)
        return 2
    commit = llamacpp_commit(args.build)
    prov = provenance([os.path.basename(sys.executable), "tools/peers/llamacpp_bench.py", *argv],
                      extra={"llama.cpp": commit})
    model = args.model
    if model is None:
        from random_gguf import write

        model = os.path.join(args.build, f"{args.spec}-{args.dtype}.gguf")
        t0 = time.perf_counter()
        info = write(args.spec, args.dtype, model)
        print(f"  wrote {info} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    res = {}
    for n in args.concurrency:
        res[n] = run_one(args, model, n)
        print(f"  llama.cpp N={n}: {res[n]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    print(header(prov))
    print(f"llama.cpp ({commit}), {args.spec} ({args.dtype}, random weights), prompt {args.prompt_len}, "
          f"output {args.output_len} tokens, {args.repeats} repeats after one warm-up, one process per N\n")
    print(table(res))
    print(f"\ncommand per N: {res[args.concurrency[0]]['command']} (-npl: N, warm-up first)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"provenance": prov, "args": vars(args), "model": model,
                       "results": {str(n): r for n, r in res.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
