"""LoRA's cost on the CPU (issue 51, must-show 3): N streams spread over K random adapters vs N
streams on the base model, one engine, rounds interleaved (base, adapters, base, ...) so a load
change on a shared machine hits both alike.

    python tools/bench/bench_lora.py               # 32 streams, 8 adapters of rank 16, all seven targets
    python tools/bench/bench_lora.py --out docs/results/FILE.md

Prints a table (per-stream decode tokens/s: median, mean, p90; the round's aggregate tokens/s; the
ratio adapters / base of the medians) after a provenance header (command, commit and dirty flag,
machine, load average, versions, date); --out writes the same text there. The adapters are random
PEFT folders of the model's shapes (values ~N(0, 0.02)), written to a temporary folder. The base
rounds run with the adapters loaded but unused (each forward then counts the slots once: the cost
an engine serving adapters pays on base rows).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int) -> str:
    import torch
    from safetensors.torch import save_file

    from slipstream.models.lora import _PARENT, target_shapes

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, (n_in, n_out) in target_shapes(config).items():
            stem = f"base_model.model.model.layers.{layer}.{_PARENT[target]}.{target}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SEVEN), "bias": "none"}))
    return str(folder)


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


async def one_round(engine, prompts, loras, tokens: int) -> tuple[list[float], float]:
    """(each stream's decode tokens/s, the round's aggregate tokens/s)."""
    from slipstream import SamplingParams

    async def stream(prompt, lora):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, lora=lora)
        first = last = None
        n = 0
        async for delta in engine.stream(prompt, params):
            now = time.perf_counter()
            first = now if first is None else first
            last, n = now, n + len(delta.token_ids)
        return n, first, last

    start = time.perf_counter()
    runs = await asyncio.gather(*(stream(p, lora) for p, lora in zip(prompts, loras)))
    wall = time.perf_counter() - start
    rates = [(n - 1) / (last - first) for n, first, last in runs if last > first]
    return rates, sum(n for n, _, _ in runs) / wall


async def main(args) -> str:
    import random

    from slipstream import Engine, EngineConfig
    from slipstream.provenance import header, provenance

    command = "python tools/bench/bench_lora.py " + " ".join(sys.argv[1:])
    out = [header(provenance(command)).rstrip("\n")]
    config = EngineConfig(model=args.model, max_batch_size=max(args.streams, 8), max_loras=args.adapters,
                          max_lora_rank=max(args.rank, 64))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        async with Engine(config) as engine:
            for i in range(args.adapters):
                await engine.load_lora(f"ad{i}", write_adapter(Path(tmp) / f"ad{i}", engine.model_config,
                                                                 args.rank, seed=i))
            vocab = engine.model_config.vocab_size
            prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
            kinds = {"base": [None] * args.streams,
                     "adapters": [f"ad{i % args.adapters}" for i in range(args.streams)]}
            await one_round(engine, prompts[:4], kinds["adapters"][:4], 4)  # warm-up
            rates: dict[str, list[float]] = {k: [] for k in kinds}
            totals: dict[str, list[float]] = {k: [] for k in kinds}
            for r in range(args.rounds):
                for kind, loras in kinds.items():
                    per, total = await one_round(engine, prompts, loras, args.tokens)
                    rates[kind] += per
                    totals[kind].append(total)
                    print(f"round {r} {kind}: {total:.1f} tok/s aggregate, load {os.getloadavg()[0]:.2f}",
                          file=sys.stderr, flush=True)
            stats = await engine.stats()
    out.append(f"- workload: {args.streams} streams of {args.prompt_len} prompt + {args.tokens} greedy tokens; "
               f"adapters: {args.adapters} of rank {args.rank}, targets {', '.join(SEVEN)}; {args.rounds} rounds "
               f"interleaved; model {args.model} (EngineConfig defaults otherwise); load average at the end "
               f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; lora stats {stats['lora']}")
    out.append("")
    out.append("| streams on | per-stream tok/s median | mean | p90 | aggregate tok/s (median of rounds) | rounds |")
    out.append("|---|---:|---:|---:|---:|---|")
    for kind in kinds:
        xs = rates[kind]
        out.append(f"| {kind} | {statistics.median(xs):.2f} | {statistics.mean(xs):.2f} | {p90(xs):.2f} | "
                   f"{statistics.median(totals[kind]):.1f} | {', '.join(f'{t:.1f}' for t in totals[kind])} |")
    ratio = statistics.median(rates["adapters"]) / statistics.median(rates["base"])
    agg = statistics.median(totals["adapters"]) / statistics.median(totals["base"])
    out.append("")
    out.append(f"ratio adapters / base: per-stream median {ratio:.3f}x, aggregate {agg:.3f}x (target >= 0.75x)")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the output here")
    args = ap.parse_args()
    text = asyncio.run(main(args))
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
