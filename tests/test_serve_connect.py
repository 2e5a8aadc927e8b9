"""`slipstream serve --connect A --connect B` as a subprocess over two `slipstream worker`s:
outputs equal the in-process engine, requests are spread, disconnects free worker pages, and
SIGTERM drains in-flight streams before the server exits."""
import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_util import ServeProc, wait_pages_free
from worker_util import engine_config, ipc_address, start_worker

from slipstream import Engine, SamplingParams

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
from openai import AsyncOpenAI  # noqa: E402

PROMPTS = [f"remote {i}: tell me" for i in range(200)]
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    dirs = [tmp_path_factory.mktemp(f"w{i}") for i in range(2)]
    addresses = [ipc_address(d) for d in dirs]
    args = [a for addr in addresses for a in ("--connect", addr)]
    # all three start at once: the front end's clients wait for the workers to bind
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(start_worker, a, d) for a, d in zip(addresses, dirs)]
        futures.append(pool.submit(ServeProc, dirs[0], *args, "--log-level", "info", "--shutdown-timeout", "20"))
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < 3:
        for p in started:
            p.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    *workers, serve = started
    yield serve, workers
    serve.stop()
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def reference():
    async def run():
        async with Engine(engine_config()) as engine:
            greedy = SamplingParams(max_tokens=8, temperature=0.0)
            outs = await asyncio.gather(*(engine.complete(p, greedy) for p in PROMPTS))
            return [o.text for o in outs], await engine.chat(CHAT, greedy)
    return asyncio.run(run())


def client(serve) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_200_streams_over_two_workers_equal_in_process_greedy(served, reference):
    serve, _ = served
    async with client(serve) as oa:
        async def one(prompt):
            chunks = [c async for c in await oa.completions.create(model="m", prompt=prompt, max_tokens=8,
                                                                  temperature=0, stream=True)]
            return "".join(c.choices[0].text for c in chunks)
        got = await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 90)
        chat = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0)
    assert got == reference[0]
    assert chat.choices[0].message.content == reference[1].text
    stats = await wait_pages_free(serve.url)
    per_worker = [w["requests"] for w in stats["workers"]]
    assert len(per_worker) == 2 and all(n >= 50 for n in per_worker), per_worker  # spread over both


async def test_disconnect_frees_the_workers_pages(served):
    serve, _ = served
    async with client(serve) as oa:
        stream = await oa.completions.create(model="m", prompt="go on", max_tokens=1000, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
    await wait_pages_free(serve.url, timeout=1.5)  # the 1000 tokens would take seconds


async def test_tool_calls_over_workers_equal_in_process(served):
    """The front end renders the tools and sends the tool-call grammar in the params: a worker runs it."""
    serve, _ = served
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
        "additionalProperties": False}}}]
    async with Engine(engine_config()) as engine:
        want = await engine.chat(CHAT, SamplingParams(max_tokens=200, temperature=0.9, seed=4), tools=tools,
                                 tool_choice="required", parallel_tool_calls=False)
    async with client(serve) as oa:
        r = await oa.chat.completions.create(model="m", messages=CHAT, tools=tools, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=200, temperature=0.9, seed=4)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == \
        [(c.name, c.arguments) for c in want.tool_calls]


async def test_sigterm_drains_in_flight_streams(served):
    serve, _ = served
    async with client(serve) as oa:
        stream = await oa.completions.create(model="m", prompt="drain me", max_tokens=300, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        chunks = []
        async for c in stream:
            chunks.append(c)
            if len(chunks) == 1:
                serve.proc.send_signal(signal.SIGTERM)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len("".join(c.choices[0].text for c in chunks).encode("utf-8", "surrogatepass")) > 0
    assert await asyncio.to_thread(serve.proc.wait, 20) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(serve.url + "/health")
    assert "server_stopped" in serve.log()


async def test_in_process_server_drains_on_sigterm(tmp_path):
    serve = ServeProc(tmp_path, "--model", "tiny-random", "--log-level", "info", "--shutdown-timeout", "20")
    try:
        async with client(serve) as oa:
            stream = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=300, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
            chunks = []
            async for c in stream:
                chunks.append(c)
                if len(chunks) == 2:
                    serve.proc.send_signal(signal.SIGTERM)
            assert chunks[-1].choices[0].finish_reason == "length"  # finished, not aborted
        assert await asyncio.to_thread(serve.proc.wait, 20) == 0
        assert "completion_tokens=300" in serve.log() and "server_stopped" in serve.log()
    finally:
        serve.stop()


async def test_detokenize_over_workers_is_bounded_by_their_context(served):
    """The front end holds no engine: the workers' handshake says their context, which bounds
    /detokenize as on an in-process server (it read None there and failed)."""
    serve, _ = served
    async with Engine(engine_config()) as engine:
        most = engine.max_model_len
    async with httpx.AsyncClient(base_url=serve.url, timeout=30) as http:
        assert (await http.post("/tokenize", json={"prompt": "hi"})).json()["max_model_len"] == most > 0
        ok = await http.post("/detokenize", json={"tokens": [72, 105]})
        too_many = await http.post("/detokenize", json={"tokens": [1] * (most + 1)})
    assert ok.status_code == 200 and ok.json()["prompt"]
    assert too_many.status_code in (400, 413), too_many.text
