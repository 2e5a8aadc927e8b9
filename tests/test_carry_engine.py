"""The carry through the real engine on the tiny model with a test-only head (tests/carry_util.py).

* Carry rows beside free-text and JSON-schema rows give the same tokens and carried values at depth
  1 and 2, and equal a plain reference loop that recomputes the whole sequence every step (so a
  value fed late, or the token fed instead of the value, shows at both depths).
* A preempted carry row is recomputed from the values the host kept and ends as if never preempted.
* A host-read guard on the carry table (and everything computed from it): no conversion to Python
  or numpy, and no touch from a thread that is not a device stream, between steps.
"""
import asyncio
import json
import threading

import pytest
import torch

from carry_util import COORD_TOKEN, CYCLE, SIZE_TOKEN, install_heads, registered
from host_batch import Chunk, host_batch
from invariance import invariant_config
from slipstream import Engine, SamplingParams
from slipstream.errors import GrammarCompileError
from slipstream.grammar import GrammarSpec
from slipstream.models.carry_heads import CarryInput
from slipstream.models.base import KVCache
from slipstream.runtime.batch import MAX_CARRY_VALUES

CARRY_MAP = {COORD_TOKEN: 1, SIZE_TOKEN: 2}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


def prompt(salt: int, n: int) -> list[int]:
    return [1] + [3 + (salt * 37 + i * 11) % 250 for i in range(n)]


def carry_params(count: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=GrammarSpec("carry_demo", str(count)))


def mixed_requests():
    reqs = []
    for i in range(4):
        reqs.append((prompt(i, 5 + 3 * i), carry_params(3 + 2 * i, 6 + 2 * i + (i % 2))))
    for i in range(3):
        reqs.append((prompt(10 + i, 4 + i), SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)))
    reqs.append((prompt(20, 6), SamplingParams(max_tokens=12, temperature=0.0, json_schema=json.dumps(SCHEMA))))
    return reqs


def run(reqs, depth, inspect=None, **cfg):
    async def go():
        async with Engine(invariant_config(model="tiny-random", pipeline_depth=depth, max_batch_size=8, **cfg)) as e:
            runner = e._parts.runner
            install_heads(runner)
            if inspect is not None:
                inspect(e)
            outs = await asyncio.gather(*(e.complete(p, sp) for p, sp in reqs))
            return outs, runner, e.loop.planner  # (a closed engine lets go of its loop)

    with registered():
        return asyncio.run(go())


def reference(runner, prompt_ids: list[int], count: int, max_tokens: int):
    """Tokens and carried values of a carry_demo request, recomputing the whole sequence every step
    (no KV reuse, no pipelining): kind and values of each input fed explicitly."""
    model = runner.model
    cfg = model.config
    ps = 16
    inputs, kinds, values = list(prompt_ids), [0] * len(prompt_ids), [[0.0] * MAX_CARRY_VALUES] * len(prompt_ids)
    out, carried = [], {}
    for step in range(max_tokens):
        pages = list(range(1, -(-len(inputs) // ps) + 1))
        kv = KVCache(cfg, len(pages) + 1, ps, torch.float32, "cpu")
        batch, _ = host_batch([Chunk(inputs, 0, pages)], ps, runner.row_multiple)
        pad = batch.input_ids.shape[0] - len(inputs)
        batch.carry = CarryInput(torch.tensor(kinds + [0] * pad), torch.tensor(values + [[0.0] * MAX_CARRY_VALUES] * pad))
        batch.return_hidden = True
        logits, hidden = model(batch, kv)
        tok = CYCLE[step % 3] if step < count else 3 + int(logits[0, 3:cfg.vocab_size].argmax())
        kind = CARRY_MAP.get(tok, 0)
        out.append(tok)
        inputs.append(tok)
        kinds.append(kind)
        if kind:
            v = model.carry_heads.decode(kind, hidden[:1])[0].tolist()
            carried[step] = v
            values.append(v + [0.0] * (MAX_CARRY_VALUES - len(v)))
        else:
            values.append([0.0] * MAX_CARRY_VALUES)
    return out, carried


def test_carry_rows_beside_free_text_and_json_equal_depth_1_and_a_recomputing_reference():
    """(Mutants: the forward feeds the token's embedding instead of the carried value; the carry
    table is written one step late: both differ from the reference.)"""
    reqs = mixed_requests()
    one, runner, _ = run(reqs, 1)
    two, _, _ = run(reqs, 2)
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids and a.carried == b.carried
    for (p, sp), o in zip(reqs, one):
        if sp.grammar is None:
            assert o.carried is None
            continue
        count = int(sp.grammar.value)
        want_tokens, want_carried = reference(runner, p, count, sp.max_tokens)
        assert o.token_ids == want_tokens
        assert o.carried == want_carried
        assert len(o.carried) >= count  # every forced carry token carried its value
        assert all(len(o.carried[i]) == (1 if t == COORD_TOKEN else 2)
                   for i, t in enumerate(o.token_ids) if i in o.carried)
    json.loads(one[-1].text) if one[-1].finish_reason == "stop" else None


def test_a_preempted_carry_row_recomputes_with_its_carried_values():
    """A pool too small for all rows preempts; the recompute re-feeds the carried values the host
    kept (Sequence.carried). (Mutant: chunk_work without `carry`: the recompute feeds the tokens,
    the rest of the output differs.)"""
    reqs = [(prompt(i, 6 + i), carry_params(6, 20)) for i in range(5)]
    small, runner, planner = run(reqs, 2, kv_cache_tokens=96, page_size=8, prefix_caching=False)
    assert planner.num_preemptions > 0
    for (p, sp), o in zip(reqs, small):
        want_tokens, want_carried = reference(runner, p, 6, sp.max_tokens)
        assert o.token_ids == want_tokens and o.carried == want_carried


class HostReadGuard(torch.Tensor):
    """Device-only tensor: raises on a conversion to Python / numpy anywhere, and on any use from a
    thread that is not one of the CPU device's streams. Results of ops on it are guarded too, so
    nothing computed from the carry table reaches the host either, except through the step's copy
    (which lands in a plain host buffer)."""

    HOST_READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
    violations: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        on_stream = threading.current_thread().name.startswith("slipstream-")
        if name in cls.HOST_READS or not on_stream:
            if name not in ("__get__", "__set__", "__repr__"):
                cls.violations.append((name, threading.current_thread().name))
                raise AssertionError(f"host read of the carry table: {name} on {threading.current_thread().name}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_carried_values_never_pass_through_the_host_between_steps():
    """(Mutant: carry_input reads the values with .tolist() and feeds them back as a new tensor —
    the request fails with the guard's error.)"""
    HostReadGuard.violations.clear()

    def guard(engine):
        rows = engine._parts.runner.rows
        rows.carry_values = rows.carry_values.as_subclass(HostReadGuard)

    reqs = mixed_requests()
    guarded, runner, _ = run(reqs, 2, inspect=guard)
    plain, _, _ = run(reqs, 2)
    assert not HostReadGuard.violations
    assert [o.carried for o in guarded] == [o.carried for o in plain]
    assert isinstance(runner.rows.carry_values, HostReadGuard)


def test_steps_without_carry_rows_never_touch_the_carry_table():
    """No carry row: no carry step, no head call, no carry copy (nothing extra on the hot path)."""
    heads_box = []

    def inspect(engine):
        heads_box.append(engine._parts.runner.model.carry_heads)
        rows = engine._parts.runner.rows
        rows.carry_values = rows.carry_values.as_subclass(_Untouchable)

    reqs = [(prompt(i, 5), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for i in range(3)]
    outs, runner, _ = run(reqs, 2, inspect=inspect)
    assert heads_box[0].decoded == 0 and all(o.carried is None for o in outs)
    assert not any(s.staged is not None and s.staged.carry for s in runner.slots)


class _Untouchable(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in ("__get__", "__set__", "__repr__"):
            raise AssertionError(f"the carry table was used ({func}) by a step without carry rows")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_model_without_the_named_head_refuses_the_request():
    async def go():
        async with Engine(invariant_config(model="tiny-random")) as e:
            with pytest.raises(GrammarCompileError, match="needs a 'coordinate' head"):
                await e.complete([1, 5, 6], carry_params(3, 5))

    with registered():
        asyncio.run(go())
