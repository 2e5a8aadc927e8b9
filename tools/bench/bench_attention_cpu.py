"""The CPU paged attention kernel alone (sq_attention), this checkout's against another commit's.

    python tools/bench/bench_attention_cpu.py [--baseline main] [--out FILE]

SmolLM2-135M's shape (9 query heads over 3 kv heads, head dim 64, page size 16) on random q, K, V. One
"forward" is 30 calls, one per layer, each over its own KV cache, as a forward's layers make them; with
the default, a 64 MB buffer is read before each forward (untimed), since in the real forward the
layers' weights (read-only) stream through the caches between attention calls; --warm skips that. Cases: a speculating sequence's
q = 1..9 query positions after a context, 8 decode rows, and prefill chunks. Old and new alternate
within each repeat; CPU time of the thread (thread_time), ms per forward; median, mean, p90.
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
from kernels_at import describe, library_at  # noqa: E402

from slipstream.models.kernels.cpu_kernels import native_kernels  # noqa: E402

HQ, HK, D, PAGE, LAYERS = 9, 3, 64, 16, 30


def attention_call(lib):
    """sq_attention without a window: ABI 4 added the window argument (0: none) before `out` (on main;
    ABI 3 was checked allocations); an older commit's library takes the call without it."""
    if lib.sq_abi_version() >= 4:
        return lambda *args: lib.sq_attention(*args[:-1], 0, args[-1])
    fn = lib.sq_attention
    fn.argtypes = fn.argtypes[:14] + fn.argtypes[15:]
    return fn


class Case:
    """seqs: (context before the step, query positions) per sequence."""

    def __init__(self, name: str, seqs: list[tuple[int, int]]):
        self.name = name
        lens = [c + q for c, q in seqs]
        width = max(-(-n // PAGE) for n in lens)
        self.table = torch.tensor([[1 + s * width + p for p in range(width)] for s in range(len(seqs))])
        slots = (1 + len(seqs) * width) * PAGE
        self.k = [torch.randn(slots, HK, D) for _ in range(LAYERS)]
        self.v = [torch.randn(slots, HK, D) for _ in range(LAYERS)]
        t = sum(q for _, q in seqs)
        self.q = torch.randn(t, HQ * D)
        self.out = torch.empty(t, HQ * D)
        self.qs = torch.tensor([0] + [sum(q for _, q in seqs[:i + 1]) for i in range(len(seqs))])
        self.lens = torch.tensor(lens)
        self.pairs = sum(q * (c + (q + 1) / 2) for c, q in seqs) * HQ  # (row, key) scores per layer

    def forward(self, lib) -> None:
        for layer in range(LAYERS):
            rc = attention_call(lib)(self.q.data_ptr(), HQ * D, self.k[layer].data_ptr(), self.v[layer].data_ptr(),
                                  self.qs.data_ptr(), self.lens.data_ptr(), self.table.data_ptr(),
                                  self.table.shape[1], PAGE, len(self.lens), HQ, HK, D, D ** -0.5,
                                  self.out.data_ptr())
            assert rc == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="main", help="git ref whose kernels are the 'old' side")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--positions", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    ap.add_argument("--prefill", type=int, nargs="+", default=[64, 256, 512], help="chunk lengths (from 0)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm", action="store_true", help="do not read a 64 MB buffer between forwards")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {f"old ({args.baseline} {describe(args.baseline)})": library_at(args.baseline), "new": native_kernels()}
    torch.manual_seed(0)
    cases = [Case(f"verify q={q} ctx={args.context}", [(args.context, q)]) for q in args.positions]
    cases.append(Case(f"decode 8 seqs ctx={args.context}", [(args.context, 1)] * 8))
    cases += [Case(f"prefill chunk {n}", [(0, n)]) for n in args.prefill]
    sweep = None if args.warm else torch.zeros(16 << 20)

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"\nshape Hq={HQ} Hk={HK} D={D} page={PAGE}, {LAYERS} layers per forward, threads="
                    f"{torch.get_num_threads()}, caches {'warm' if args.warm else 'swept'}, repeats={args.repeats}; "
                    "CPU ms per forward (30 calls)\n")
        emit(lines, "| case | kernels | CPU median | mean | p90 | ns per (row, key) | new / old |")
        emit(lines, "|---|---|---:|---:|---:|---:|---:|")
        times = {(c.name, name): [] for c in cases for name in libs}
        for i in range(args.warmup + args.repeats):
            for c in cases:
                for name, lib in libs.items():
                    if sweep is not None:
                        float(sweep.sum())
                    t0 = time.thread_time()
                    c.forward(lib)
                    if i >= args.warmup:
                        times[(c.name, name)].append((time.thread_time() - t0) * 1e3)
        for c in cases:
            old = statistics.median(times[(c.name, next(iter(libs)))])
            for name in libs:
                xs = times[(c.name, name)]
                med = statistics.median(xs)
                emit(lines, f"| {c.name} | {name} | {med:.3f} | {statistics.fmean(xs):.3f} | {pct(xs, 0.9):.3f} | "
                            f"{med * 1e6 / LAYERS / c.pairs:.2f} | {med / old:.2f} |")
        return lines

    report(body, args.out)


if __name__ == "__main__":
    main()
