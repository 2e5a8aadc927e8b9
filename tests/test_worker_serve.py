"""One `slipstream worker` on an ipc socket serving many clients: results, aborts, disconnects."""
import asyncio
import random
import sys
from asyncio.subprocess import PIPE

import msgspec
import pytest
import zmq
import zmq.asyncio
from worker_util import engine_config, wait_pages_free, worker  # noqa: F401 (fixture)

from slipstream import Client, Engine, InvalidRequestError, SamplingParams, WorkerUnavailableError
from slipstream.api.protocol import PROTOCOL_VERSION, Generate


def requests_for(client_no: int, n: int = 25):
    rng = random.Random(client_no)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 40))] if i % 2 else f"client {client_no} #{i}"
        params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0)
        if i % 5 == 4:  # seeded sampling must match too (the engine is batch invariant)
            params = SamplingParams(max_tokens=params.max_tokens, temperature=0.9, top_p=0.9, seed=1000 * client_no + i)
        out.append((prompt, params))
    return out


async def test_8_clients_x_25_streams_match_in_process_engine(worker):
    work = {c: requests_for(c) for c in range(8)}
    async with Engine(engine_config()) as engine:
        want = {c: await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs)) for c, reqs in work.items()}

    async def one_client(c):
        async with Client(worker.address, timeout=10) as client:
            async def one(i, prompt, params):
                deltas = [d async for d in client.stream(prompt, params, request_id=f"c{c}-{i}")]
                return deltas
            return await asyncio.gather(*(one(i, *r) for i, r in enumerate(work[c])))

    got = await asyncio.wait_for(asyncio.gather(*(one_client(c) for c in range(8))), 60)
    for c in range(8):
        for i, (deltas, ref) in enumerate(zip(got[c], want[c])):
            assert all(d.request_id == f"c{c}-{i}" for d in deltas)
            finals = [d.finish_reason for d in deltas if d.finish_reason is not None]
            assert finals == [ref.finish_reason] and deltas[-1].finish_reason == ref.finish_reason  # once, last
            assert [t for d in deltas for t in d.token_ids] == ref.token_ids  # nothing lost or repeated
            assert "".join(d.text for d in deltas) == ref.text
    async with Client(worker.address, timeout=10) as client:
        stats = await wait_pages_free(client)
        assert stats["requests"] >= 200 and stats["bad_messages"] == 0


async def test_complete_chat_and_errors_match_engine(worker):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, stop=["a"])
    async with Engine(engine_config()) as engine:
        want = await engine.complete("the same prompt", params)
        want_chat = await engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, temperature=0))
    async with Client(worker.address, timeout=10) as client:
        got = await client.complete("the same prompt", params, request_id="mine")
        assert (got.request_id, got.text, got.token_ids, got.finish_reason, got.prompt_token_ids, got.logprobs) == \
            ("mine", want.text, want.token_ids, want.finish_reason, want.prompt_token_ids, want.logprobs)
        assert got.metrics.arrival <= got.metrics.first_token <= got.metrics.finished
        chat = await client.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, temperature=0))
        assert chat.token_ids == want_chat.token_ids
        with pytest.raises(InvalidRequestError):
            await client.complete([10**6])  # token id outside the vocabulary: refused by the engine
        with pytest.raises(InvalidRequestError):
            await client.complete("")
        with pytest.raises(InvalidRequestError):
            await client.chat([])
        assert (await client.health()).ready


async def test_grammar_params_and_their_errors_travel(worker):
    from slipstream.errors import GrammarCompileError

    params = [SamplingParams(max_tokens=20, temperature=0.0, choice=["yes", "no", "maybe"]),
              SamplingParams(max_tokens=20, temperature=0.0, regex="[a-c]{3}x")]
    async with Engine(engine_config()) as engine:
        want = [await engine.complete("pick one", p) for p in params]
    async with Client(worker.address, timeout=10) as client:
        got = [await client.complete("pick one", p) for p in params]
        assert [(o.text, o.token_ids) for o in got] == [(o.text, o.token_ids) for o in want]
        with pytest.raises(GrammarCompileError):  # the engine's error type, raised by the client
            await client.complete("x", SamplingParams(regex="((("))


async def test_abort_and_cancel_free_pages(worker):
    long = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    async with Client(worker.address, timeout=10) as client:
        stream = client.stream("a long one", long, request_id="r1")
        first = await anext(stream)
        assert first.request_id == "r1"
        task = asyncio.create_task(client.complete("another long one", long, request_id="r2"))
        await asyncio.sleep(0.1)
        assert (await client.stats())["running"] >= 1
        assert await client.abort("r1")
        rest = [d async for d in stream]
        assert rest[-1].finish_reason == "abort" and len(rest) < 600
        assert not await client.abort("r1") and not await client.abort("unknown")
        with pytest.raises(InvalidRequestError):  # ids are unique per client while unfinished
            await client.complete("x", request_id="r2")
        task.cancel()  # cancelling the waiter aborts the request on the worker
        with pytest.raises(asyncio.CancelledError):
            await task
        s3 = client.stream("third", long)
        await anext(s3)
        await s3.aclose()  # closing a stream early aborts it too
        async for _ in client.stream("fourth", long, request_id="r4"):
            break
        assert "r4" not in client.connection.pending  # freed at once, no loop pass in between
        await wait_pages_free(client)  # and the worker aborted it


async def test_client_disconnect_and_close_free_pages(worker, tmp_path):
    long = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
    # a client that vanishes without a word: a raw socket closed mid-stream
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(worker.address)
    enc = msgspec.msgpack.Encoder()
    for i in range(4):
        await raw.send(enc.encode(Generate(v=PROTOCOL_VERSION, request_id=f"g{i}", prompt=f"gone {i}", stream=True,
                                           params=msgspec.Raw(enc.encode(long)))))
    await asyncio.wait_for(raw.recv(), 10)  # streaming has begun
    raw.close(linger=0)
    # a Client closed with streams still running: its Bye aborts them at once
    client = await Client(worker.address, timeout=10).start()
    streams = [client.stream(f"closing {i}", long) for i in range(3)]
    for s in streams:
        await anext(s)
    async with Client(worker.address, timeout=10) as observer:
        assert (await observer.stats())["running"] >= 3
        await client.close()
        for s in streams:  # what had arrived is still delivered, then the stream fails
            with pytest.raises(WorkerUnavailableError):
                async for _ in s:
                    pass
        stats = await wait_pages_free(observer)
        assert stats["clients"] == 1  # only the observer is left
    assert "client_gone" in worker.log() and "disconnected" in worker.log()


async def test_generate_connect_uses_the_worker(worker):
    params = SamplingParams(max_tokens=5, temperature=0.0)
    async with Engine(engine_config()) as engine:
        want = await engine.complete("hello", params)
    cmd = [sys.executable, "-m", "slipstream.cli", "generate", "hello", "--raw", "--max-tokens", "5", "-v",
           "--connect", worker.address]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=PIPE, stderr=PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    assert out.decode() == want.text + "\n"
    assert "finish: length" in err.decode() and "kv_pages_free" in err.decode()


async def test_n_fans_out_on_the_client_like_the_engine(worker):
    params = SamplingParams(n=3, seed=99, temperature=1.0, max_tokens=8, ignore_eos=True)
    async with Engine(engine_config()) as engine:
        want = await engine.complete("fan", params)
    async with Client(worker.address, timeout=10) as client:
        got = await client.complete("fan", params, request_id="f")
        assert [(o.request_id, o.index, o.token_ids, o.usage) for o in got] == \
            [(f"f-{i}", i, w.token_ids, w.usage) for i, w in enumerate(want)]
        chats = await client.chat([{"role": "user", "content": "hi"}], params)
        assert [o.index for o in chats] == [0, 1, 2]
        with pytest.raises(InvalidRequestError):  # the worker takes one completion per Generate
            await client.requests.complete(None, SamplingParams(n=2, max_tokens=2), prompt="x")  # as a raw client would
        with pytest.raises(InvalidRequestError):
            [d async for d in client.stream("x", SamplingParams(n=2))]


async def test_tools_travel_and_match_the_engine(worker):
    """chat with tools through a worker: the same calls as the in-process Engine, streamed deltas with
    their content and call pieces, and the checks' errors naming the field before anything is sent."""
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
        "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "pick"}]
    params = SamplingParams(max_tokens=60, temperature=0.9, seed=3)
    async with Engine(engine_config()) as engine:
        want = await engine.chat(ask, params, tools=tools, tool_choice="required", parallel_tool_calls=False)
    async with Client(worker.address, timeout=10) as client:
        got = await client.chat(ask, params, tools=tools, tool_choice="required", parallel_tool_calls=False)
        deltas = [d async for d in client.chat_stream(ask, params, tools=tools, tool_choice="required",
                                                      parallel_tool_calls=False)]
        with pytest.raises(InvalidRequestError) as e:
            await client.chat(ask, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})
        assert e.value.param == "tool_choice"
    assert (got.text, got.content, [(c.name, c.arguments) for c in got.tool_calls]) == \
        (want.text, want.content, [(c.name, c.arguments) for c in want.tool_calls])
    assert "".join(d.text for d in deltas) == want.text and "".join(d.content for d in deltas) == want.content == ""
    pieces = [p for d in deltas for p in d.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].name == "pick"
    assert "".join(p.arguments for p in pieces) == want.tool_calls[0].arguments
