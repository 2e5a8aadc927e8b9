"""Constrained decoding through the pipelined engine on the default model.

100 random requests mixing unconstrained, point, detect, segment, JSON-schema, regex and choice,
at depth 1 and depth 2: every constrained output validates and depth 2 equals depth 1 (greedy).
"""
import asyncio
import json
import random
import re

import pytest

from engine_util import run_staggered, wait_all_free
from invariance import invariant_config
from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.errors import GrammarCompileError, GrammarError
from slipstream.grammar import GrammarSpec, parse_skill_output, register_grammar, unregister_grammar

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["colour", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,6} [0-9]{1,2}"]
CHOICES = [["Paris", "London", "Rome"], ["positive", "negative"], ["A", "B", "C", "D"]]
TOPICS = ["a cat on a sofa", "three apples", "a busy street", "a red car", "two dogs playing"]


def workload(n=40, seed=11):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        kind = rng.choice(["plain", "point", "detect", "segment", "json", "regex", "choice"])
        prompt = f"<|im_start|>user\nDescribe {topic}.<|im_end|>\n<|im_start|>assistant\n"
        if kind == "plain":
            p = SamplingParams(max_tokens=rng.randint(4, 16), temperature=0.0)
        elif kind in ("point", "detect", "segment"):
            k = rng.randint(1, 3)
            p = SamplingParams(max_tokens=80, temperature=0.0, grammar=GrammarSpec(kind, topic, k))
        elif kind == "json":
            p = SamplingParams(max_tokens=80, temperature=0.0, json_schema=rng.choice(SCHEMAS))
        elif kind == "regex":
            p = SamplingParams(max_tokens=24, temperature=0.0, regex=rng.choice(REGEXES))
        else:
            p = SamplingParams(max_tokens=12, temperature=0.0, choice=rng.choice(CHOICES))
        reqs.append((kind, prompt, p, rng.random() * 0.3))
    return reqs


def validate(kind, params, out):
    if kind == "plain":
        return
    assert out.finish_reason == "stop", (kind, out.text)  # the grammar completed within max_tokens
    if kind in ("point", "detect", "segment"):
        res = parse_skill_output(kind, out.text)
        k = params.grammar.max_objects
        if kind == "point":
            assert len(res["points"]) <= k
            assert all(0 <= p[c] <= 1 for p in res["points"] for c in ("x", "y"))
        elif kind == "detect":
            assert len(res["objects"]) <= k
            for o in res["objects"]:
                assert 0 <= o["x_min"] <= o["x_max"] <= 1 and 0 <= o["y_min"] <= o["y_max"] <= 1
        else:
            assert res["bbox"] is None or all(0 <= v <= 1 for v in res["bbox"].values())
            assert res["path"] == "" or (res["path"].startswith("M ") and res["path"].endswith(" Z"))
    elif kind == "json":
        jsonschema.validate(json.loads(out.text), params.json_schema)
    elif kind == "regex":
        assert re.fullmatch(params.regex, out.text), out.text
    else:
        assert out.text in params.choice


async def run(depth, reqs):
    async with Engine(invariant_config(model="smollm2-135m", pipeline_depth=depth, max_batch_size=32)) as engine:
        outs = await run_staggered(engine, [(prompt, params, delay) for _, prompt, params, delay in reqs])
        return outs, await wait_all_free(engine)


@pytest.fixture(scope="module")
def results():
    reqs = workload()
    return reqs, {d: asyncio.run(run(d, reqs)) for d in (1, 2)}


def test_every_constrained_output_validates(results):
    reqs, res = results
    for depth in (1, 2):
        for (kind, _, params, _), out in zip(reqs, res[depth][0]):
            validate(kind, params, out)
        stats = res[depth][1]
        assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert {r[0] for r in reqs} == {"plain", "point", "detect", "segment", "json", "regex", "choice"}


def test_depth2_equals_depth1(results):
    reqs, res = results
    for r, a, b in zip(reqs, res[1][0], res[2][0]):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), r[0]


class _RaisingGrammar:
    """A plugin whose matcher raises after a few tokens: a runtime failure mid-generation."""

    def __init__(self, fail_after):
        self.fail_after = fail_after

    def matcher(self):
        outer = self

        class M:
            depends_on_previous_token = True
            n = 0

            def fill_bitmask(self, row):
                row[:] = -1
                row[-1] = 0  # keep padding columns off (they lie past the vocabulary here)

            def accept(self, token):
                self.n += 1
                if self.n >= outer.fail_after:
                    raise RuntimeError("plugin exploded")

            def is_terminated(self):
                return False

            def rollback(self, n):
                raise NotImplementedError

        return M()


async def test_bad_grammars_fail_only_their_own_request():
    register_grammar("explodes", lambda spec, tok, v: _RaisingGrammar(3), replace=True)
    register_grammar("broken", lambda spec, tok, v: (_ for _ in ()).throw(ValueError("bad plugin")), replace=True)
    try:
        async with Engine(EngineConfig(model="smollm2-135m", pipeline_depth=2)) as engine:
            good = SamplingParams(max_tokens=8, temperature=0.0)
            calls = [
                engine.complete("Hello", good),
                engine.complete("Hello", SamplingParams(max_tokens=8, json_schema="{not json")),
                engine.complete("Hello", SamplingParams(max_tokens=8, regex="([a-z")),
                engine.complete("Hello", SamplingParams(max_tokens=8, grammar=GrammarSpec("broken"))),
                engine.complete("Hello", SamplingParams(max_tokens=8, grammar=GrammarSpec("explodes"))),
                engine.complete("Goodbye", good),
            ]
            outs = await asyncio.gather(*calls, return_exceptions=True)
            assert not isinstance(outs[0], BaseException) and len(outs[0].token_ids) == 8
            assert not isinstance(outs[5], BaseException) and len(outs[5].token_ids) == 8
            assert isinstance(outs[1], GrammarCompileError) and "schema" in str(outs[1]).lower()
            assert isinstance(outs[2], GrammarCompileError) and "regex" in str(outs[2]).lower()
            assert isinstance(outs[3], GrammarCompileError) and "bad plugin" in str(outs[3])
            assert isinstance(outs[4], GrammarError) and "plugin exploded" in str(outs[4])
            await wait_all_free(engine)
    finally:
        unregister_grammar("explodes")
        unregister_grammar("broken")
