"""Prefix caching on vs off, one run, the default model on the CPU (issue 29, must-show 1).

    python tools/bench/bench_prefix_cache.py            # 64 requests, 1,024-token system prompt
    python tools/bench/bench_prefix_cache.py --out docs/results/prefix-2026-11-25/bench_prefix_cache.txt

(a) Shared system prompt: `--requests` prompts = the same `--system-tokens` token system prompt
    (real text, repeated) + a short distinct user question, submitted at once, after one warm-up
    request with the system prompt alone (the steady state of a server whose system prompt is
    already in use). Two engines one after the other, caching on then off, same prompts: TTFT
    (arrival to the first token's commit) mean / median / p90, and the ratio off / on.
(b) Multi-turn chat: each turn's prompt = the previous turn's prompt + its reply + a new user
    message; the prefill tokens each turn computes (prompt_tokens - cached_tokens), on vs off.
(c) Equal outputs: greedy, EngineConfig(batch_invariant=True), the shared-prefix prompts and the
    chat turns, caching on vs off: token ids identical.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402
from bench_lines import emit, pct, report  # noqa: E402

TEXT = ("The river rose in the night and by morning the lower fields were under water. Farmers moved "
        "their animals to the ridge, loaded grain onto carts, and waited. Nobody in the valley could "
        "remember a flood this early in the year; the old records kept at the mill spoke of one, a "
        "century ago, that had taken the bridge and half the houses on the east bank. ")
CHAT_TEXT = ("You are the archivist of a small town. You answer questions about the town's history in two or "
             "three sentences, citing the ledger, the mill records or the parish book where you can. ")
USER = "\nUser: Question {i}: in one sentence, what did person number {i} carry to the ridge?\nAssistant:"
CHAT = ["Where did the water come from?", "Why did they move the animals?", "What did the records say?",
        "Which bank was hit hardest?", "Who kept the records?", "What happened to the bridge?",
        "How early in the year was it?", "What would you do next?"]


def config(args, caching: bool, batch_invariant: bool = False) -> EngineConfig:
    return EngineConfig(model=args.model, prefix_caching=caching, batch_invariant=batch_invariant,
                        max_batch_size=args.requests, max_num_batched_tokens=args.step_tokens,
                        kv_cache_tokens=args.kv_cache_tokens)


def system_ids(tokenizer, n: int, text: str = TEXT) -> list[int]:
    """`text` repeated to exactly n tokens."""
    ids = tokenizer.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


async def shared_prefix(engine: Engine, prompts: list[list[int]], system: list[int], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    await engine.complete(system + engine.tokenizer.encode("\nUser: hello\nAssistant:"), params)  # warm-up
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
    wall = time.perf_counter() - t0
    return outs, wall


async def chat_turns(engine: Engine, system: list[int], turns: int, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompt, rows = list(system), []
    for k in range(turns):
        prompt = prompt + engine.tokenizer.encode(f"\nUser: {CHAT[k % len(CHAT)]}\nAssistant:")
        out = await engine.complete(prompt, params)
        rows.append((out.usage.prompt_tokens, out.usage.cached_tokens, out.metrics.ttft, out.token_ids))
        prompt = prompt + out.token_ids
    return rows


async def run_engine(args, caching: bool, batch_invariant: bool, requests: int):
    async with Engine(config(args, caching, batch_invariant)) as engine:
        system = system_ids(engine.tokenizer, args.system_tokens)
        prompts = [system + engine.tokenizer.encode(USER.format(i=i)) for i in range(requests)]
        outs, wall = await shared_prefix(engine, prompts, system, args.max_tokens)
        stats = await engine.stats()
        # (another system prompt: its first turn finds nothing of part (a) in the cache)
        chat = await chat_turns(engine, system_ids(engine.tokenizer, args.chat_system_tokens, CHAT_TEXT), args.turns,
                                args.chat_tokens)
        return outs, wall, stats, chat


async def main(args) -> list[str]:
    lines: list[str] = []
    emit(lines, f"## (a) {args.requests} requests sharing a {args.system_tokens}-token system prompt, "
                f"max_tokens={args.max_tokens}, {args.model}, CPU")
    emit(lines)
    res = {}
    for caching in (True, False):
        t0 = time.perf_counter()
        res[caching] = await run_engine(args, caching, False, args.requests)
        print(f"  (caching {'on' if caching else 'off'}: {time.perf_counter() - t0:.1f} s with load and warm-up)",
              file=sys.stderr)
    emit(lines, "| prefix caching | TTFT mean (s) | TTFT median (s) | TTFT p90 (s) | wall (s) | cached tokens "
                "| prefill tokens computed |")
    emit(lines, "|---|---:|---:|---:|---:|---:|---:|")
    ttfts = {}
    for caching in (True, False):
        outs, wall, stats, _ = res[caching]
        t = [o.metrics.ttft for o in outs]
        ttfts[caching] = t
        cached = sum(o.usage.cached_tokens for o in outs)
        computed = sum(o.usage.prompt_tokens for o in outs) - cached
        emit(lines, f"| {'on' if caching else 'off'} | {statistics.mean(t):.3f} | {statistics.median(t):.3f} | "
                    f"{pct(t, 0.9):.3f} | {wall:.2f} | {cached} | {computed} |")
    on, off = ttfts[True], ttfts[False]
    emit(lines)
    emit(lines, f"TTFT off/on: mean {statistics.mean(off) / statistics.mean(on):.1f}x, median "
                f"{statistics.median(off) / statistics.median(on):.1f}x, p90 {pct(off, 0.9) / pct(on, 0.9):.1f}x "
                f"(goal: >= 5x)")
    st = res[True][2]
    emit(lines, f"caching on, stats(): queries {st['prefix_cache_queries']} tokens, hits {st['prefix_cache_hits']}, "
                f"hit rate {st['prefix_cache_hit_rate']:.3f}, cached pages {st['prefix_cache_cached_pages']}, "
                f"evictions {st['prefix_cache_evictions']}")
    same = sum(a.token_ids == b.token_ids for a, b in zip(res[True][0], res[False][0]))
    emit(lines, f"outputs equal on vs off (batch_invariant=False, so not guaranteed): {same}/{args.requests}")
    emit(lines)
    emit(lines, f"## (b) multi-turn chat: {args.turns} turns, {args.chat_system_tokens}-token system prompt, "
                f"{args.chat_tokens}-token replies")
    emit(lines)
    emit(lines, "| turn | prompt tokens | computed, caching on | computed, caching off | TTFT on (s) | TTFT off (s) |")
    emit(lines, "|---:|---:|---:|---:|---:|---:|")
    for k, (a, b) in enumerate(zip(res[True][3], res[False][3]), 1):
        emit(lines, f"| {k} | {a[0]} | {a[0] - a[1]} | {b[0] - b[1]} | {a[2]:.3f} | {b[2]:.3f} |")
    emit(lines)
    n = args.equal_requests
    emit(lines, f"## (c) outputs equal, greedy, batch_invariant=True: {n} shared-prefix requests + the chat")
    emit(lines)
    inv = {c: await run_engine(args, c, True, n) for c in (True, False)}
    same = sum(a.token_ids == b.token_ids for a, b in zip(inv[True][0], inv[False][0]))
    chat_same = [a[3] for a in inv[True][3]] == [b[3] for b in inv[False][3]]
    cached = sum(o.usage.cached_tokens for o in inv[True][0])
    emit(lines, f"shared prefix: {same}/{n} equal (caching on served {cached} cached tokens); "
                f"chat turns equal: {chat_same}")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per shared-prefix request")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--chat-system-tokens", type=int, default=256)
    ap.add_argument("--chat-tokens", type=int, default=32)
    ap.add_argument("--equal-requests", type=int, default=8, help="requests of part (c)")
    ap.add_argument("--step-tokens", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables, with provenance, here")
    args = ap.parse_args()
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    report(lambda: asyncio.run(main(args)), args.out)
