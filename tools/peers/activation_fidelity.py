"""How far EngineConfig.activations moves the default model from transformers: greedy tokens and logits.

    python tools/peers/activation_fidelity.py [--modes float int16 int8] [--tokens 32] [--out FILE]

Greedy: tests/test_oracle_smollm.py's check with each mode: its prompts (raw and chat), `--tokens`
greedy tokens (ignore_eos) through the engine at depth 2, against transformers' generate on the same
GGUF; reported per prompt: tokens until the first difference. Logits: each prompt followed by
transformers' greedy continuation, fed as one chunk (teacher-forced, so every mode sees the same
tokens) with logits at every position; reported per mode: max |logit difference| against float
activations and against transformers over all positions and prompts, and the positions whose argmax
differs from transformers'.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tools" / "common"), str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

PROMPTS = ["The quick brown fox", "What is 12345 + 678? The answer is", "Ünïcødé text, 日本語 and emoji 🚀 mixed:",
           "def fibonacci(n):\n    "]  # tests/test_oracle_smollm.py's
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "List three colours."}]]


async def engine_greedy(mode: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from slipstream import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with Engine(EngineConfig(model="smollm2-135m", pipeline_depth=2, activations=mode)) as engine:
        outs = await asyncio.gather(*(engine.complete(ids, params) for ids in prompts))
    return [o.token_ids for o in outs]


def all_logits(model, config, ids: list[int]) -> torch.Tensor:
    from host_batch import Chunk, host_batch

    from slipstream.models.base import KVCache

    page = 16
    pages = -(-len(ids) // page)
    kv = KVCache(config, num_pages=pages + 1, page_size=page, dtype=torch.float32, device="cpu")
    batch, _ = host_batch([Chunk(tokens=ids, start_pos=0, pages=list(range(1, pages + 1)))], page, 16)
    batch.sample_indices = torch.arange(len(ids))
    return model(batch, kv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["float", "int16", "int8"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from bench_lines import emit, report
    from transformers import AutoModelForCausalLM

    from slipstream.models.loading.build import build_model
    from slipstream.models.loading.loader import DEFAULT_MODEL, load_model

    def body() -> list[str]:
        lines: list[str] = []
        loaded = load_model(DEFAULT_MODEL)
        tok = loaded.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(tok.apply_chat_template(m)) for m in CHAT]
        names = PROMPTS + [f"chat: {m[0]['content']}" for m in CHAT]
        hf = AutoModelForCausalLM.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name,
                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            want = [hf.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
            hf_logits = [hf(torch.tensor([ids + w])).logits[0].float() for ids, w in zip(prompts, want)]
        emit(lines, f"greedy: {len(prompts)} prompts (tests/test_oracle_smollm.py), {args.tokens} tokens each, "
                    "engine at depth 2 vs transformers' generate; tokens until the first difference\n")
        emit(lines, "| prompt | " + " | ".join(args.modes) + " |")
        emit(lines, "|---|" + "---:|" * len(args.modes))
        firsts = {m: [] for m in args.modes}
        for mode in args.modes:
            got = asyncio.run(engine_greedy(mode, prompts, args.tokens))
            firsts[mode] = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
        for i, name in enumerate(names):
            emit(lines, f"| {name!r} | " + " | ".join(str(firsts[m][i]) for m in args.modes) + " |")
        emit(lines, "| all equal | " + " | ".join("yes" if all(n == args.tokens for n in firsts[m]) else "no"
                                                  for m in args.modes) + " |")

        model, _, config = build_model(DEFAULT_MODEL, "float32", torch.device("cpu"), pack=True, weights="quantized")
        model.set_kernel_backend("cpu")
        logits = {}
        for mode in args.modes:
            model.set_activations(mode)
            logits[mode] = [all_logits(model, config, ids + w) for ids, w in zip(prompts, want)]
        positions = sum(len(ids) + len(w) for ids, w in zip(prompts, want))
        span = max(x.abs().max().item() for x in hf_logits)
        top2 = [x.topk(2, dim=-1).values for x in hf_logits]
        margin = min((t[:, 0] - t[:, 1]).min().item() for t in top2)
        emit(lines, f"\nlogits, teacher-forced on transformers' greedy continuations: {positions} positions; "
                    f"max |difference|. transformers' logits: max |logit| {span:.1f}, smallest top-1 minus "
                    f"top-2 gap {margin:.2e}\n")
        emit(lines, "| activations | vs float activations | vs transformers | argmax != transformers' |")
        emit(lines, "|---|---:|---:|---:|")
        for mode in args.modes:
            d_float = max((a - b).abs().max().item() for a, b in zip(logits[mode], logits[args.modes[0]]))
            d_hf = max((a - b).abs().max().item() for a, b in zip(logits[mode], hf_logits))
            flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(logits[mode], hf_logits))
            emit(lines, f"| {mode} | {d_float:.2e} | {d_hf:.2e} | {flips} of {positions} |")
        return lines

    report(body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
