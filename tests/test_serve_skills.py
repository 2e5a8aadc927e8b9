"""POST /v1/point and /v1/detect (Moondream's cloud API shape) on `slipstream serve` with the tiny
random Idefics3 folder: the answer is the in-process `Engine.point` / `Engine.detect` dict (plus
`request_id`), sent with httpx as Moondream's clients do; every bad field is a 400 in OpenAI's error
shape naming it; a text model refuses the image; the per-endpoint counters count both."""
import asyncio
import io

import pytest
from image_util import data_url, png
from PIL import Image
from serve_util import ThreadServer, httpx

from idefics3_fixture import idefics3_folder  # noqa: F401 (fixture)
from moondream_fixture import moondream_folder  # noqa: F401 (fixture)
from slipstream import Engine, EngineConfig
from slipstream.serve import EngineBackend




PICTURES = [png(100, 150, 0), png(64, 40, 5)]
ASKS = [("point", "cat", PICTURES[0], 2), ("detect", "cat", PICTURES[0], 3), ("point", "dog", PICTURES[1], 4),
        ("detect", "box", PICTURES[1], 16)]


def config(folder) -> EngineConfig:
    return EngineConfig(model=str(folder), max_batch_size=4, max_num_batched_tokens=64, kv_cache_tokens=2048,
                        page_size=8, batch_invariant=True, seed=0)


@pytest.fixture(scope="module")
def reference(idefics3_folder):  # noqa: F811
    """The in-process Engine's answers (batch invariant: the server's batching cannot change them)."""
    async def run():
        async with Engine(config(idefics3_folder)) as engine:
            return [await getattr(engine, kind)("", obj, n, images=[Image.open(io.BytesIO(raw))])
                    for kind, obj, raw, n in ASKS]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def server(idefics3_folder):  # noqa: F811
    with ThreadServer(EngineBackend(config(idefics3_folder))) as s:
        yield s


def test_point_and_detect_answer_as_the_engine(server, reference):
    assert any(r.get("points") or r.get("objects") for r in reference)  # not only empty answers compared
    with httpx.Client(base_url=server.url, timeout=60) as http:
        got = [http.post(f"/v1/{kind}", json={"image_url": data_url(raw), "object": obj, "max_objects": n})
               for kind, obj, raw, n in ASKS]
    for r, want in zip(got, reference):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body.pop("request_id") == r.headers["x-request-id"]
        assert body == want


async def test_concurrent_requests_answer_as_the_engine(server, reference):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        got = await asyncio.gather(*(http.post(f"/v1/{kind}", json={"image_url": data_url(raw), "object": obj,
                                                                    "max_objects": n, "stream": False})
                                     for kind, obj, raw, n in ASKS * 2))
    assert [{k: v for k, v in r.json().items() if k != "request_id"} for r in got] == reference * 2


def _error(r, field):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    return err


GOOD = {"image_url": data_url(PICTURES[0]), "object": "cat"}


@pytest.mark.parametrize("kind", ["point", "detect"])
@pytest.mark.parametrize("body, field, words", [
    ({**GOOD, "image_url": data_url(b"this is not an image")}, "image_url", "not an image"),
    ({**GOOD, "image_url": data_url(PICTURES[0][:200])}, "image_url", "truncated"),
    ({**GOOD, "image_url": data_url(PICTURES[0], "text/plain")}, "image_url", "image/"),
    ({**GOOD, "image_url": "http://127.0.0.1:9/cat.png"}, "image_url", "--allowed-image-hosts"),
    ({**GOOD, "image_url": "ftp://x/cat.png"}, "image_url", "data: URL"),
    ({**GOOD, "image_url": ""}, "image_url", ""),
    ({**GOOD, "image_url": 7}, "image_url", "str"),
    ({"image_url": GOOD["image_url"]}, "object", "missing"),
    ({**GOOD, "object": ""}, "object", ""),
    ({**GOOD, "object": "   "}, "object", "blank"),
    ({**GOOD, "object": "x" * 257}, "object", ""),
    ({**GOOD, "object": ["cat"]}, "object", "str"),
    ({**GOOD, "max_objects": 0}, "max_objects", ""),
    ({**GOOD, "max_objects": 65}, "max_objects", ""),
    ({**GOOD, "max_objects": "3"}, "max_objects", "int"),
    ({**GOOD, "stream": True}, "stream", "stream=false"),
    ({**GOOD, "stream": "no"}, "stream", "bool"),
])
def test_a_bad_field_is_a_400_naming_it(server, kind, body, field, words):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        err = _error(http.post(f"/v1/{kind}", json=body), field)
        assert words in err["message"], err["message"]
        assert http.post(f"/v1/{kind}", json={**GOOD, "max_objects": 1}).status_code == 200  # nothing else affected


def test_a_body_that_is_not_an_object_is_a_400(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for raw in (b"[1]", b"not json", b"\xff"):
            r = http.post("/v1/point", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def _count(text, endpoint, status):
    for line in text.splitlines():
        if line.startswith("slipstream_http_requests_total{") and f'endpoint="{endpoint}"' in line \
                and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_each_endpoint_is_counted(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        before = http.get("/metrics").text
        http.post("/v1/point", json={**GOOD, "max_objects": 1})
        http.post("/v1/detect", json={**GOOD, "max_objects": 1})
        http.post("/v1/detect", json={"object": "cat"})
        after = http.get("/metrics").text
    assert _count(after, "point", 200) - _count(before, "point", 200) == 1
    assert _count(after, "detect", 200) - _count(before, "detect", 200) == 1
    assert _count(after, "detect", 400) - _count(before, "detect", 400) == 1
    assert 'slipstream_http_request_seconds_count{endpoint="detect"}' in after


def test_a_text_model_refuses_the_image_naming_it():
    with ThreadServer(EngineBackend(EngineConfig(model="tiny-random", kv_cache_tokens=512))) as s, \
            httpx.Client(base_url=s.url, timeout=60) as http:
        err = _error(http.post("/v1/detect", json=GOOD), "image_url")
        assert "accepts no images" in err["message"], err["message"]


# --- Moondream: the boxes come from the region heads (tests/moondream_fixture.py) ---------------------

MD_ASKS = [("point", "cat", PICTURES[0], 3), ("detect", "cat", PICTURES[0], 3), ("detect", "red box", PICTURES[1], 2)]


def test_moondream_point_and_detect_answer_as_the_engine(moondream_folder):  # noqa: F811
    cfg = EngineConfig(model=str(moondream_folder), max_batch_size=4, max_num_batched_tokens=64,
                       kv_cache_tokens=1024, page_size=8, seed=0)

    async def engine_answers():
        async with Engine(cfg) as engine:
            assert (await engine.health()).region_skills
            return [await getattr(engine, kind)("", obj, n, images=[Image.open(io.BytesIO(raw))])
                    for kind, obj, raw, n in MD_ASKS]

    want = asyncio.run(engine_answers())
    assert any(next(iter(r.values())) for r in want)
    with ThreadServer(EngineBackend(cfg)) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        got = [http.post(f"/v1/{kind}", json={"image_url": data_url(raw), "object": obj, "max_objects": n})
               for kind, obj, raw, n in MD_ASKS]
        blank = http.post("/v1/point", json={"image_url": data_url(PICTURES[0]), "object": " "})
    assert [{k: v for k, v in r.json().items() if k != "request_id"} for r in got] == want
    _error(blank, "object")
