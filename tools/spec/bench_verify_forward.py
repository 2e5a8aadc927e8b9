"""What verifying k drafts costs the forward: one sequence's step over k + 1 positions vs over 1.

    python tools/spec/bench_verify_forward.py [--model smollm2-135m] [--contexts 128 512] [--positions 1 2 3 5 9]
    python tools/spec/bench_verify_forward.py --weights quantized --baseline main   # kernels: main's vs this checkout's

The default model on the CPU fast path (oneDNN-packed projections), one intra-op thread as the
engine's compute stream runs on a 2-core machine. Each sequence has --context tokens in the paged
KV cache (random K/V) and feeds q positions after them; logits come back for every position (what
verification reads) and, for comparison, for the last only (what a prefill chunk reads). Cases
interleave within each repeat; CPU time of the thread (thread_time) and wall time, in ms. With --baseline
REF, the compiled CPU kernels as REF's sources build them run each case too (interleaved): a kernel
change against its base in one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import torch  # noqa: E402
from bench_lines import emit, pct, report  # noqa: E402
from host_batch import Chunk, host_batch  # noqa: E402

import slipstream.models.llama.forward_cpu as forward_cpu  # noqa: E402
from slipstream.models.kernels.cpu_kernels import native_kernels  # noqa: E402
from slipstream.models.loading.build import build_model  # noqa: E402
from slipstream.models.base import KVCache  # noqa: E402

PAGE = 16


def batch_for(q: int, context: int, all_logits: bool, batch: int):
    pages = -(-(context + q) // PAGE)
    chunks = [Chunk(tokens=[100 + j for j in range(q)], start_pos=context,
                    pages=list(range(1 + i * pages, 1 + (i + 1) * pages))) for i in range(batch)]
    fb, _ = host_batch(chunks, PAGE)
    if all_logits:
        fb.sample_indices = torch.arange(q * batch)
    return fb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--positions", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--weights", default="dequantized", choices=["dequantized", "quantized"],
                    help="quantized: a GGUF's matrices kept quantized, on the compiled CPU kernels (the "
                         "engine's default since issue 39); dequantized: the packed fp32 path phase 1 measured")
    ap.add_argument("--activations", nargs="+", default=["float"], choices=["auto", "int8", "int16", "float"],
                    help="with --weights quantized: the CPU products' activations (EngineConfig.activations); "
                         "several: interleaved within each repeat, one table each")
    ap.add_argument("--baseline", default=None, help="git ref: its compiled CPU kernels run every case too")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _tok, config = build_model(args.model, "float32", torch.device("cpu"), pack=True, weights=args.weights)
    if args.weights == "quantized":
        model.set_kernel_backend("cpu")
    libs = {"this": native_kernels()}
    if args.baseline:
        from kernels_at import describe, library_at

        libs = {f"{args.baseline} {describe(args.baseline)}": library_at(args.baseline), **libs}

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"\nmodel={args.model} ({args.weights}) torch={torch.__version__} threads={torch.get_num_threads()} "
                    f"batch={args.batch} repeats={args.repeats}; ms per forward\n")
        emit(lines, "| kernels | activations | context | positions q | logits | CPU median | mean | p90 | wall median | "
                    "CPU / (q=1) | CPU / first kernels |")
        emit(lines, "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        modes = args.activations if args.weights == "quantized" else ["float"]
        for context in args.contexts:
            pages = 1 + args.batch * -(-(context + max(args.positions)) // PAGE)
            kv = KVCache(config, pages, PAGE, torch.float32, "cpu")
            kv.k.normal_()
            kv.v.normal_()
            cases = [(lib, mode, q, all_logits) for mode in modes for q in args.positions
                     for all_logits in ((True, False) if q > 1 else (True,)) for lib in libs]
            cpu: dict = {c: [] for c in cases}
            wall: dict = {c: [] for c in cases}
            for i in range(args.warmup + args.repeats):
                for c in cases:
                    forward_cpu.native_kernels = lambda lib=libs[c[0]]: lib  # what the forward calls
                    if args.weights == "quantized":
                        model.set_activations(c[1])
                    fb = batch_for(c[2], context, c[3], args.batch)
                    t0, w0 = time.thread_time(), time.perf_counter()
                    model(fb, kv)
                    if i >= args.warmup:
                        cpu[c].append((time.thread_time() - t0) * 1e3)
                        wall[c].append((time.perf_counter() - w0) * 1e3)
            for (lib, mode, q, all_logits), xs in cpu.items():
                base = statistics.median(cpu[(lib, mode, 1, True)])
                first = statistics.median(cpu[(next(iter(libs)), mode, q, all_logits)])
                emit(lines, f"| {lib} | {mode} | {context} | {q} | {'all' if all_logits else 'last'} | "
                            f"{statistics.median(xs):.2f} | {statistics.fmean(xs):.2f} | {pct(xs, 0.9):.2f} | "
                            f"{statistics.median(wall[(lib, mode, q, all_logits)]):.2f} | "
                            f"{statistics.median(xs) / base:.2f} | {statistics.median(xs) / first:.2f} |")
        return lines

    report(body, args.out)


if __name__ == "__main__":
    main()
