"""Greedy agreement of the quantized default model with its dequantized twin, prompt by prompt.

    python tools/bench/quant_agreement.py [--tokens 64] [--out docs/results/quant-2026-11-27/agreement.md]

Both engines load the same GGUF with EngineConfig defaults except `weights`: "quantized" (the
compiled CPU kernels on the quantized weights) and "dequantized" (float32 weights, oneDNN-packed
projections). Each prompt is generated greedily (ignore_eos) by both; reported: the tokens until
the first difference, whether the whole outputs match, and the overall rate. The prompts: the default
model's oracle prompts (tests/test_oracle_smollm.py, raw and chat) and the README's.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools" / "common"), str(ROOT)]

RAW = ["The quick brown fox", "What is 12345 + 678? The answer is", "Ünïcødé text, 日本語 and emoji 🚀 mixed:",
       "def fibonacci(n):\n    "]
CHAT = ["What is the capital of France?", "List three colours.", "Write a short poem about the sea.",
        "Why is the sky blue?"]


async def outputs(weights: str, tokens: int, activations: str = "float") -> list[list[int]]:
    from slipstream import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with Engine(EngineConfig(weights=weights, activations=activations)) as engine:
        prompts = RAW + [await engine.chat_prompt([{"role": "user", "content": c}]) for c in CHAT]
        outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
    return [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--activations", default="float", choices=["float", "int8", "int16"],
                    help="the quantized engine's EngineConfig.activations")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from bench_lines import emit, report

    def body() -> list[str]:
        lines: list[str] = []
        quant = asyncio.run(outputs("quantized", args.tokens, args.activations))
        dense = asyncio.run(outputs("dequantized", args.tokens))
        emit(lines, f"{len(quant)} prompts, {args.tokens} greedy tokens each; quantized with activations="
                    f"{args.activations}\n")
        emit(lines, "| prompt | tokens until the first difference | whole output equal |")
        emit(lines, "|---|---:|---|")
        same, agreed = 0, 0
        for prompt, q, d in zip(RAW + [f"chat: {c}" for c in CHAT], quant, dense):
            n = next((i for i, (a, b) in enumerate(zip(q, d)) if a != b), min(len(q), len(d)))
            same += q == d
            agreed += n
            emit(lines, f"| {prompt!r} | {n} | {'yes' if q == d else 'no'} |")
        emit(lines, f"\nwhole outputs equal: {same} of {len(quant)}; tokens before the first difference: "
                    f"{agreed} of {args.tokens * len(quant)} ({100 * agreed / (args.tokens * len(quant)):.1f}%)")
        return lines

    report(body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
