"""Clients of an EngineLoop on the fake device: each request is submitted after its arrival (loop
yields), aborted after its own count of yields if it has one, and awaited to its end."""
import asyncio

from fake_runner import EOS, NullDetok
from slipstream.api.request_stream import RequestState
from slipstream.outputs import CompletionOutput, RequestMetrics
from slipstream.params import SamplingParams
from slipstream.runtime.batch import SamplingRow
from slipstream.scheduler.sequence import ImageState, Sequence


def submit_greedy(loop, name: str, prompt: list[int], spans=(), max_tokens: int = 4) -> Sequence:
    """Submit a greedy token-only request (with its image spans) at once; returns its sequence."""
    req = RequestState(name, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), NullDetok(),
                       frozenset({EOS}), RequestMetrics(0.0))
    seq = Sequence(name, prompt, max_tokens, SamplingRow(), user=req, images=ImageState(list(spans)) if spans else None)
    loop.submit(seq)
    return seq


async def ended(seq):
    """Its CompletionOutput, or the error it failed with (StepFailedError; EngineClosedError when the
    loop died: as on the real engine, every waiter gets it)."""
    while True:
        item = await seq.user.queue.get()
        if isinstance(item, (CompletionOutput, BaseException)):
            return item


async def serve_requests(loop, jobs, timeout: float = 60.0) -> dict:
    """jobs: (make_seq, arrive_after_yields, abort_after_yields | None) in request order; runs the
    loop until every request ended, stops it, and returns {i: (CompletionOutput or StepFailedError, seq)}."""
    task = asyncio.create_task(loop.run())
    results = {}

    async def client(i, make_seq, arrive, abort_after):
        for _ in range(arrive):
            await asyncio.sleep(0)
        seq = make_seq()
        loop.submit(seq)
        if abort_after is not None:
            for _ in range(abort_after):
                await asyncio.sleep(0)
            loop.abort(seq)
        results[i] = (await ended(seq), seq)

    await asyncio.wait_for(asyncio.gather(*(client(i, *job) for i, job in enumerate(jobs))), timeout)
    loop.close()
    await task  # a loop that died raises its error here, after every client got it
    return results
