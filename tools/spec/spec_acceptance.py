"""How often n-gram drafts would be accepted, simulated offline from greedy outputs, and the speedup
that predicts.

    python tools/spec/spec_acceptance.py --generate OUT.json [--max-tokens 192]   # greedy outputs, default model
    python tools/spec/spec_acceptance.py --outputs OUT.json --costs 1:22.0,3:24.1,5:26.3,9:30.9 \
        [--draft-ms 0.3] [--verify-ms 0.3]

Generation runs the workloads of tools/spec/spec_workloads.py through the engine (greedy, EngineConfig()
defaults) and saves prompt and output token ids. The simulation replays each output as a batch-1
speculative decode would run it: the first output token comes from the prefill; then each step
feeds the last token and k drafts that the real NgramDrafter (slipstream/speculation/ngram_drafter.py)
proposes from the prompt and the output so far, accepts the longest prefix equal to the greedy
output (what replay acceptance does with greedy rows) and emits one more. Policies: a fixed k, and
`adaptive` (k chosen per step from an estimate of the per-draft acceptance α that lags one step,
as the host's does at depth 2; see `choose_k`).

With --costs (forward ms by positions q, from tools/spec/bench_verify_forward.py) the predicted speedup is
    (outputs - 1) * c(1)  /  sum over steps of (c(k + 1) + verify-ms if k else 0) + draft-ms * steps
i.e. the forward dominates; host work and sampling are taken as equal on both sides.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "common")]  # spec_workloads, the shared helpers

import torch  # noqa: E402
from bench_lines import emit, report  # noqa: E402
from spec_workloads import WORKLOADS  # noqa: E402

from slipstream.speculation.ngram_drafter import NgramDrafter  # noqa: E402
from slipstream.speculation.history import TokenHistory  # noqa: E402

KS = (2, 4, 8)


def generate(path: Path, max_tokens: int) -> None:
    from slipstream import LLM, EngineConfig, SamplingParams

    names = list(WORKLOADS)
    with LLM(EngineConfig()) as llm:
        outs = llm.chat([[{"role": "user", "content": WORKLOADS[n][1]}] for n in names],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens))
    data = {n: {"repetitive": WORKLOADS[n][0], "prompt": o.prompt_token_ids, "output": o.token_ids, "text": o.text}
            for n, o in zip(names, outs)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits with k drafts when each is accepted with probability alpha after the last."""
    return float(sum(alpha ** i for i in range(k + 1)))


def choose_k(alpha: float, cost: dict[int, float], margin: float = 0.05) -> int:
    """The k that maximises expected tokens per forward cost; 0 unless it beats plain decoding by margin."""
    best, rate = 0, 1.0 / cost[1]
    for k in KS:
        if k + 1 in cost and expected_tokens(alpha, k) / cost[k + 1] > rate * (1 + margin):
            rate, best = expected_tokens(alpha, k) / cost[k + 1], k
    return best if best else 0


def simulate(prompt: list[int], output: list[int], policy, min_n: int, max_n: int, window: int):
    """[(k, accepted, matched)] per step after the prefill's token; `policy(alpha) -> k`."""
    tokens = prompt + output
    history = TokenHistory(2, len(tokens) + 16)
    row = torch.tensor([1])
    t = torch.tensor(tokens[:len(prompt) + 1])
    history.write_chunks(torch.ones_like(t), torch.arange(len(t)), t, row, torch.tensor([len(t)]))
    drafter = NgramDrafter(history, max_drafts=max(KS), min_n=min_n, max_n=max_n, window=window)
    done, steps = 1, []
    hits, misses = 1.0, 1.0  # the host's estimate of alpha, from shadow acceptance (lagging a step)
    lag: tuple[int, int] | None = None
    while done < len(output):
        k = policy(hits / (hits + misses))
        p = drafter.propose(row)
        drafts = p.tokens[0].tolist()
        truth = output[done:done + max(KS)]
        shadow = 0
        while shadow < len(truth) and drafts[shadow] == truth[shadow]:
            shadow += 1
        a = min(shadow, k, len(output) - done - 1)
        steps.append((k, a, bool(p.matched.item())))
        if lag is not None:
            hits, misses = 0.7 * hits + lag[0], 0.7 * misses + lag[1]
        lag = (shadow, int(shadow < len(truth)))  # what the host learns at this step's commit
        new = torch.tensor(output[done:done + a + 1])
        history.append(row, new[None, :], torch.tensor([len(new)]))
        done += a + 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generate", type=Path, help="run the workloads and save the greedy outputs here")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--outputs", type=Path, help="simulate from these saved outputs")
    ap.add_argument("--costs", default="", help="forward ms by positions, e.g. 1:22.0,3:24.1,5:26.3,9:30.9")
    ap.add_argument("--draft-ms", type=float, default=0.0, help="drafting cost per step (every step)")
    ap.add_argument("--verify-ms", type=float, default=0.0, help="verification cost per speculating step")
    ap.add_argument("--ngram", default="1-3,2-4", help="min-max n pairs to compare")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.generate:
        generate(args.generate, args.max_tokens)
        print(f"wrote {args.generate}")
        return
    data = json.loads(args.outputs.read_text())
    cost = {int(q): float(ms) for q, ms in (c.split(":") for c in args.costs.split(",") if c)}
    ngrams = [tuple(int(x) for x in pair.split("-")) for pair in args.ngram.split(",")]

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"\noutputs: {args.outputs}; window {args.window}; forward ms by positions: {cost or 'not given'}; "
                    f"draft {args.draft_ms} ms/step, verify {args.verify_ms} ms/speculating step\n")
        emit(lines, "| workload | repetitive | outputs | n-gram | policy | steps | tokens / step | drafter matched "
                    "| accepted / draft | predicted speedup |")
        emit(lines, "|---|---|---:|---|---|---:|---:|---:|---:|---:|")
        for name, d in data.items():
            out = d["output"]
            for lo, hi in ngrams:
                policies = {f"k={k}": (lambda a, k=k: k) for k in KS}
                if cost:
                    policies["adaptive"] = lambda a: choose_k(a, cost)
                for label, policy in policies.items():
                    steps = simulate(d["prompt"], out, policy, lo, hi, args.window)
                    drafted = sum(k for k, _, _ in steps)
                    accepted = sum(a for _, a, _ in steps)
                    matched = sum(m for _, _, m in steps) / max(len(steps), 1)
                    speed = "-"
                    if cost and all(k + 1 in cost for k, _, _ in steps):
                        spec = sum(cost[k + 1] + (args.verify_ms if k else 0.0) for k, _, _ in steps)
                        spec += args.draft_ms * len(steps)
                        speed = f"{(len(out) - 1) * cost[1] / spec:.2f}"
                    emit(lines, f"| {name} | {'yes' if d['repetitive'] else 'no'} | {len(out)} | {lo}-{hi} | {label} | "
                                f"{len(steps)} | {(len(out) - 1) / max(len(steps), 1):.2f} | {matched:.2f} | "
                                f"{accepted / max(drafted, 1):.2f} | {speed} |")
        return lines

    report(body, args.out)


if __name__ == "__main__":
    main()
