"""Bad input never stops the worker: every malformed frame is answered, then it serves correctly."""
import asyncio
import random
import socket

import msgspec
import pytest
import zmq
import zmq.asyncio
from worker_util import engine_config, free_tcp_address, start_worker, wait_pages_free

from slipstream import Client, Engine, SamplingParams
from slipstream.api.protocol import PROTOCOL_VERSION, Frame, Generate, Heartbeat, frame_decoder

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MAX_BYTES = 4096  # the worker under test refuses bigger messages


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    w = start_worker(free_tcp_address(), d, "--max-message-bytes", str(MAX_BYTES), "--log-level", "warning")
    yield w
    w.stop()


@pytest.fixture(scope="module")
def want():
    """The in-process engine's answer: what the worker must still give after the fuzzing."""
    async def go():
        async with Engine(engine_config()) as engine:
            return await engine.complete("after the storm", REF_PARAMS)

    return asyncio.run(go())


class Raw:
    """A bare DEALER: sends any bytes, reads the worker's Frames."""

    def __init__(self, address):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.dec = frame_decoder()

    async def ask(self, *frames: bytes, timeout: float = 5.0) -> list:
        await self.sock.send_multipart(list(frames))
        return await self.answer(timeout)

    async def answer(self, timeout: float) -> list:
        while True:
            frame: Frame = self.dec.decode(await asyncio.wait_for(self.sock.recv(), timeout))
            assert frame.v == PROTOCOL_VERSION
            msgs = [m for m in frame.msgs if not isinstance(m, Heartbeat)]  # this peer is a client now
            if msgs:
                return msgs

    def close(self):
        self.sock.close(linger=0)


enc = msgspec.msgpack.encode
GOOD = enc(Generate(v=PROTOCOL_VERSION, request_id="ok", prompt="fine", params=msgspec.Raw(enc(SamplingParams()))))
REF_PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

CASES = {  # frame -> the error type the worker must answer with
    b"": "ProtocolError",
    b"\xc1": "ProtocolError",  # a byte msgpack never uses
    GOOD[: len(GOOD) // 2]: "ProtocolError",  # truncated
    enc([1, 2, 3]): "ProtocolError",
    enc({"type": "nope", "v": 1}): "ProtocolError",  # unknown message type
    enc({"type": "generate", "request_id": "x", "prompt": "p"}): "ProtocolError",  # no version
    enc({"type": "generate", "v": 99, "request_id": "x", "prompt": "p"}): "ProtocolVersionError",
    enc({"type": "stats", "v": 2, "seq": 5}): "ProtocolVersionError",
    enc({"type": "generate", "v": 1, "request_id": 5, "prompt": "p"}): "ProtocolError",  # wrong type
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": {"a": 1}}): "ProtocolError",
    enc({"type": "generate", "v": 1, "request_id": "x"}): "InvalidRequestError",  # no prompt
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": "p", "params": {"max_tokens": -1}}):
        "InvalidRequestError",
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": "p", "params": {"top_p": float("nan")}}):
        "InvalidRequestError",
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": "p", "params": {"bogus": 1}}):
        "InvalidRequestError",
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": "p", "params": "hot"}): "InvalidRequestError",
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": [-5]}): "InvalidRequestError",
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": [10**9]}): "InvalidRequestError",
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": "x" * 2000, "params": {"max_tokens": 3000}}):
        "InvalidRequestError",  # prompt + max_tokens > the context
    b"\xdd\xff\xff\xff\xff": "ProtocolError",  # an array header claiming 4G items
    b"\xdb\xff\xff\xff\xff": "ProtocolError",  # a str header claiming 4 GB
    enc({"type": "generate", "v": 1, "request_id": "x", "prompt": "p"})[:-1] + b"\xdd\xff\xff\xff\xff":
        "ProtocolError",
    b"\x91" * 3000: "ProtocolError",  # deep nesting
    b"\x00" * (MAX_BYTES + 1): "MessageTooLargeError",
}


async def serves_correctly(address, want):
    async with Client(address, timeout=10) as client:
        out = await client.complete("after the storm", REF_PARAMS)
        assert out.token_ids == want.token_ids
        return await wait_pages_free(client)


async def test_malformed_frames_get_errors_and_the_worker_keeps_serving(worker, want):
    await serves_correctly(worker.address, want)
    raw = Raw(worker.address)
    try:
        for frame, code in CASES.items():
            msgs = await raw.ask(frame)
            assert [m.code for m in msgs] == [code], (frame[:40], msgs)
        # several frames in one message, an unknown request's abort, a stats call
        assert (await raw.ask(b"a", b"b"))[0].code == "ProtocolError"
        assert (await raw.ask(enc({"type": "abort", "v": 1, "seq": 3, "request_id": "zz"})))[0].aborted is False
        errs = await raw.ask(enc({"type": "stats", "v": 1, "seq": "x"}))
        assert errs[0].code == "ProtocolError"
        rng = random.Random(0)
        for _ in range(300):  # random bytes
            blob = rng.randbytes(rng.randrange(1, 300))
            assert (await raw.ask(blob))[0].code in ("ProtocolError", "ProtocolVersionError", "InvalidRequestError")
    finally:
        raw.close()
    # beyond the hard limit ZMQ drops the peer without reading the frame: no reply, no harm
    huge = Raw(worker.address)
    await huge.sock.send(b"\x00" * (8 * MAX_BYTES))
    huge.close()
    # a raw TCP peer speaking no ZMTP at all
    host, port = worker.address.removeprefix("tcp://").split(":")
    for blob in (b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 8, b"\xff" + b"\x00" * 8 + b"\x7f"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(blob)
    stats = await serves_correctly(worker.address, want)
    assert stats["bad_messages"] >= 300  # counted by the socket thread (engine-level refusals are not)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20), kind=st.sampled_from(["generate", "abort", "stats", "health"]))
def test_random_msgpack_values_are_refused(worker, value, kind):
    if isinstance(value, dict) and "type" not in value:  # also aim some at real message types
        value = {"type": kind, "v": 1, **value}

    async def go():
        raw = Raw(worker.address)
        try:
            await raw.sock.send(enc(value))
            return await raw.answer(5.0)  # everything but a bye is answered: an error, or a reply
        finally:
            raw.close()

    assert asyncio.run(go())
    assert worker.proc.poll() is None


async def test_still_serving_after_random_msgpack(worker, want):
    await serves_correctly(worker.address, want)
    async with Client(worker.address, timeout=10) as client:  # vanished fuzzing peers are forgotten
        for _ in range(100):
            if (await client.stats())["clients"] == 1:
                break
            await asyncio.sleep(0.05)
        assert (await client.stats())["clients"] == 1
