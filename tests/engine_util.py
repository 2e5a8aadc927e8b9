"""Helpers shared by the engine tests: staggered submission and waiting for pages to come back."""
import asyncio


async def run_staggered(engine, reqs):
    """reqs: (prompt, params, delay_s). Requests arrive at their delays and join running batches."""
    async def one(prompt, params, delay):
        await asyncio.sleep(delay)
        return await engine.complete(prompt, params)

    return await asyncio.gather(*(one(*r) for r in reqs))


async def wait_all_free(engine, timeout=10.0):
    """Stats once every KV page is back (a zombie step may still be committing at first)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = await engine.stats()
        if s["kv_pages_free"] == s["kv_pages_total"] and s["running"] == 0:
            return s
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"pages not freed: {s}")
        await asyncio.sleep(0.01)
