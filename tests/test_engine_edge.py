"""Engine-level cases of the outside probe (issue 27, defects 8-9): a schema nested too deeply, a
grammar error naming its field, a failed start that leaks nothing."""
import pytest

from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.errors import GrammarCompileError

CFG = dict(model="tiny-random", max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=1024, page_size=8,
           max_model_len=64)


def _deep_schema(depth):
    d = {"type": "string"}
    for _ in range(depth):
        d = {"type": "array", "items": d}
    return d


async def test_a_deep_schema_and_a_bad_grammar_are_typed_and_name_their_field():
    async with Engine(EngineConfig(**CFG)) as engine:
        with pytest.raises(InvalidRequestError) as e:
            await engine.complete("x", SamplingParams(json_schema=_deep_schema(1500), max_tokens=4))
        assert e.value.param == "json_schema"
        with pytest.raises((InvalidRequestError, GrammarCompileError)) as e:  # as text: the compiler refuses it
            await engine.complete("x", SamplingParams(json_schema='{"type":"array","items":' * 1500 +
                                                      '{"type":"string"}' + "}" * 1500, max_tokens=4))
        assert e.value.param == "json_schema"
        with pytest.raises(GrammarCompileError) as e:
            await engine.complete("x", SamplingParams(regex="(", max_tokens=4))
        assert e.value.param == "regex"
        with pytest.raises(GrammarCompileError) as e:
            await engine.complete("x", SamplingParams(json_schema='{"type": 5}', max_tokens=4))
        assert e.value.param == "json_schema"
        assert len((await engine.complete("x", SamplingParams(max_tokens=2))).token_ids) == 2


async def test_a_failed_start_leaves_no_threads_behind():
    import threading

    from slipstream.errors import ModelNotFoundError

    async def attempt():
        with pytest.raises(ModelNotFoundError):
            await Engine(EngineConfig(**{**CFG, "model": "no-such-model-anywhere"})).start()

    await attempt()  # (the first may start the loop's default executor)
    before = {t for t in threading.enumerate() if not t.name.startswith("asyncio_")}
    for _ in range(3):
        await attempt()
    after = {t for t in threading.enumerate() if not t.name.startswith("asyncio_")}
    assert after <= before, sorted(t.name for t in after - before)


CRASHING_APP = """
import asyncio
from slipstream import Engine, SamplingParams

async def main():
    engine = await Engine(model="tiny-random").start()
    for _ in range(8):
        asyncio.ensure_future(engine.complete("hello", SamplingParams(max_tokens=500, ignore_eos=True)))
    await asyncio.sleep(0.3)
    raise RuntimeError("the application failed")

asyncio.run(main())
"""


def test_an_exception_escaping_asyncio_run_with_requests_in_flight_exits_cleanly(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "app.py"
    script.write_text(CRASHING_APP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(2):  # (it aborted every time before)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert "RuntimeError: the application failed" in proc.stderr
        assert "terminate called" not in proc.stderr
