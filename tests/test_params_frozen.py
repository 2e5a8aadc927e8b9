"""SamplingParams cannot change after it is checked (issue 27, defect 5): assignment raises, and a
value forced in behind the Struct's back is refused at submission, naming the field, while a
neighbour request runs on unharmed."""
import asyncio
import math

import msgspec
import pytest

from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams

# (field, a value the constructor refuses): what an outside review assigned after construction
MUTATIONS = [
    ("max_tokens", 0), ("max_tokens", -3), ("temperature", math.nan), ("temperature", -1.0),
    ("top_p", 0.0), ("top_k", -5), ("seed", -1), ("stop", ["ok", 1]), ("stop_token_ids", [-1]),
    ("ignore_eos", "no"), ("logprobs", "yes"), ("top_logprobs", 10_000), ("n", 0),
    ("presence_penalty", 5.0), ("repetition_penalty", 0.0), ("min_p", 2.0), ("min_tokens", 99),
    ("regex", 5),
]


@pytest.mark.parametrize("field, value", MUTATIONS)
def test_assigning_a_field_raises(field, value):
    p = SamplingParams(max_tokens=6)
    with pytest.raises(AttributeError):
        setattr(p, field, value)
    with pytest.raises(TypeError):  # nor through object.__setattr__
        object.__setattr__(p, field, value)
    assert getattr(p, field) == getattr(SamplingParams(max_tokens=6), field)


def test_sequences_are_tuples_and_a_string_stop_is_one_stop():
    p = SamplingParams(stop="ab", stop_token_ids=[3], choice=["x", "y"])
    assert p.stop == ("ab",) and p.stop_token_ids == (3,) and p.choice == ("x", "y")
    with pytest.raises(AttributeError):
        p.stop.append("c")


def test_replace_checks_again():
    p = SamplingParams(max_tokens=6)
    assert msgspec.structs.replace(p, stop="ab").stop == ("ab",)
    with pytest.raises(InvalidRequestError) as e:
        msgspec.structs.replace(p, top_logprobs=10_000)
    assert e.value.param == "top_logprobs"


@pytest.fixture(scope="module")
def cfg():
    return EngineConfig(model="tiny-random", max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=1024,
                        page_size=8, max_model_len=64)


async def test_forced_values_are_refused_at_submission_and_neighbours_run_on(cfg):
    async with Engine(cfg) as engine:
        neighbour = asyncio.create_task(engine.complete("abc", SamplingParams(max_tokens=20, temperature=0.0,
                                                                                ignore_eos=True)))
        for field, value in MUTATIONS:
            p = SamplingParams(max_tokens=6)
            msgspec.structs.force_setattr(p, field, value)
            with pytest.raises(InvalidRequestError) as e:
                await asyncio.wait_for(engine.complete("hello", p), 10)  # (max_tokens=0 used to hang)
            assert e.value.param.split("[")[0] == field, (field, e.value.param)
        out = await neighbour
        assert len(out.token_ids) == 20 and out.finish_reason == "length"
        p = SamplingParams(max_tokens=6)
        msgspec.structs.force_setattr(p, "stop", "ab")  # a bare string forced in: one stop string
        msgspec.structs.force_setattr(p, "min_tokens", 0)
        assert (await engine.complete("hello", p)).finish_reason in ("length", "stop")
        assert p.stop == ("ab",)
        s = await engine.stats()
        assert s["running"] == 0 and s["failed_steps"] == 0
