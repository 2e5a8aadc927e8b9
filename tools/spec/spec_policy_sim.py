"""How many drafts a CPU speculating step should feed for an n-gram proposal of each strength,
simulated offline from greedy outputs.

    python tools/spec/spec_policy_sim.py [--outputs docs/results/spec-2026-11-27/greedy_outputs.json]
        [--costs 1:6.0,2:6.71,3:7.68,5:10.79] [--row-ms 0.25] [--out FILE]

Each saved output is replayed as a batch-1 speculative decode would run it (the real NgramDrafter,
n = 1..3, window 1024, up to 4 drafts): at every step the proposal's strength s (its matched length,
0: none) picks the drafts fed, `map[s]`, the step accepts the longest prefix of them equal to the
greedy output and emits one more. The predicted speedup is the forward's cost of plain decoding over
the speculating steps' (the cost by positions, linear between the given points, plus `--row-ms` for
a step that feeds drafts): host work is left out, so the figures are upper bounds that rank the maps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import torch  # noqa: E402
from bench_lines import emit, report  # noqa: E402

from slipstream.speculation.ngram_drafter import NgramDrafter  # noqa: E402
from slipstream.speculation.history import TokenHistory  # noqa: E402

MAPS = {"0/1/4/4": (0, 1, 4, 4), "0/1/2/4": (0, 1, 2, 4), "0/0/2/4": (0, 0, 2, 4), "0/0/1/4": (0, 0, 1, 4),
        "0/0/0/4": (0, 0, 0, 4), "0/1/2/2": (0, 1, 2, 2)}


def cost_at(costs: dict[int, float], q: int) -> float:
    pts = sorted(costs)
    for q0, q1 in zip(pts, pts[1:]):
        if q <= q1:
            return costs[q0] + (costs[q1] - costs[q0]) * (q - q0) / (q1 - q0)
    return costs[pts[-1]]


def replay(prompt: list[int], output: list[int], feed: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """[(strength, fed, accepted)] per step after the prefill's token."""
    tokens = prompt + output
    history = TokenHistory(2, len(tokens) + 16)
    row = torch.tensor([1])
    t = torch.tensor(tokens[:len(prompt) + 1])
    history.write_chunks(torch.ones_like(t), torch.arange(len(t)), t, row, torch.tensor([len(t)]))
    drafter = NgramDrafter(history, max_drafts=4, min_n=1, max_n=3, window=1024)
    done, steps = 1, []
    while done < len(output):
        p = drafter.propose(row)
        s, drafts = int(p.strength[0]), p.tokens[0].tolist()
        k = min(feed[s], len(output) - done - 1)
        a = 0
        while a < k and drafts[a] == output[done + a]:
            a += 1
        steps.append((s, k, a))
        new = torch.tensor(output[done:done + a + 1])
        history.append(row, new[None, :], torch.tensor([len(new)]))
        done += a + 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=Path, default=Path("docs/results/spec-2026-11-27/greedy_outputs.json"))
    ap.add_argument("--costs", default="1:6.0,2:6.71,3:7.68,5:10.79",
                    help="forward ms by positions (slipstream/speculation/policy.py FORWARD_MS)")
    ap.add_argument("--row-ms", type=float, default=0.25)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    data = json.loads(args.outputs.read_text())
    costs = {int(q): float(ms) for q, ms in (c.split(":") for c in args.costs.split(","))}

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"\noutputs {args.outputs}; forward ms by positions {costs}; row {args.row_ms} ms per "
                    "speculating step; map: drafts fed at strength 0/1/2/3")
        emit(lines, "\n| workload | repeats its input | " + " | ".join(f"map {m}" for m in MAPS) + " |")
        emit(lines, "|---|---|" + "---:|" * len(MAPS))
        for name, d in data.items():
            cells = []
            for feed in MAPS.values():
                steps = replay(d["prompt"], d["output"], feed)
                spec = sum(cost_at(costs, k + 1) + (args.row_ms if k else 0.0) for _, k, _ in steps)
                tps = (len(d["output"]) - 1) / len(steps)
                cells.append(f"{(len(d['output']) - 1) * costs[1] / spec:.2f} ({tps:.2f} tok/step)")
            emit(lines, f"| {name} | {'yes' if d['repetitive'] else 'no'} | " + " | ".join(cells) + " |")
        emit(lines, "\npredicted speedup of the forward's cost (tokens per step in brackets)")
        return lines

    report(body, args.out)


if __name__ == "__main__":
    main()
