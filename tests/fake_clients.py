"""Clients of an EngineLoop on the fake device: each request is submitted after its arrival (loop
yields), aborted after its own count of yields if it has one, and awaited to its end."""
import asyncio

from slipstream.errors import StepFailedError
from slipstream.outputs import CompletionOutput


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
        while True:
            item = await seq.user.queue.get()
            if isinstance(item, (CompletionOutput, StepFailedError)):
                results[i] = (item, seq)
                return

    await asyncio.wait_for(asyncio.gather(*(client(i, *job) for i, job in enumerate(jobs))), timeout)
    loop.close()
    await task
    return results
