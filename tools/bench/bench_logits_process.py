"""What the batched logit processing (slipstream/runtime/sampling/logits_process.py) costs per sampling group.

    python tools/bench/bench_logits_process.py              # CPU, V = 49,152 (SmolLM2), n = 1, 8, 32
    python tools/bench/bench_logits_process.py --device cuda --vocab 152064 --rows 1 32 256

Times each step alone and the whole of process_logits (penalties + min_tokens + min_p, every row
active), beside sampler.sample (the work a group does today), on random logits. Warm-up, then
`--repeats` timed calls per cell; median, mean and p90 in microseconds. A neutral group launches
none of it (ProcessFlags), so these are the costs of groups that ask.
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
from provenance import header  # noqa: E402

from slipstream.runtime.sampling.logits_process import (ProcessFlags, apply_penalties, min_p_filter, process_logits,  # noqa: E402
                                                        suppress_stop_tokens, top_logprobs)
from slipstream.runtime.step.row_tables import HistoryTables  # noqa: E402
from slipstream.runtime.sampling.sampler import sample  # noqa: E402
from slipstream.runtime.sampling.sampling_args import Draw, SamplingArgs  # noqa: E402


def _time(fn, device: torch.device, repeats: int) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _cells(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"{statistics.median(xs) * 1e6:.0f} | {statistics.mean(xs) * 1e6:.0f} | {p90 * 1e6:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    device = torch.device(args.device)
    print(header(" ".join(["python", *sys.argv])))
    print(f"\nV = {args.vocab}, device {device}, torch threads {torch.get_num_threads()}, "
          f"{args.repeats} timed calls per cell; microseconds per call\n")
    print("| rows | step | median | mean | p90 |\n|---|---|---|---|---|")
    for n in args.rows:
        g = torch.Generator(device=device).manual_seed(n)
        logits = torch.randn(n, args.vocab, generator=g, device=device) * 3
        tables = HistoryTables(n, args.vocab, device)
        hist = torch.randint(0, args.vocab, (n, 64), generator=g, device=device).tolist()
        tables.admit(list(range(n)), hist, [h[:32] for h in hist], [[0, 1]] * n)
        rows = torch.arange(n, device=device)
        counts, prompt_mask, stop_mask = tables.gather(rows)
        full = lambda v: torch.full((n,), v, device=device)  # noqa: E731
        temperature = full(0.8)
        seeds, index = torch.arange(n, device=device), torch.zeros(n, dtype=torch.int64, device=device)
        every = ProcessFlags(True, True, True, 0)
        cases = {
            "sample (today)": lambda: sample(logits, SamplingArgs(index, draw=Draw(temperature, seeds, None))),
            "apply_penalties": lambda: apply_penalties(logits, counts, prompt_mask, full(0.5), full(0.3), full(1.2)),
            "suppress_stop_tokens": lambda: suppress_stop_tokens(logits, stop_mask, index, full(4)),
            "min_p_filter": lambda: min_p_filter(logits, temperature, full(0.05)),
            "process_logits (all)": lambda: process_logits(logits, every, counts, prompt_mask, stop_mask, full(0.5),
                                                           full(0.3), full(1.2), index, full(4), temperature,
                                                           full(0.05)),
            "gather tables": lambda: tables.gather(rows),
            "record (after sampling)": lambda: tables.record(rows, index),
            "top_logprobs k=5": lambda: top_logprobs(logits, 5),
        }
        for name, fn in cases.items():
            print(f"| {n} | {name} | {_cells(_time(fn, device, args.repeats))} |")


if __name__ == "__main__":
    main()
