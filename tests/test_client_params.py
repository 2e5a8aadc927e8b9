"""Errors the worker makes keep their `param` through a Client (issue 27, defect 9), as they do in
process: the HTTP server and callers read it to name the field."""
import asyncio

import pytest
from worker_util import worker  # noqa: F401 (fixture)

from slipstream import Client, InvalidRequestError, SamplingParams
from slipstream.api.protocol import Error, error_from_wire, error_to_wire
from slipstream.errors import GrammarCompileError


def test_param_travels_on_the_wire():
    back = error_from_wire(Error(**{f: getattr(error_to_wire(InvalidRequestError("x", param="stop[1]")), f)
                                    for f in ("code", "message", "request_id", "seq", "param")}))
    assert isinstance(back, InvalidRequestError) and back.param == "stop[1]"
    grammar = GrammarCompileError("bad")
    grammar.param = "regex"
    assert error_from_wire(error_to_wire(grammar)).param == "regex"


async def test_a_clients_errors_name_the_field_the_worker_checked(worker):  # noqa: F811
    async with Client(worker.address, timeout=10) as client:
        cases = [
            (lambda: client.complete([10**6], SamplingParams(max_tokens=2)), "prompt[0]"),
            (lambda: client.complete("hi", SamplingParams(max_tokens=10**6)), "max_tokens"),
            (lambda: client.complete("hi", SamplingParams(max_tokens=2, regex="(")), "regex"),
        ]
        for call, param in cases:
            with pytest.raises((InvalidRequestError, GrammarCompileError)) as e:
                await asyncio.wait_for(call(), 10)
            assert e.value.param == param, (param, e.value)
        with pytest.raises(InvalidRequestError) as e:
            async for _ in client.stream("hi", SamplingParams(max_tokens=2, n=2)):
                pass
        assert e.value.param == "n"
        first = asyncio.create_task(client.complete("hi", SamplingParams(max_tokens=200, ignore_eos=True),
                                                    request_id="dup"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError) as e:
            await client.complete("hi", SamplingParams(max_tokens=2), request_id="dup")
        assert e.value.param == "request_id"
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_raw_params_refused_by_the_worker_name_their_field(worker):  # noqa: F811
    """A raw client's params that SamplingParams refuses on the worker: the refusal keeps its field."""
    import msgspec
    import zmq
    import zmq.asyncio

    from slipstream.api.protocol import PROTOCOL_VERSION, Generate, frame_decoder

    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.connect(worker.address)
    try:
        enc = msgspec.msgpack.Encoder()
        bad = msgspec.Raw(enc.encode({"top_p": 0.0, "max_tokens": 2}))
        await raw.send(enc.encode(Generate(v=PROTOCOL_VERSION, request_id="raw-1", prompt="hi", params=bad)))
        reply = frame_decoder().decode(await asyncio.wait_for(raw.recv(), 10))
        error = error_from_wire(reply.msgs[0])
        assert isinstance(error, InvalidRequestError) and error.param == "top_p", reply
    finally:
        raw.close(linger=0)
