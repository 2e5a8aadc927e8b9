"""Prefix caching as users see it (issue 29): usage.cached_tokens through the Engine, a worker and
HTTP; cache_salt; --no-prefix-caching; the prefix cache series in /metrics and stats()."""
import asyncio
import socket
import urllib.request

import pytest
from worker_util import ENGINE, ipc_address, start_worker
from worker_util import engine_config as _worker_engine_config

from slipstream import Client, Engine, SamplingParams


def engine_config(**kw):
    """The worker tests' config with prefix caching on (it is off by default for now)."""
    return _worker_engine_config(**{"prefix_caching": True, **kw})

PAGE = ENGINE["page_size"]
PROMPT = [3 + (i * 7) % 250 for i in range(5 * PAGE)]  # 40 tokens: 4 full pages reusable (the last token never)
HIT = (len(PROMPT) - 1) // PAGE * PAGE  # 32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def samples(text: str) -> dict:
    """{name: value} of the tiny-random samples (labels other than model dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.labels.get("model") == "tiny-random"}


def salted(salt=None, caching=True) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt, prefix_caching=caching)


# --- the Engine -------------------------------------------------------------------------------------


async def test_engine_usage_counts_cached_prompt_tokens_and_outputs_do_not_change():
    async with Engine(engine_config(prefix_caching=False)) as engine:
        plain = [await engine.complete(PROMPT, GREEDY) for _ in range(2)]
        assert [o.usage.cached_tokens for o in plain] == [0, 0]
        stats = await engine.stats()
        assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_hit_rate"] == 0.0
        assert "slipstream_prefix_cache_hit_rate" not in await engine.metrics_text()
    async with Engine(engine_config()) as engine:
        first = await engine.complete(PROMPT, GREEDY)
        second = await engine.complete(PROMPT, GREEDY)
        deltas = [d async for d in engine.stream(PROMPT, GREEDY)]
        stats = await engine.stats()
        values = samples(await engine.metrics_text())
    assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, HIT)
    assert second.usage.prompt_tokens == len(PROMPT) and second.usage.total_tokens == len(PROMPT) + 6
    assert [d.usage is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].usage.cached_tokens == HIT and deltas[-1].usage.completion_tokens == 6
    assert first.token_ids == second.token_ids == plain[0].token_ids  # batch invariant: caching changes nothing
    assert stats["prefix_cache_hits"] == 2 * HIT and stats["prefix_cache_queries"] >= 3 * len(PROMPT) - 3
    assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits"] / stats["prefix_cache_queries"])
    assert stats["prefix_cache_cached_pages"] >= HIT // PAGE
    assert values["slipstream_prefix_cache_hits_total"] == stats["prefix_cache_hits"]
    assert values["slipstream_prefix_cache_queries_total"] == stats["prefix_cache_queries"]
    assert values["slipstream_prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hit_rate"])
    assert values["slipstream_prefix_cache_cached_pages"] == stats["prefix_cache_cached_pages"]
    assert values["slipstream_prefix_cache_evictions_total"] == stats["prefix_cache_evictions"]


async def test_cache_salt_and_the_per_request_opt_out():
    async with Engine(engine_config()) as engine:
        async def cached(params):
            return (await engine.complete(PROMPT, params)).usage.cached_tokens

        assert await cached(salted()) == 0
        assert await cached(salted("tenant-a")) == 0  # another salt never shares the unsalted pages
        assert await cached(salted("tenant-a")) == HIT
        assert await cached(salted("tenant-b")) == 0
        assert await cached(salted(caching=False)) == 0  # opted out: computed in full
        assert await cached(salted()) == HIT


def test_router_chain_is_salted_like_the_engine():
    from slipstream.scheduler.block_hash import block_hashes, salt_key
    from slipstream.serve.prefix_router import request_hashes

    plain = request_hashes(PROMPT, PAGE, salted())
    assert plain == block_hashes(PROMPT, PAGE) == request_hashes(PROMPT, PAGE)
    a, b = request_hashes(PROMPT, PAGE, salted("a")), request_hashes(PROMPT, PAGE, salted("b"))
    assert a == block_hashes(PROMPT, PAGE, salt_key("a")) and not {*a} & {*b} and not {*a} & {*plain}


def test_ray_replica_relabels_the_hit_rate():
    from prometheus_client import CollectorRegistry

    from slipstream.metrics import PrefixCacheCollector
    from slipstream.scheduler.prefix_cache import PrefixCacheStats
    from slipstream.serve.ray_replica import relabel

    class Cache:
        def stats(self):
            return PrefixCacheStats(queries=100, hits=25, cached_pages=3, evictions=1)

    registry = CollectorRegistry()
    registry.register(PrefixCacheCollector(Cache(), "m"))
    got = {s.name: s for fam in relabel(registry.collect(), "r1") for s in fam.samples}
    assert got["slipstream_prefix_cache_hit_rate"].value == 0.25
    assert got["slipstream_prefix_cache_hit_rate"].labels == {"model": "m", "replica": "r1"}


# --- the CLI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "worker", "generate"])
def test_the_prefix_caching_flags_reach_the_config(command):
    from slipstream.cli import build_parser, engine_config as config_of

    parser = build_parser()
    extra = {"serve": [], "worker": ["--bind", "ipc:///tmp/unused.sock"], "generate": ["hello"]}[command]
    assert config_of(parser.parse_args([command, *extra])).prefix_caching is True  # on by default
    assert config_of(parser.parse_args([command, *extra, "--prefix-caching"])).prefix_caching is True
    assert config_of(parser.parse_args([command, *extra, "--no-prefix-caching"])).prefix_caching is False


# --- a worker: Client and /metrics --------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metered_worker(tmp_path_factory):
    d = tmp_path_factory.mktemp("worker")
    port = _port()
    w = start_worker(ipc_address(d), d, "--metrics-port", str(port), "--prefix-caching")
    w.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield w
    w.stop()


async def test_worker_usage_and_hit_rate_in_metrics(metered_worker):
    w = metered_worker
    prompt = [200 + i % 50 for i in range(4 * PAGE + 3)]
    async with Client(w.address, timeout=10) as client:
        first = await client.complete(prompt, GREEDY)
        second = await client.complete(prompt, GREEDY)
        deltas = [d async for d in client.stream(prompt, GREEDY)]
        # a small load of shared-prefix requests (distinct tails)
        outs = await asyncio.gather(*(client.complete(prompt[:3 * PAGE] + [5 + i, 6, 7], GREEDY) for i in range(8)))
        salted_out = await client.complete(prompt, salted("x"))
        stats = await client.stats()
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(w.metrics_url, timeout=10).read().decode())
    hit = (len(prompt) - 1) // PAGE * PAGE
    assert (first.usage.cached_tokens, second.usage.cached_tokens, deltas[-1].usage.cached_tokens) == (0, hit, hit)
    assert all(o.usage.cached_tokens == 3 * PAGE for o in outs)
    assert salted_out.usage.cached_tokens == 0
    values = samples(text)
    assert 0 < values["slipstream_prefix_cache_hit_rate"] < 1
    assert values["slipstream_prefix_cache_hits_total"] == stats["prefix_cache_hits"] >= 2 * hit + 8 * 3 * PAGE


# --- HTTP: the official openai client against `slipstream serve` ---------------------------------------

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from openai import AsyncOpenAI  # noqa: E402
from serve_util import ServeProc  # noqa: E402

TEXT = "The river rose in the night and by morning the lower fields were under water. " * 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = ServeProc(tmp_path_factory.mktemp("serve"), "--model", "tiny-random", "--page-size", str(PAGE),
                  "--batch-invariant", "--prefix-caching")
    yield s
    s.stop()


async def test_http_cached_tokens_in_usage_and_metrics(served):
    async with AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=30) as oa:
        kw = dict(model="tiny-random", max_tokens=4, temperature=0)
        first = await oa.completions.create(prompt=TEXT, **kw)
        second = await oa.completions.create(prompt=TEXT, **kw)
        msgs = [{"role": "system", "content": TEXT}, {"role": "user", "content": "hi"}]
        chat = [await oa.chat.completions.create(messages=msgs, **kw) for _ in range(2)]
        stream = await oa.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True},
                                                  **kw)
        chunks = [c async for c in stream]
        other = await oa.completions.create(prompt=TEXT, extra_body={"cache_salt": "tenant-a"}, **kw)
        # a small load: 8 requests sharing the text, different endings
        load = await asyncio.gather(*(oa.completions.create(prompt=TEXT + f" Item {i}.", **kw) for i in range(8)))
    hit = (first.usage.prompt_tokens - 1) // PAGE * PAGE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == hit > 0
    assert second.choices[0].text == first.choices[0].text
    assert chat[1].usage.prompt_tokens_details.cached_tokens > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chat[1].usage.prompt_tokens_details.cached_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # a new salt shares nothing
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in load)
    async with httpx.AsyncClient(base_url=served.url) as http:
        values = samples((await http.get("/metrics")).text)
    assert 0 < values["slipstream_prefix_cache_hit_rate"] < 1


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 257])
async def test_http_cache_salt_is_validated(served, salt):
    async with httpx.AsyncClient(base_url=served.url) as http:
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"
