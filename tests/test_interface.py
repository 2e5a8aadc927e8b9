"""Engine and Client are one interface (slipstream/api/interface.py): same methods, same signatures,
and the methods a Client gained answer like the Engine's against a real worker on tiny-random."""
import inspect

import pytest
from prometheus_client.parser import text_string_to_metric_families
from worker_util import engine_config, wait_pages_free, worker  # noqa: F401 (fixture)

from slipstream import Client, Engine, InvalidRequestError, SamplingParams
from slipstream.api.interface import TRANSPORT_EXTRAS, EngineAPI
from slipstream.api.protocol import HealthReply

API = sorted(n for n, _ in inspect.getmembers(EngineAPI, inspect.isfunction)
             if not n.startswith("_") or n in ("__aenter__", "__aexit__"))


def public_methods(cls) -> set[str]:
    """Methods a user calls: public functions, plus the async context manager pair."""
    return {n for n, v in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_") or n in ("__aenter__", "__aexit__")}


def describe(cls, name: str) -> tuple:
    fn = getattr(cls, name)
    return inspect.signature(fn), inspect.iscoroutinefunction(fn), inspect.isasyncgenfunction(fn)


def test_the_interface_lists_what_users_were_promised():
    assert set(API) >= {"complete", "stream", "chat", "chat_stream", "chat_prompt", "abort", "stats", "health",
                        "metrics_text", "point", "detect", "segment", "stream_skill", "start", "close"}


@pytest.mark.parametrize("cls", [Engine, Client], ids=lambda c: c.__name__)
def test_each_class_has_every_method_and_nothing_else_public(cls):
    assert public_methods(cls) - TRANSPORT_EXTRAS[cls.__name__] == set(API)


@pytest.mark.parametrize("name", API)
def test_same_signature_and_async_ness_on_both(name):
    want = describe(EngineAPI, name)
    assert describe(Engine, name) == want, f"Engine.{name}"
    assert describe(Client, name) == want, f"Client.{name}"


def test_instances_satisfy_the_protocol():
    assert isinstance(Engine(engine_config()), EngineAPI)
    assert isinstance(Client("ipc:///nonexistent"), EngineAPI)


async def test_engine_health_before_start_is_not_ready():
    h = await Engine(engine_config()).health()
    assert isinstance(h, HealthReply) and not h.ready and h.model == "tiny-random"


# --- the Client's new methods, against a worker, answer like the Engine -------------------------------


MESSAGES = [{"role": "user", "content": "Where is the car?"}]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
SEEDED = SamplingParams(max_tokens=200, temperature=1.0, seed=11)  # the random model points at 4 cars with it


async def _everything(api) -> dict:
    return {
        "chat_prompt": await api.chat_prompt(MESSAGES),
        "chat_stream": [(d.text, d.token_ids, d.finish_reason) async for d in api.chat_stream(MESSAGES, GREEDY)],
        "point": await api.point("A street.", "car", max_objects=4, params=SEEDED),
        "detect": await api.detect("A street.", "car", max_objects=4, params=SEEDED),
        "segment": await api.segment("A street.", "car", max_objects=2),
        "stream_skill": [o async for o in api.stream_skill("point", "A street.", "car", 4, SEEDED)],
    }


async def test_client_methods_give_the_engines_answers(worker):
    async with Engine(engine_config()) as engine:
        want = await _everything(engine)
        engine_health = await engine.health()
    async with Client(worker.address, timeout=10) as client:
        got = await _everything(client)
        health = await client.health()
        metrics = await client.metrics_text()
        with pytest.raises(InvalidRequestError):
            await client.chat_prompt([{"role": "robot"}])  # validated before it is sent
        with pytest.raises(InvalidRequestError):
            await client.point("x", "car", params=SamplingParams(max_tokens=0))
    assert got == want
    assert want["chat_prompt"].endswith("assistant: ") and want["chat_stream"][-1][2] is not None
    assert len(want["point"]["points"]) == 4 and want["stream_skill"] == want["point"]["points"]
    assert (health.ready, health.model, health.chat_template) == (True, engine_health.model,
                                                                   engine_health.chat_template)
    # the worker engine's registry: it counted the tokens generated above
    generated = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert generated["slipstream_generation_tokens_total"] >= sum(len(d[1]) for d in got["chat_stream"])


async def test_client_stream_skill_left_early_aborts_on_the_worker(worker):
    async with Client(worker.address, timeout=10) as client:
        skills = client.stream_skill("point", "A street.", "car", 4, SEEDED)
        first = await anext(skills)
        await skills.aclose()  # closes its stream: the worker aborts the request
        assert set(first) == {"x", "y"}
        stats = await wait_pages_free(client)
        assert stats["running"] == 0


async def test_client_loads_and_unloads_lora_adapters_in_the_worker(worker, tmp_path):
    """Client.load_lora / unload_lora run Engine.load_lora / unload_lora in the worker; a request's
    SamplingParams.lora crosses the wire; refusals come back as the Engine's error types and fields."""
    pytest.importorskip("peft")
    from lora_util import make_adapter, tiny_hf

    from slipstream.errors import LoraAdapterError, LoraNotFoundError

    folder = str(make_adapter(tiny_hf()[1], tmp_path / "a", 4, ["q_proj", "v_proj", "down_proj"], 8, False, seed=0))
    prompt, params = [1, 5, 9, 33, 70], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora="w")
    async with Engine(engine_config(lora_adapters={"w": folder})) as engine:
        want = (await engine.complete(prompt, params)).token_ids
        base = (await engine.complete(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))).token_ids
    assert want != base
    async with Client(worker.address, timeout=10) as client:
        with pytest.raises(LoraNotFoundError) as e:
            await client.complete(prompt, params)
        assert e.value.param == "lora"
        info = await client.load_lora("w", folder)
        assert (info["name"], info["rank"], info["targets"]) == ("w", 4, ["q_proj", "v_proj", "down_proj"])
        assert (await client.complete(prompt, params)).token_ids == want
        assert [t async for d in client.stream(prompt, params) for t in d.token_ids] == want
        with pytest.raises(InvalidRequestError, match="already loaded") as e:
            await client.load_lora("w", folder)
        assert e.value.param == "lora_name"
        with pytest.raises(LoraAdapterError) as e:
            await client.load_lora("x", str(tmp_path / "nothing-here"))
        assert e.value.param == "lora_path"
        assert (await client.stats())["lora"]["loaded"] == 1
        await client.unload_lora("w")
        with pytest.raises(LoraNotFoundError):
            await client.complete(prompt, params)
        with pytest.raises(LoraNotFoundError):
            await client.unload_lora("w")
