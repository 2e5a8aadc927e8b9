"""A client that stops reading (frozen, still connected) is dropped once max_unsent_frames frames
pile up for it: its requests are aborted and their pages freed; it is told when it speaks again."""
import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from worker_util import ipc_address, start_worker, wait_pages_free

from slipstream import Client, InvalidRequestError, SamplingParams
from slipstream.api.protocol import PROTOCOL_VERSION, Error, Generate, HealthReply, HealthRequest, frame_decoder
from slipstream.api.worker import WorkerLimits

LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # ~1000 steps to finish on its own


NOT_READING = "reason='not reading (send queue full)'"


async def wait_log(w, text: str, times: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while w.log().count(text) < times:
        assert time.monotonic() < deadline, f"{text!r} not logged {times} times:\n{w.log()}"
        await asyncio.sleep(0.05)


async def test_a_client_that_stops_reading_is_dropped_and_its_pages_freed(tmp_path):
    w = start_worker(ipc_address(tmp_path), tmp_path, "--max-unsent-frames", "32")
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    try:
        async with Client(w.address, timeout=10) as observer:
            raw.setsockopt(zmq.LINGER, 0)
            raw.setsockopt(zmq.RCVHWM, 1)  # like a frozen process: its side takes (almost) nothing in
            raw.connect(w.address)
            enc = msgspec.msgpack.Encoder()
            for i in range(4):
                await raw.send(enc.encode(Generate(v=PROTOCOL_VERSION, request_id=f"g{i}", prompt=f"frozen {i}",
                                                   stream=True, params=msgspec.Raw(enc.encode(LONG)))))
            t0 = time.monotonic()
            # a client that reads is not affected
            good = [d async for d in observer.stream("well-behaved", SamplingParams(max_tokens=200, temperature=0))]
            assert good[-1].finish_reason == "length" and sum(len(d.token_ids) for d in good) == 200
            stats = await wait_pages_free(observer, timeout=20)  # the frozen client's 4 requests are gone
            elapsed = time.monotonic() - t0
            assert w.log().count(NOT_READING) == 1 and "aborted=4" in w.log()  # cut short, not finished
            assert stats["slow_clients"] == 1 and stats["clients"] == 1, stats

            # speaking before it reads again: the answer cannot be delivered, so it is dropped again
            await raw.send(enc.encode(HealthRequest(v=PROTOCOL_VERSION, seq=6)))
            await wait_log(w, NOT_READING, 2, 30)
            # reading again, then speaking: first told that its requests were aborted, then answered
            while await raw.poll(500):  # what was in flight when it was dropped
                await raw.recv()
            await raw.send(enc.encode(HealthRequest(v=PROTOCOL_VERSION, seq=7)))
            dec, errors = frame_decoder(), []
            while True:
                msgs = dec.decode(await asyncio.wait_for(raw.recv(), 10)).msgs
                errors += [m for m in msgs if isinstance(m, Error)]
                if any(isinstance(m, HealthReply) for m in msgs):
                    break
            assert sorted(e.request_id for e in errors) == ["g0", "g1", "g2", "g3"]
            assert {e.code for e in errors} == {"WorkerUnavailableError"}
            print(f"frozen client dropped and its pages freed {elapsed:.2f} s after its requests")
    finally:
        raw.close(linger=0)
        w.stop()


@pytest.mark.parametrize("field, value", [("max_unsent_frames", 0), ("max_unsent_frames", 2.5), ("max_queued", -1),
                                          ("max_message_bytes", 0), ("heartbeat_s", 0), ("shutdown_timeout_s", -1)])
def test_worker_limits_refuse_bad_values(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        WorkerLimits(**{field: value})
