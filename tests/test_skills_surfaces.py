"""point / detect / segment with an image through every Python entry on the tiny random Idefics3:
`slipstream.LLM` (sync) and the worker `Client` give the dicts `Engine` gives in process; each
entry refuses a bad argument naming it (slipstream/api/skills.py `check_skill_args`)."""
import asyncio

import pytest
from image_util import picture
from worker_util import engine_config, free_tcp_address, start_worker

from idefics3_fixture import idefics3_folder  # noqa: F401 (fixture)
from moondream_fixture import moondream_folder  # noqa: F401 (fixture)
from slipstream import LLM, Client, Engine, InvalidRequestError

pytest.importorskip("transformers")



PICS = [picture(100, 150, 0), picture(64, 40, 5)]
ASKS = [("point", "cat", 0, 2), ("detect", "cat", 0, 3), ("segment", "cat", 1, 4), ("detect", "box", 1, 16)]


@pytest.fixture(scope="module")
def reference(idefics3_folder):  # noqa: F811
    async def run():
        async with Engine(engine_config(model=str(idefics3_folder))) as engine:
            return [await getattr(engine, kind)("", obj, n, images=[PICS[i]]) for kind, obj, i, n in ASKS]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def llm(idefics3_folder):  # noqa: F811
    with LLM(engine_config(model=str(idefics3_folder))) as llm:
        yield llm


def test_llm_skills_answer_as_the_engine(llm, reference):
    assert any(r.get("points") or r.get("objects") or r.get("path") for r in reference)
    assert [getattr(llm, kind)("", obj, n, images=[PICS[i]]) for kind, obj, i, n in ASKS] == reference


@pytest.mark.parametrize("call, field", [
    (lambda llm: llm.point("", "", images=PICS[:1]), "object"),
    (lambda llm: llm.point("", None, images=PICS[:1]), "object"),
    (lambda llm: llm.detect(3, "cat", images=PICS[:1]), "prompt"),
    (lambda llm: llm.detect("", "cat", 0, images=PICS[:1]), "max_objects"),
    (lambda llm: llm.detect("", "cat", True, images=PICS[:1]), "max_objects"),
    (lambda llm: llm.segment("", "cat", 5000, images=PICS[:1]), "max_objects"),
    (lambda llm: llm.point("", "cat", params="greedy", images=PICS[:1]), "params"),
    (lambda llm: llm.point("", "cat", images=[b"not an image"]), "images[0]"),
    (lambda llm: llm.point("", "cat", images=PICS[:1] * 9), "images[8]"),
])
def test_llm_skills_refuse_naming_the_field(llm, call, field):
    with pytest.raises(InvalidRequestError) as e:
        call(llm)
    assert e.value.param == field, e.value
    assert llm.point("", "cat", 1, images=PICS[:1])["points"] is not None  # the LLM goes on


def test_llm_skills_refuse_an_image_on_a_text_model():
    with LLM(engine_config()) as llm:
        with pytest.raises(InvalidRequestError, match="accepts no images") as e:
            llm.detect("", "cat", images=PICS[:1])
        assert e.value.param == "images[0]"
        assert set(llm.detect("", "cat", 1)) == {"objects"}  # text only: still served


async def test_client_skills_answer_as_the_engine(idefics3_folder, reference, tmp_path):  # noqa: F811
    w = start_worker(free_tcp_address(), tmp_path, "--model", str(idefics3_folder), "--log-level", "warning")
    try:
        async with Client(w.address, timeout=60) as client:
            got = [await getattr(client, kind)("", obj, n, images=[PICS[i]]) for kind, obj, i, n in ASKS]
            streamed = [o async for o in client.stream_skill("detect", "", "box", 16, images=[PICS[1]])]
            with pytest.raises(InvalidRequestError) as e:
                await client.point("", "cat", 0, images=PICS[:1])
    finally:
        w.stop()
    assert got == reference
    assert streamed == reference[3]["objects"]
    assert e.value.param == "max_objects"


MD_ASKS = [("point", "cat", 0, 3), ("detect", "cat", 0, 3), ("detect", "red box", 1, 2)]


def test_moondream_skills_through_llm_and_client_answer_as_the_engine(moondream_folder, tmp_path):  # noqa: F811
    """The region-head path (Moondream): the same dicts through LLM and a worker's Client."""
    cfg = engine_config(model=str(moondream_folder), kv_cache_tokens=1024)

    async def engine_answers():
        async with Engine(cfg) as engine:
            return [await getattr(engine, kind)("", obj, n, images=[PICS[i]]) for kind, obj, i, n in MD_ASKS]

    want = asyncio.run(engine_answers())
    assert any(next(iter(r.values())) for r in want)
    with LLM(cfg) as llm:
        assert [getattr(llm, kind)("", obj, n, images=[PICS[i]]) for kind, obj, i, n in MD_ASKS] == want
        with pytest.raises(InvalidRequestError) as e:
            llm.detect("", "cat", 0, images=PICS[:1])
        assert e.value.param == "max_objects"

    async def client_answers(address):
        async with Client(address, timeout=60) as client:
            assert (await client.health()).region_skills
            return [await getattr(client, kind)("", obj, n, images=[PICS[i]]) for kind, obj, i, n in MD_ASKS]

    w = start_worker(free_tcp_address(), tmp_path, "--model", str(moondream_folder), "--kv-cache-tokens", "1024",
                     "--log-level", "warning")
    try:
        assert asyncio.run(client_answers(w.address)) == want
    finally:
        w.stop()
