"""LoRA adapters over HTTP (serve/lora.py): the request's `model` names an adapter, /v1/models lists
them, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, and the refusals (404 model_not_found for
an unknown adapter, 400 naming the field for a bad folder), with the official openai client and httpx."""
import asyncio

import httpx
import pytest

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from lora_util import make_adapter, make_adapters, tiny_hf  # noqa: E402
from serve_util import ThreadServer  # noqa: E402
from worker_util import engine_config  # noqa: E402

from slipstream import Engine, SamplingParams  # noqa: E402
from slipstream.serve.backend import EngineBackend  # noqa: E402

PROMPT = "Hello, adapters"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    _, hf = tiny_hf()
    root = tmp_path_factory.mktemp("serve-loras")
    out = make_adapters(hf, root)
    out["dora"] = str(make_adapter(hf, root / "dora", 4, ["q_proj"], 8, False, 0, use_dora=True))
    return out


@pytest.fixture(scope="module")
def reference(folders):
    """Greedy texts of PROMPT in-process: base, adapters a and b."""
    async def run():
        async with Engine(engine_config(lora_adapters={"a": folders["a"], "b": folders["b"]})) as engine:
            return {lora: (await engine.complete(PROMPT, SamplingParams(max_tokens=8, temperature=0, lora=lora))).text
                    for lora in (None, "a", "b")}
    return asyncio.run(run())


@pytest.fixture(scope="module")
def server(folders):
    with ThreadServer(EngineBackend(engine_config(lora_adapters={"a": folders["a"]}, max_loras=2),
                                    model_name="base")) as s:
        yield s


def client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_model_field_selects_the_adapter(server, reference):
    assert reference["a"] != reference[None]
    async with client(server) as oa:
        base = await oa.completions.create(model="base", prompt=PROMPT, max_tokens=8, temperature=0)
        a = await oa.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0)
        chunks = [c async for c in await oa.completions.create(model="a", prompt=PROMPT, max_tokens=8, temperature=0,
                                                             stream=True)]
        models = await oa.models.list()
        card = await oa.models.retrieve("a")
    assert base.choices[0].text == reference[None] and base.model == "base"
    assert a.choices[0].text == reference["a"] and a.model == "a"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference["a"]
    assert {c.model for c in chunks} == {"a"}
    assert [m.id for m in models.data] == ["base", "a"]
    assert card.id == "a" and card.model_extra["parent"] == "base"


async def test_unknown_adapter_is_404_model_not_found(server):
    async with client(server) as oa:
        with pytest.raises(openai.NotFoundError) as e:
            await oa.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.code == "model_not_found" and "'nope'" in e.value.message
    assert e.value.body["param"] == "model"


async def test_load_and_unload_over_http(server, folders, reference):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]})
        assert r.status_code == 200, r.text
        assert r.json()["rank"] == 8
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["base", "a", "b"]
        r = await http.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == reference["b"]
        # a third beyond max_loras=2: registered, read into the least recently used idle slot (a's) when named
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["c"]})
        assert r.status_code == 200, r.text
        r = await http.post("/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "c"
        r = await http.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == reference["a"]  # a read again: the same text
        for name in ("c", "b"):
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert r.status_code == 200
        r = await http.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora"


@pytest.mark.parametrize("body,param", [
    ({"lora_name": "x", "lora_path": "DORA"}, "use_dora"),
    ({"lora_name": "x", "lora_path": "/no/such/folder"}, "lora_path"),
    ({"lora_name": "a", "lora_path": "A"}, "lora_name"),  # already loaded
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_name": "", "lora_path": "A"}, "lora_name"),
])
async def test_bad_loads_are_400_naming_the_field(server, folders, body, param):
    body = {k: folders["dora"] if v == "DORA" else folders["a"] if v == "A" else v for k, v in body.items()}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        r = await http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]][:2] == ["base", "a"]
        r = await http.post("/v1/load_lora_adapter", content=b"{not json")
        assert r.status_code == 400


def test_cli_lora_flags():
    from slipstream.cli import lora_adapters
    from slipstream.errors import InvalidRequestError

    assert lora_adapters(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    assert lora_adapters(None) is None
    for bad in (["a"], ["=x"], ["a=/x", "a=/y"]):
        with pytest.raises(InvalidRequestError):
            lora_adapters(bad)


def test_cli_lora_flags_of_worker_and_connect():
    """`slipstream worker --lora` loads adapters at its start; `serve --connect` with --lora is refused
    (the workers hold the adapters; it was silently ignored)."""
    import argparse

    from slipstream.cli import lora_fields
    from slipstream.commands import serve as serve_cmd, worker as worker_cmd
    from slipstream.errors import InvalidRequestError

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    serve_cmd.register(sub)
    worker_cmd.register(sub)
    args = p.parse_args(["worker", "--bind", "ipc:///x", "--lora", "a=/x", "--max-lora-rank", "4"])
    assert lora_fields(args) == {"lora_adapters": {"a": "/x"}, "max_loras": 8, "max_lora_rank": 4}
    assert lora_fields(p.parse_args(["worker", "--bind", "ipc:///x"])) == {}
    with pytest.raises(InvalidRequestError) as e:
        serve_cmd.build_backend(p.parse_args(["serve", "--connect", "ipc:///x", "--lora", "a=/x"]))
    assert e.value.param == "lora"
