"""What the row ladder of the packed CPU linear costs (issue 37, item 6), interleaved per repeat, CPU
time of the calling thread. Table 1: SmolLM2-135M's projection shapes at row counts from 1 to 700,
once with the exact row count (one oneDNN primitive per count: main's PackedLinear.forward) and once
padded to the ladder (blocks of ROW_BLOCK). Table 2: whole forwards of SmolLM2-135M's architecture
(random weights): decode steps of N rows (context 128) and prefill chunks of N tokens, the same two
ways. `--primitive-memory` instead: the RSS a new row count adds (oneDNN's and ideep's cached
primitive for that shape), per projection shape, over 40 row counts not seen before.

    python tools/bench/bench_packed_rows.py --threads 1 --repeats 7 --out docs/results/inputs-2026-11-27/packed_rows.txt
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
from torch import nn  # noqa: E402
from bench_lines import emit, pct, report  # noqa: E402

from slipstream.models.kernels.cpu_linear import ROW_BLOCK, PackedLinear, padded_rows  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # q/o, k/v, gate/up, down (out, in)
ROWS = [1, 3, 8, 9, 16, 17, 23, 33, 47, 65, 100, 129, 200, 257, 300, 512, 513, 700]


def exact(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """main's PackedLinear.forward (99596d0), called as a module like the new one."""
    return nn.Module.__call__(layer, x, _exact=True)


class Both(PackedLinear):
    def forward(self, x: torch.Tensor, _exact: bool = False) -> torch.Tensor:
        if _exact or self.__dict__.get("_exact"):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return super().forward(x)


def cpu_ms(fn, layers, xs, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        for layer, x in zip(layers, xs):
            fn(layer, x)
    return (time.thread_time() - t0) / calls * 1e3


def forward_table(args, lines: list[str]) -> None:
    from host_batch import Chunk, host_batch

    from slipstream.models.loading.build import build_model
    from slipstream.models.base import KVCache

    model, _, config = build_model("random-smollm2-135m", "float32", torch.device("cpu"), pack=True)[:3]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for m in packed:
        m.__class__ = Both  # the same layers, either forward
    page, ctx = 16, 128
    emit(lines, "")
    emit(lines, "Whole forward (random-smollm2-135m), ms of CPU per forward")
    emit(lines, "")
    emit(lines, "| step | rows | exact median | ladder median | ladder / exact median | mean | p90 |")
    emit(lines, "|---|---:|---:|---:|---:|---:|---:|")
    for kind, n in [("decode", b) for b in (1, 8, 9, 16, 17, 24, 32)] + [("prefill", t) for t in (100, 129, 300, 512)]:
        per = -(-(ctx + 1) // page) if kind == "decode" else -(-n // page)
        count = n if kind == "decode" else 1
        kv = KVCache(config, 1 + count * per, page, torch.float32, "cpu")
        pages = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(count)]
        chunks = ([Chunk([100 + i], ctx, pages[i]) for i in range(n)] if kind == "decode"
                  else [Chunk(list(range(5, 5 + n)), 0, pages[0])])
        fb, _ = host_batch(chunks, page)

        def run(exact: bool) -> float:
            for m in packed:
                m._exact = exact
            fb.attn.cpu_plan = None
            t0 = time.thread_time()
            model(fb, kv)
            return (time.thread_time() - t0) * 1e3

        run(True), run(False)
        a, b = [], []
        for _ in range(args.repeats):
            a.append(run(True))
            b.append(run(False))
        ratios = [y / x for x, y in zip(a, b)]
        emit(lines, f"| {kind} | {n} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
                    f"{statistics.median(ratios):.3f} | {statistics.mean(ratios):.3f} | {pct(ratios, 0.9):.3f} |")


def primitive_memory(lines: list[str]) -> None:
    from bench_lines import rss_mb

    emit(lines, "| weight (out x in) | KB of RSS per new row count (40 counts, exact calls) |")
    emit(lines, "|---|---:|")
    for o, i in SHAPES + [(49152, 576), (64, 64)]:
        layer = Both(torch.randn(o, i))
        x = torch.randn(64, i)
        exact(layer, x[:1])
        before = rss_mb()
        for m in range(2, 42):
            exact(layer, x[:m].contiguous())
        emit(lines, f"| {o} x {i} | {(rss_mb() - before) * 1024 / 40:.0f} |")


def body(args) -> list[str]:
    lines: list[str] = []
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.primitive_memory:
        primitive_memory(lines)
        return lines
    layers = [Both(torch.randn(o, i)) for o, i in SHAPES]
    emit(lines, f"threads {args.threads}, repeats {args.repeats}; ms of CPU per pass over the 4 shapes")
    emit(lines, "")
    emit(lines, "| rows | padded to | exact median | ladder median | ladder / exact median | mean | p90 |")
    emit(lines, "|---:|---:|---:|---:|---:|---:|---:|")
    for m in ROWS:
        xs = [torch.randn(m, i) for _, i in SHAPES]
        calls = max(2, 200 // m)
        for fn in (exact, nn.Module.__call__):  # primitives created outside the timing
            cpu_ms(fn, layers, xs, 1)
        a, b = [], []
        for _ in range(args.repeats):  # A/B interleaved
            a.append(cpu_ms(exact, layers, xs, calls))
            b.append(cpu_ms(nn.Module.__call__, layers, xs, calls))
        ratios = [y / x for x, y in zip(a, b)]
        blocks = f"{m // ROW_BLOCK}x{ROW_BLOCK}+{padded_rows(m % ROW_BLOCK)}" if m > ROW_BLOCK else str(padded_rows(m))
        emit(lines, f"| {m} | {blocks} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | "
                    f"{statistics.median(ratios):.3f} | {statistics.mean(ratios):.3f} | {pct(ratios, 0.9):.3f} |")
    if not args.no_forward:
        forward_table(args, lines)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-forward", action="store_true", help="only the projections' table")
    ap.add_argument("--primitive-memory", action="store_true", help="only the RSS a new row count adds")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    report(lambda: body(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
