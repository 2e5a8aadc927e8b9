"""The threaded output stage survives a request failed by the loop while the thread is reading it."""
import asyncio
import threading

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.api import output_processor as op


async def test_a_request_failed_during_its_threaded_text_phase_does_not_stop_the_stage(monkeypatch):
    async with Engine(EngineConfig(model="tiny-random", device="cpu", output_stage="thread")) as engine:
        texts = op.OutputProcessor._texts
        in_thread, failed = threading.Event(), threading.Event()
        armed = [True]

        def slow_texts(self, *work):
            if armed[0]:
                armed[0] = False
                in_thread.set()
                failed.wait(5)  # meanwhile the loop fails this request (a matcher error, a failed step)
            return texts(self, *work)

        monkeypatch.setattr(op.OutputProcessor, "_texts", slow_texts)
        victim = asyncio.create_task(engine.complete("victim", SamplingParams(max_tokens=50, ignore_eos=True)))
        while not in_thread.is_set():
            await asyncio.sleep(0.001)
        seq = next(iter(engine.submitter.requests.values()))
        engine.loop.outputs.fail(seq, RuntimeError("simulated failure"))
        failed.set()
        out = await asyncio.wait_for(engine.complete("bystander", SamplingParams(max_tokens=4, ignore_eos=True)), 10)
        assert out.finish_reason == "length"
        assert isinstance((await asyncio.gather(victim, return_exceptions=True))[0], Exception)
