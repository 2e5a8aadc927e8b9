"""LoRA adapters through the HTTP server over workers (`slipstream serve --connect`, ClientsBackend;
docs/lora.md "Over workers"): the workers' adapters listed and served by the request's `model`, a load
reaching every worker or none, an unload every worker, a restarted worker given the adapters again;
and the Ray Serve backend's adapters of --lora (its run-time loads answer 501)."""
import asyncio
import time
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from lora_util import ADAPTERS, make_adapter, tiny_hf  # noqa: E402
from serve_util import ThreadServer  # noqa: E402
from worker_util import engine_config, ipc_address, start_worker  # noqa: E402

from slipstream import Client, Engine, SamplingParams  # noqa: E402
from slipstream.serve.backend import ClientsBackend  # noqa: E402

PROMPTS = ["Hello, adapters", "one worker or two", "the same text", "whichever serves it"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    _, hf = tiny_hf()
    root = tmp_path_factory.mktemp("connect-loras")
    return {name: str(make_adapter(hf, root / name, *ADAPTERS[name], seed=i)) for i, name in enumerate("abc")}


@pytest.fixture(scope="module")
def reference(folders):
    """Greedy texts of PROMPTS in-process, per adapter (None: the base model)."""
    async def run():
        async with Engine(engine_config(lora_adapters=folders)) as engine:
            return {lora: [(await engine.complete(p, SamplingParams(max_tokens=8, temperature=0, lora=lora))).text
                           for p in PROMPTS] for lora in (None, "a", "b", "c")}
    return asyncio.run(run())


@pytest.fixture(scope="module")
def served(tmp_path_factory, folders):
    """Two workers started with adapter a; the second takes ranks up to 4 only (b, rank 8, fails there)."""
    dirs = [tmp_path_factory.mktemp(f"lw{i}") for i in range(2)]
    addresses = [ipc_address(d) for d in dirs]
    flags = [("--lora", f"a={folders['a']}"), ("--lora", f"a={folders['a']}", "--max-lora-rank", "4")]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_worker, a, d, *f) for a, d, f in zip(addresses, dirs, flags)]
    workers = [f.result() for f in futures if f.exception() is None]
    if len(workers) < 2:
        for w in workers:
            w.stop()
        raise next(f.exception() for f in futures if f.exception() is not None)
    try:
        with ThreadServer(ClientsBackend(addresses, model_name="base")) as server:
            yield server, workers, dirs, flags
    finally:
        for w in workers:
            w.stop()


async def worker_loras(address: str) -> list[str]:
    """The adapters a worker holds, asked directly (not through the server)."""
    async with Client(address) as c:
        return sorted(a["name"] for a in (await c.health()).loras)


async def complete_all(http, model: str) -> list[str]:
    """PROMPTS one after another, greedy texts."""
    out = []
    for p in PROMPTS:
        r = await http.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


@asynccontextmanager
async def first_worker_busy(http):
    """A long stream on the first worker (both idle: the server picks it): meanwhile the second has
    fewer requests in flight, so it gets each request sent one at a time."""
    async with http.stream("POST", "/v1/completions", json={"model": "base", "prompt": "keep going", "stream": True,
                                                            "max_tokens": 3000, "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()  # (held: a line iterator closed early would close the connection now)
        await anext(lines)
        yield
        await lines.aclose()  # the connection goes: the worker aborts the stream


async def requests_served(server) -> list[int]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        return [w["requests"] for w in (await http.get("/health")).json()["stats"]["workers"]]


async def test_the_workers_adapter_is_served_by_model(served, reference):
    server, _, _, _ = served
    assert reference["a"] != reference[None]
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30) as oa:
        assert [m.id for m in (await oa.models.list()).data] == ["base", "a"]
        assert (await oa.models.retrieve("a")).model_extra["parent"] == "base"
        chunks = [c async for c in await oa.completions.create(model="a", prompt=PROMPTS[0], max_tokens=8,
                                                             temperature=0, stream=True)]
        with pytest.raises(openai.NotFoundError) as e:
            await oa.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "".join(c.choices[0].text for c in chunks) == reference["a"][0]
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        before = await requests_served(server)
        assert await complete_all(http, "a") == reference["a"]  # on the first worker
        async with first_worker_busy(http):
            assert await complete_all(http, "a") == reference["a"]  # on the second
            assert await complete_all(http, "base") == reference[None]
        after = await requests_served(server)
    assert [n - b for n, b in zip(after, before)] == [len(PROMPTS) + 1, 2 * len(PROMPTS)]


async def test_a_load_reaches_every_worker_or_none(served, folders, reference):
    server, workers, _, _ = served
    addresses = [w.address for w in workers]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        # b (rank 8): the first worker takes it, the second refuses it; the first's copy is unloaded again
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "r", r.text
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["base", "a"]
        assert [await worker_loras(a) for a in addresses] == [["a"], ["a"]]
        r = await http.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": folders["a"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"

        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["c"]})
        assert r.status_code == 200 and r.json()["rank"] == 2, r.text
        assert [await worker_loras(a) for a in addresses] == [["a", "c"], ["a", "c"]]
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["base", "a", "c"]
        assert await complete_all(http, "c") == reference["c"]

        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200, r.text
        assert [await worker_loras(a) for a in addresses] == [["a"], ["a"]]
        r = await http.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora"


async def test_an_adapter_on_some_workers_only_is_not_served(served, folders):
    """Another server starting over the same workers, one of which has c loaded directly: a request of
    c could reach the other, so c is not served."""
    _, workers, _, _ = served
    async with Client(workers[0].address) as c:
        await c.load_lora("c", folders["c"])
        try:
            with ThreadServer(ClientsBackend([w.address for w in workers])) as other:
                async with httpx.AsyncClient(base_url=other.url, timeout=30) as http:
                    assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]][1:] == ["a"]
                    r = await http.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2})
                    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        finally:
            await c.unload_lora("c")


async def test_zz_a_restarted_worker_gets_the_adapters_again(served, folders, reference):
    """The second worker restarts at its address (with its own --lora a, without c, loaded here over
    HTTP): before it serves a request of c it loads c again."""
    server, workers, dirs, flags = served
    backend = server.state.backend
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["c"]})
        assert r.status_code == 200, r.text
        old = backend.clients[1].info
        workers[1].stop()
        workers[1] = start_worker(workers[1].address, dirs[1], *flags[1])
        deadline = time.monotonic() + 120  # (a polling guard against a hang: tests/test_no_timing_asserts.py)
        while backend.clients[1].info is old or not backend.clients[1].connected:  # its new handshake
            assert time.monotonic() < deadline, "the server's client did not reconnect"
            await asyncio.sleep(0.05)
        assert await worker_loras(workers[1].address) == ["a"]
        async with first_worker_busy(http):
            assert await complete_all(http, "c") == reference["c"]
        assert await worker_loras(workers[1].address) == ["a", "c"]


class _Method:
    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        out = self.fn(*args)
        return await out if asyncio.iscoroutine(out) else out


class _ReplicaHandle:
    """The calls RayBackend makes through a DeploymentHandle, on one EngineReplica in this process
    (built on the server's loop at the first call: Ray Serve awaits its async __init__)."""

    deployment_name = "engine"

    def __init__(self, config):
        self.config, self.replica = config, None
        self.info, self.complete = _Method(self._info), _Method(self._complete)

    async def _info(self):
        from slipstream.serve.ray_replica import EngineReplica

        self.replica = EngineReplica.__new__(EngineReplica)
        await self.replica.__init__(self.config)
        return self.replica.info()

    async def _complete(self, *args):
        return await self.replica.complete(*args)


async def test_ray_backend_serves_the_replicas_adapters_and_refuses_loads(folders, reference):
    pytest.importorskip("ray")
    from slipstream.serve.ray_backend import RayBackend

    class Backend(RayBackend):
        async def close(self):  # (Ray Serve would own the replica)
            await self.handle.replica.engine.close()

    with ThreadServer(Backend(_ReplicaHandle(engine_config(lora_adapters={"a": folders["a"]})), "base")) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["base", "a"]
            r = await http.post("/v1/completions", json={"model": "a", "prompt": PROMPTS[0], "max_tokens": 8,
                                                         "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference["a"][0], r.text
            r = await http.post("/v1/completions", json={"model": "c", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["c"]})
            assert r.status_code == 501 and "at start (--lora)" in r.json()["error"]["message"], r.text
