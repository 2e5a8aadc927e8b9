"""Decode paged attention on a GPU: the per-head kernel before issue 42 against the grouped one (with
split-KV), per batch and context, beside the memory floor, in one run.

    python tools/gpu/bench_attention_cuda.py [--out docs/results/kernels-2026-11-27/attention_h100.md]

Shapes are random-smollm2-135m's (9 query heads, 3 kv heads, head_dim 64, bf16), page size 16, every
sequence decoding one token over `ctx` keys. The page table is `--table-keys` wide, as a decode
graph's is (the arena's pages per sequence, not the step's), which is what the split count sees.
Each case holds `copies` layers' K/V caches (different memory, as a model step's 30 layers are; up to
30 and about 4 GB), captures one CUDA graph per kernel that runs attention once on each, and times
replays with CUDA events; old and new replays are interleaved (A/B/A/B) after warm-up. Times are
per layer (one launch, plus the merge launch where the grouped kernel splits). The floor reads K and
V of every sequence once (q and out: < 3% more) at --bandwidth; "L2" marks cases whose copies fit
in the H100's 50 MB L2 together, where a replay may read from L2 rather than HBM. "max |Δ|" is the
largest difference between the old kernel's outputs and the new ones' (bf16: a few units of 2^-8
at most). "new-n64": the grouped kernel with 64-key, 4-warp decode tiles (the default takes 128 keys
with 8 warps; both are spill-free on sm_90), to choose between them; "new-1": the grouped kernel
never split (one launch, no merge), to see where splitting pays and what the merge launch costs
where it does not.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools" / "common"), str(ROOT)]

import torch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
L2_BYTES = 50e6


def make_case(batch: int, ctx: int, table_keys: int, copies: int, gen: torch.Generator, dev: str = "cuda"):
    """q, out, `copies` (k, v) caches and the metadata of `batch` decodes over `ctx` keys."""
    pages_per_seq = -(-ctx // PAGE)
    width = max(pages_per_seq, -(-table_keys // PAGE))
    n_pages = batch * pages_per_seq + 1
    perm = torch.randperm(n_pages - 1, generator=gen) + 1  # page 0: never any sequence's
    table = torch.zeros(batch, width, dtype=torch.int32)
    table[:, :pages_per_seq] = perm.view(batch, pages_per_seq)
    caches = []
    for _ in range(copies):
        k = torch.empty(n_pages * PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev).normal_()
        caches.append((k, torch.empty_like(k).normal_()))
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
    meta = (torch.arange(batch + 1, dtype=torch.int32, device=dev),
            torch.full((batch,), ctx, dtype=torch.int32, device=dev), table.to(dev))
    return q, caches, meta


def graph_of(variant: str, q, caches, meta, out):
    """A graph of one attention launch per cache copy; `variant`: old, new, new-n64 (the grouped
    kernel with 64-key, 4-warp decode tiles: the other spill-free choice on sm_90) or new-1 (never
    split: no merge launch)."""
    from slipstream.models.kernels import attention_triton as at

    impl = "per_head" if variant == "old" else "grouped"
    tiles = at.tiles

    def n64(group, head_dim, dtype, decode):
        return dict(tiles(group, head_dim, dtype, decode), **(dict(BLOCK_N=64, num_warps=4) if decode else {}))

    splits = 1 if variant == "new-1" else None

    def step():
        for k, v in caches:
            at.paged_attention_triton(q, k, v, *meta, PAGE, 1, out, impl=impl, splits=splits)

    at.tiles = n64 if variant == "new-n64" else tiles
    try:
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    finally:
        at.tiles = tiles
    return graph


def time_replays(graphs: dict, repeats: int, per_replay: int) -> dict:
    """µs per layer of each graph: replays interleaved across graphs, 3 warm-ups."""
    times: dict = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rep in range(repeats + 3):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if rep >= 3:
                times[name].append(start.elapsed_time(end) * 1e3 / per_replay)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--table-keys", type=int, default=8192, help="page-table width in keys (SmolLM2: 8,192)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--bandwidth", type=float, default=2.75e12, help="bytes/s of the floor (H100 copy)")
    ap.add_argument("--cache-budget", type=float, default=4e9, help="bytes of K/V copies per case")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    from bench_lines import emit, pct, report

    from slipstream.models.kernels.attention_triton import MIN_SPLIT, decode_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"{torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__} (CUDA {torch.version.cuda}), "
                    f"bf16, {HEADS} q heads / {KV_HEADS} kv heads / head_dim {HEAD_DIM}, page {PAGE}, table "
                    f"{args.table_keys} keys, MIN_SPLIT {MIN_SPLIT}; µs per layer, {args.repeats} replays each\n")
        emit(lines, "| batch | ctx | K/V MB | floor µs | copies | splits | old median | old p90 | new median | new mean "
                    "| new p90 | new-n64 median | new-1 median | old ÷ new | new ÷ floor | max \\|Δ\\| |")
        emit(lines, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        gen = torch.Generator().manual_seed(0)
        for batch in args.batches:
            for ctx in args.contexts:
                kv_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
                floor = kv_bytes / args.bandwidth * 1e6
                copies = int(max(1, min(30, args.cache_budget // kv_bytes)))
                q, caches, meta = make_case(batch, ctx, args.table_keys, copies, gen)
                outs = {name: torch.zeros_like(q) for name in ("old", "new", "new-n64", "new-1")}
                graphs = {name: graph_of(name, q, caches, meta, outs[name]) for name in outs}
                t = time_replays(graphs, args.repeats, copies)
                old, new = statistics.median(t["old"]), statistics.median(t["new"])
                diff = max((outs["old"].float() - outs[name].float()).abs().max().item() for name in outs)
                splits = decode_splits(batch, KV_HEADS, meta[2].shape[1] * PAGE, sms)
                l2 = " (L2)" if copies * kv_bytes < L2_BYTES else ""
                emit(lines, f"| {batch} | {ctx} | {kv_bytes / 1e6:.2f} | {floor:.2f} | {copies}{l2} | {splits} | "
                            f"{old:.2f} | {pct(t['old'], 0.9):.2f} | {new:.2f} | "
                            f"{statistics.fmean(t['new']):.2f} | {pct(t['new'], 0.9):.2f} | "
                            f"{statistics.median(t['new-n64']):.2f} | {statistics.median(t['new-1']):.2f} | "
                            f"{old / new:.2f} | {new / floor:.1f} | {diff:.3g} |")
                del q, caches, meta, outs, graphs
                torch.cuda.empty_cache()
        return lines

    report(body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
