"""What one stream delta costs the loop thread with no engine at all: 256 consumers, each woken once
per round by a put into its mailbox, as the output stage does every step (issue 36, the slope).
(a) a bare asyncio future per wake; (b) slipstream's Mailbox read by a RequestStream (its real
__anext__), the consumer an `async for` as in tools/bench_host.py. CPU µs per delta, uvloop.

    PYTHONPATH=. python docs/results/host-2026-11-27/consumer_floor.py
"""
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import uvloop  # noqa: E402

from slipstream.api.request_stream import Mailbox, RequestStream  # noqa: E402
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta  # noqa: E402

N, ROUNDS = 256, 300


async def bare() -> float:
    futs: list = [None] * N

    async def consume(i: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            futs[i] = loop.create_future()
            if await futs[i] is None:
                return

    tasks = [asyncio.ensure_future(consume(i)) for i in range(N)]
    await asyncio.sleep(0)
    c0 = time.thread_time()
    for _ in range(ROUNDS):
        for f in futs:
            f.set_result(1)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    cpu = time.thread_time() - c0
    for f in futs:
        f.set_result(None)
    await asyncio.gather(*tasks)
    return 1e6 * cpu / (N * ROUNDS)


async def streams() -> float:
    boxes = [Mailbox() for _ in range(N)]

    def stream(box: Mailbox) -> RequestStream:
        s = RequestStream.__new__(RequestStream)  # (its engine is not needed once it has a mailbox)
        s._engine, s._args, s._seq, s._box, s._done, s._carry = None, None, object(), box, False, []
        s._close = lambda: setattr(s, "_done", True)
        return s

    got = [0]

    async def consume(box: Mailbox) -> None:
        async for delta in stream(box):
            got[0] += len(delta.token_ids)

    tasks = [asyncio.ensure_future(consume(b)) for b in boxes]
    await asyncio.sleep(0)
    c0 = time.thread_time()
    for r in range(ROUNDS):
        for b in boxes:
            b.put_nowait(StreamDelta("r", "a", [r]))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    cpu = time.thread_time() - c0
    end = CompletionOutput("r", "", [], "length", [], RequestMetrics(0.0))
    for b in boxes:
        b.put_nowait(end)
    await asyncio.gather(*tasks)
    assert got[0] == N * ROUNDS
    return 1e6 * cpu / (N * ROUNDS)


def main() -> None:
    for name, fn in (("bare future", bare), ("Mailbox + RequestStream", streams)):
        xs = [uvloop.run(fn()) for _ in range(5)]
        print(f"{name}: {statistics.median(xs):.2f} µs CPU per delta (median of 5; "
              f"min {min(xs):.2f}, max {max(xs):.2f})")


if __name__ == "__main__":
    main()
