"""SamplingParams.n > 1: one request becomes n child requests, run side by side and gathered.

Each child is an ordinary request (n=1) in the batch, so nothing below the API knows about n.
Child i gets:
  - the seed derived from (seed, i): child 0 keeps the request's seed (so choice 0 of a seeded
    n=3 request is what n=1 returns), the others a 63-bit hash of (seed, i): reproducible and
    distinct. Without a seed, each child draws its own, as any request does;
  - the request id `{request_id}-{i}` when the caller gave one (abort a child by that id),
    else an automatic id.
The outputs come back in order, `CompletionOutput.index` = i. If one child fails, the others are
aborted and the first error is raised; cancelling the caller aborts them all. Streaming with
n > 1 is refused (InvalidRequestError naming `n`): the deltas of n completions have no single order.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from typing import Awaitable, Callable, TypeGuard, cast

import msgspec

from slipstream.outputs import CompletionOutput
from slipstream.params import MAX_SEED, SamplingParams

# a child has n == 1: one CompletionOutput (the API's methods are typed for either)
RunChild = Callable[[SamplingParams, "str | None"], Awaitable["CompletionOutput | list[CompletionOutput]"]]


def wants_fan_out(params: object) -> TypeGuard[SamplingParams]:
    return isinstance(params, SamplingParams) and params.n > 1


def child_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"slipstream-n:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    seed = None if params.seed is None else child_seed(params.seed, index)
    return msgspec.structs.replace(params, n=1, seed=seed)


def child_request_id(request_id: str | None, index: int) -> str | None:
    return None if request_id is None else f"{request_id}-{index}"


async def fan_out(run: RunChild, params: SamplingParams, request_id: str | None) -> list[CompletionOutput]:
    """Run `run(child_params, child_id)` for each of the n children; their outputs in index order."""
    tasks = [asyncio.ensure_future(run(child_params(params, i), child_request_id(request_id, i)))
             for i in range(params.n)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t in done and t.exception() is not None]
        if failed:
            raise cast(BaseException, failed[0].exception())
        return [dataclasses.replace(cast(CompletionOutput, t.result()), index=i) for i, t in enumerate(tasks)]
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()  # a child's complete() aborts its request when cancelled
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:  # mark every child's error as seen (no "never retrieved" warnings)
            if t.done() and not t.cancelled():
                t.exception()
