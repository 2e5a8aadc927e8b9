"""What speculation's device kernels cost per step: n-gram proposal, history, verification, acceptance.

    python tools/spec/bench_spec_kernels.py [--vocab 49152] [--batches 1 8 32] [--drafts 2 4 8] [--out FILE]
    python tools/spec/bench_spec_kernels.py --device cuda --batches 1 8 32 128

For each batch n and draft count k (every row speculating, V = SmolLM2's 49,152 by default), on
random logits, CPU time (user + system) of one thread per call, in microseconds (torch runs one
intra-op thread, as the engine's compute stream does on a 2-core machine):

  sample (today)       sampler.sample_group over n rows: what a non-speculative step samples
  verify               verify_inputs + target_tokens over n(k + 1) positions + replay_accept
  verify point         rejection_accept of point drafts (one row of noise per row, not per position)
  draft                TokenHistory.append of the emitted tokens + NgramDrafter.propose (window 1024)
  spec phase           verify then draft: what a speculating step samples instead of `sample`
  rejection            rejection_accept with draft distributions [n, k, V] (a sampled draft model)

each for greedy rows and for random rows (temperature 0.8, seeded). Cases take turns within a
round, so a load change hits them alike (`measure`); median, mean and p90.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_lines import emit, pct, report  # noqa: E402

from slipstream.speculation.ngram_drafter import NgramDrafter  # noqa: E402
from slipstream.runtime.sampling.sampler import sample_group  # noqa: E402
from slipstream.runtime.sampling.sampling_args import Draw, SamplingArgs  # noqa: E402
from slipstream.speculation.verify import (rejection_accept, replay_accept, spec_layout, target_tokens,  # noqa: E402
                                           verify_inputs)
from slipstream.speculation.history import TokenHistory  # noqa: E402


def cases(n: int, k: int, vocab: int, random: bool, window: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(n * 100 + k)
    lay = spec_layout(np.full(n, k), device)
    p = n * (k + 1)
    logits = (torch.randn(p, vocab, generator=g) * 3).to(device)
    drafts = torch.randint(0, vocab, (n, k), generator=g).to(device)
    q = torch.rand(n, k, vocab, generator=g)
    q = (q / q.sum(-1, keepdim=True)).to(device)
    out = torch.zeros(n, dtype=torch.int64, device=device)
    seeds, temperature = torch.arange(n, device=device), torch.full((n,), 0.8, device=device)
    args = SamplingArgs(out, draw=Draw(temperature, seeds, None)) if random else SamplingArgs(out)
    rows = torch.arange(1, n + 1, device=device)
    history = TokenHistory(n + 1, 4096, device)
    known = torch.randint(0, 500, (n, 1500), generator=g).to(device)  # a 1500-token context per row, small alphabet
    history.write_chunks(rows.repeat_interleave(1500), torch.arange(1500, device=device).repeat(n), known.reshape(-1),
                         rows, torch.full((n,), 1500, device=device))
    drafter = NgramDrafter(history, max_drafts=k, window=window)
    last = torch.randint(0, vocab, (n,), generator=g).to(device)

    def verify():
        verify_inputs(last, drafts, lay)
        return replay_accept(target_tokens(logits, args, drafts, lay), drafts, lay)

    def draft():
        v = verdict
        history.append(rows, v.tokens, v.accepted + 1)
        history.length[rows] = 1500  # (keep the context length fixed across repeats)
        return drafter.propose(rows)

    def phase():
        verify()
        draft()

    verdict = verify()
    return {"sample (today)": lambda: sample_group(logits[:n], args), "verify": verify,
            "verify point": lambda: rejection_accept(logits, args, drafts, None, lay), "draft": draft,
            "spec phase": phase, "rejection": lambda: rejection_accept(logits, args, drafts, q, lay)}


def measure(fns: dict, rounds: int, device: torch.device, block: int = 4) -> dict[str, list[float]]:
    """Each case `block` times in a row (after one untimed call), the cases in turn, `rounds` times: a
    small kernel timed right behind a large one is charged the kernel's freeing of the large one's
    memory (system time), so each case is timed behind itself; "spec phase" is timed whole. On the
    CPU, the thread's CPU time; on CUDA, wall time to a synchronize."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(block):
                if cuda:
                    torch.cuda.synchronize()
                t0 = clock()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                times[name].append((clock() - t0) * 1e6)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (wall time to a synchronize)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of 4 timed calls per case")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)

    def body() -> list[str]:
        lines: list[str] = []
        what = "wall microseconds per call to a synchronize" if device.type == "cuda" else \
            "CPU microseconds per call (thread_time)"
        emit(lines, f"\nV = {args.vocab}, n-gram window {args.window}, device {device}, torch threads "
                    f"{torch.get_num_threads()}, {4 * args.rounds} timed calls per cell; {what}\n")
        emit(lines, "| rows | k | rows sample | case | median | mean | p90 |")
        emit(lines, "|---:|---:|---|---|---:|---:|---:|")
        for n in args.batches:
            for k in args.drafts:
                for random in (False, True):
                    times = measure(cases(n, k, args.vocab, random, args.window, device), args.rounds, device)
                    for name, xs in times.items():
                        emit(lines, f"| {n} | {k} | {'random' if random else 'greedy'} | {name} | "
                                    f"{statistics.median(xs):.0f} | {statistics.fmean(xs):.0f} | {pct(xs, 0.9):.0f} |")
        return lines

    report(body, args.out)


if __name__ == "__main__":
    main()
