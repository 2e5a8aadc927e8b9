"""slipstream on Ray Serve: a local 2-CPU Ray cluster, two tiny-random engine replicas (num_cpus=1
each) behind the OpenAI ingress, driven over real HTTP. One cluster for the module (~20 s to start);
the replica-kill test runs last. Skipped without `ray[serve]` (the `ray` extra)."""
import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_util import free_port
from worker_util import engine_config

httpx = pytest.importorskip("httpx")

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from slipstream import Engine, SamplingParams  # noqa: E402
from slipstream.serve.sse import parse  # noqa: E402

pytestmark = pytest.mark.ray
APP = "slipstream"
PAGE = 8  # engine_config's page_size
SHARED = " ".join(f"word{i}" for i in range(30))  # a long common preamble: many full pages


@pytest.fixture(scope="module")
def cluster():
    from slipstream.serve.ray_app import RayServeOptions, build_app

    root = str(Path(__file__).resolve().parents[1])  # the workers import this checkout's slipstream
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, saved) if p)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(engine_config(), RayServeOptions(replicas=2, num_cpus=1, imbalance_threshold=64)),
                  name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of one in-process Engine with the replicas' settings."""
    async def run(prompts):
        async with Engine(engine_config()) as engine:
            greedy = SamplingParams(max_tokens=8, temperature=0.0)
            return [o.text for o in await asyncio.gather(*(engine.complete(p, greedy) for p in prompts))]
    return run


async def replica_stats(http) -> dict[str, dict]:
    stats = (await http.get("/health")).json()["stats"]
    return {s["replica"]: s for s in stats["replicas"] if "replica" in s}


def served_by(stats: dict[str, dict], request_id: str) -> str:
    owners = [r for r, s in stats.items() if request_id in s["recent_request_ids"]]
    assert len(owners) == 1, (request_id, owners)
    return owners[0]


async def complete(http, prompt, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return await http.post("/v1/completions", json=body, timeout=60)


async def test_greedy_outputs_equal_a_single_engine(cluster, reference):
    prompts = [f"{i * 7919} is where the quick brown fox starts" for i in range(12)]  # no shared first page
    want = await asyncio.to_thread(asyncio.run, reference(prompts))
    async with httpx.AsyncClient(base_url=cluster) as http:
        plain = await asyncio.gather(*(complete(http, p) for p in prompts))
        streamed = await asyncio.gather(*(complete(http, p, stream=True) for p in prompts))
        stats = await replica_stats(http)
    assert [r.json()["choices"][0]["text"] for r in plain] == want
    texts = ["".join(e["choices"][0]["text"] for e in parse(r.text)[:-1]) for r in streamed]
    assert texts == want
    assert len(stats) == 2 and all(s["requests_started"] > 0 for s in stats.values())  # both replicas served


async def test_shared_prefix_requests_land_on_the_same_replica(cluster):
    async with httpx.AsyncClient(base_url=cluster) as http:
        groups = {}
        for g in range(5):
            ids = []
            for k in range(3):  # sequential: the first request of a group teaches the router its prefix
                r = await complete(http, f"group {g}. {SHARED} question {k}?")
                assert r.status_code == 200
                ids.append(r.json()["id"])  # (Ray's proxy adds its own x-request-id header beside ours)
            groups[g] = ids
        stats = await replica_stats(http)
    for g, ids in groups.items():
        assert len({served_by(stats, i) for i in ids}) == 1, f"group {g} was split across replicas"


async def test_cancelled_stream_aborts_on_its_replica(cluster):
    async with httpx.AsyncClient(base_url=cluster, timeout=30) as http:
        before = await replica_stats(http)
        body = {"prompt": "a long answer please", "max_tokens": 3500, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            events, lines = [], r.aiter_lines()  # held: a dropped iterator is closed, closing the response
            async for line in lines:
                if line.startswith("data: "):
                    events.append(parse(line + "\n\n")[0])
                if len(events) == 3:
                    break
            rid = events[0]["id"]
            during = await replica_stats(http)
            owner = served_by(during, rid)
            assert during[owner]["running"] == 1 and during[owner]["kv_pages_free"] < during[owner]["kv_pages_total"], \
                ({k: v for k, v in during[owner].items() if k != "recent_request_ids"}, events)
        # leaving the `stream` block closed the connection: the replica must abort (3500 tokens take ~7 s)
        for _ in range(40):
            after = (await replica_stats(http))[owner]
            if after["running"] == 0 and after["kv_pages_free"] == after["kv_pages_total"]:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the replica kept the request: {after}")
    assert after["finished"].get("abort", 0) == before[owner]["finished"].get("abort", 0) + 1


async def test_metrics_carry_a_replica_label(cluster):
    async with httpx.AsyncClient(base_url=cluster) as http:
        await complete(http, "metrics please")
        text = (await http.get("/metrics")).text
        replicas = set(await replica_stats(http))
    families = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition: parses
    labelled = {s.labels.get("replica") for f in families.values() for s in f.samples if f.name.startswith(
        "slipstream_") and not f.name.startswith("slipstream_http")}
    assert labelled == replicas  # every engine sample names its replica, both replicas present
    assert "slipstream_http_requests" in families  # the ingress's own HTTP metrics too


async def test_zz_killed_replica_fails_in_flight_then_survivor_serves(cluster):
    """Last in the module: it kills a replica (Serve starts a replacement in the background)."""
    async with httpx.AsyncClient(base_url=cluster, timeout=60) as http:
        body = {"prompt": "keep going", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    rid = parse(line + "\n\n")[0]["id"]
                    break
            stats = await replica_stats(http)
            victim = served_by(stats, rid)
            (survivor,) = set(stats) - {victim}
            actor = ray.get_actor(f"SERVE_REPLICA::{APP}#SlipstreamEngine#{victim}", namespace="serve")
            ray.kill(actor, no_restart=True)
            rest = "\n\n".join([line async for line in lines])
        errors = [e for e in parse(rest) if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1, rest[-500:]
        err = errors[0]["error"]
        assert err["type"] == "service_unavailable" and f"engine replica {victim} died" in err["message"]
        # new requests go to the survivor (the replacement replica may also be up by now: not the victim)
        for i in range(4):
            r = await complete(http, f"after the kill {i}")
            assert r.status_code == 200, r.text
            stats = await replica_stats(http)
            assert victim not in stats and served_by(stats, r.json()["id"]) != victim
        assert survivor in stats
