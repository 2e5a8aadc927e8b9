"""Moondream's point and detect through the Engine (the carry on the CPU device): the region grammar
(coordinate token or EOS, then the object's forced carry tokens), the reference's point/detect
prompt templates, and results built from the values the region heads decoded. Each request equals
the float64 oracle of tests/test_moondream_model.py driven by hand as the reference's loop runs
(full-sequence forward every step: x from the hidden state that chose the coordinate token, fed
back as encode_coordinate(x); y likewise; detect's size after y), at depth 1 and 2; depth 2 equals
depth 1 on a batch mixing skills with free-text and JSON-schema queries; and the region values
never pass through the host between steps."""
import asyncio
import json

import numpy as np
import pytest
import torch

from slipstream import Engine, InvalidRequestError, SamplingParams
from slipstream.grammar.region import RegionMatcher
from slipstream.models.moondream.image import preprocess
from test_carry_engine import HostReadGuard
from test_moondream_engine import config, picture
from test_moondream_model import (CFG, D, r_decode_coord, r_decode_size, r_encode_coord, r_encode_size, r_hidden,
                                  r_image, r_logits, random_weights, save_folder, tiny_sections)

pytest.importorskip("PIL.Image")
pytest.importorskip("tokenizers")

EOS, COORD = CFG.text.eos_token_ids[0], CFG.coord_token_id
IMAGES = [picture(60, 40, 0), picture(30, 30, 1), picture(44, 52, 2)]
OBJECTS = ["cat", "red box", "tree"]
MAX_OBJECTS = 3


def byte_level_tokenizer():
    """test_moondream_engine's character-level tokenizer in GPT-2's byte-level form (what llguidance
    reads, so JSON-schema rows can run beside the skills): id 0 is <|endoftext|>, then one token per
    printable character and the newline."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    shifted = {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in printable)}
    byte_char = {b: shifted.get(b, chr(b)) for b in range(256)}
    vocab = {t: i for i, t in enumerate(["<|endoftext|>"] + [byte_char[b] for b in [*range(32, 127), 10]])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return tok


@pytest.fixture(scope="module")
def md(tmp_path_factory):
    """(folder, float64 weights, tokenizer) with the point/detect templates written as ids (random
    weights: some requests stop early, some reach max_objects; a test checks both happen)."""
    weights = random_weights(CFG, seed=0)
    tok = byte_level_tokenizer()
    sections = tiny_sections(CFG)
    ids = lambda s: tok.encode(s).ids  # noqa: E731
    sections["tokenizer"]["templates"] = {
        "query": {"prefix": ids("\n\nQuestion:"), "suffix": ids("\n\nAnswer:")},
        "point": {"prefix": ids("\n\nPoint:"), "suffix": ids("\n\n")},
        "detect": {"prefix": ids("\n\nDetect:"), "suffix": ids("\n\n")}}
    folder = save_folder(tmp_path_factory.mktemp("mdskills") / "moondream-tiny",
                         {k: v.float() for k, v in weights.items()}, "current", sections)
    tok.save(str(folder / "tokenizer.json"))
    return folder, weights, tok


def skill_ids(tok, kind, obj):
    prefix = {"point": "\n\nPoint:", "detect": "\n\nDetect:"}[kind]
    return ([CFG.text.bos_token_id] + [CFG.text.image_token_id] * CFG.vision.tokens_per_image
            + tok.encode(prefix).ids + tok.encode(" " + obj).ids + tok.encode("\n\n").ids)


def oracle(weights, tok, image, kind, obj, max_objects=MAX_OBJECTS):
    """The reference's point/detect loop in float64, the whole sequence recomputed at every step; the
    LM's choice is between the coordinate token and EOS (argmax over the two, EOS on a tie)."""
    w = {k: v.float().to(D) for k, v in weights.items()}
    processed = preprocess(image, CFG.vision)
    feats = r_image(processed.pixel_values.to(D), processed.tiling, w, CFG)
    ids = skill_ids(tok, kind, obj)
    seq = list(w["text.wte"][torch.tensor(ids)].clone())
    seq[1:1 + feats.shape[0]] = list(feats)

    def last():
        return r_hidden(torch.stack(seq), w, CFG, CFG.prefix_len)[-1]

    h, out = last(), []
    while len(out) < max_objects:
        logits = r_logits(h, w)
        if logits[EOS] >= logits[COORD]:
            break
        x = r_decode_coord(h, w)
        seq.append(r_encode_coord(x, w))
        h = last()
        y = r_decode_coord(h, w)
        seq.append(r_encode_coord(y, w))
        h = last()
        if kind == "point":
            out.append({"x": x, "y": y})
            continue
        wd, ht = r_decode_size(h, w)
        seq.append(r_encode_size([wd, ht], w))
        h = last()
        out.append({"x_min": x - wd / 2, "y_min": y - ht / 2, "x_max": x + wd / 2, "y_max": y + ht / 2})
    return {"points" if kind == "point" else "objects": out}


def same_result(got, want):
    (key, objs), = want.items()
    assert list(got) == [key] and len(got[key]) == len(objs)
    for g, o in zip(got[key], objs):
        assert g.keys() == o.keys()
        for k in o:
            assert g[k] == pytest.approx(o[k], rel=1e-5, abs=1e-6), (k, g, o)


CASES = [(kind, i) for kind in ("point", "detect") for i in range(len(IMAGES))]


@pytest.fixture(scope="module")
def want(md):
    _, weights, tok = md
    return {(kind, i): oracle(weights, tok, IMAGES[i], kind, OBJECTS[i]) for kind, i in CASES}


def skills(folder, depth, extra=(), inspect=None, **kw):
    """Every CASE through Engine.point / detect, concurrently with `extra` (prompt, params, image)."""
    async def go():
        async with Engine(config(folder, depth, max_batch_size=8, **kw)) as e:
            if inspect is not None:
                inspect(e)
            calls = [(e.point if kind == "point" else e.detect)("", OBJECTS[i], MAX_OBJECTS, images=[IMAGES[i]])
                     for kind, i in CASES]
            calls += [e.complete(p, sp, images=[im]) for p, sp, im in extra]
            out = await asyncio.gather(*calls)
            return out[:len(CASES)], out[len(CASES):]
    return asyncio.run(go())


def test_the_oracle_finds_objects_and_stops_early(want):
    """The cases exercise both endings: max_objects reached, and EOS chosen before it."""
    counts = [len(next(iter(r.values()))) for r in want.values()]
    assert max(counts) == MAX_OBJECTS and min(counts) < MAX_OBJECTS and sum(counts) >= 6, counts


@pytest.mark.parametrize("depth", [1, 2])
def test_point_and_detect_equal_the_oracle(md, want, depth):
    results, _ = skills(md[0], depth)
    for (kind, i), got in zip(CASES, results):
        same_result(got, want[(kind, i)])


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
TEXT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
JSON = SamplingParams(max_tokens=12, temperature=0.0, json_schema=json.dumps(SCHEMA))
EXTRA = [("What is in the picture?", TEXT, IMAGES[0]), ("Where?", TEXT, IMAGES[1]),
         ("How many?", JSON, IMAGES[2])]


def test_depth_2_equals_depth_1_beside_free_text_and_json_schema_rows(md, want):
    """Skills and plain queries in one batch: the skills equal the oracle at both depths, every output
    is the same at depth 1 and 2, and the free-text answers are the oracle's greedy tokens (the carry
    rows leave their neighbours alone)."""
    from test_moondream_engine import oracle_greedy

    folder, weights, tok = md
    one, one_extra = skills(folder, 1, EXTRA)
    two, two_extra = skills(folder, 2, EXTRA)
    assert one == two
    assert [(o.token_ids, o.carried) for o in one_extra] == [(o.token_ids, o.carried) for o in two_extra]
    for (kind, i), got in zip(CASES, two):
        same_result(got, want[(kind, i)])
    for (q, _, im), o in zip(EXTRA[:2], two_extra):
        assert o.token_ids == oracle_greedy(weights, tok, im, q)[0] and o.carried is None
    assert two_extra[2].finish_reason == "stop" and set(json.loads(two_extra[2].text)) == {"n"}


def spy_on_split(records):
    """An `inspect` for skills(): per launch with a constrained row, (sequences sampled early with how
    many samples they had pending, sequences sampled late), from the engine loop's own split."""
    def inspect(engine):
        constraints = engine.loop.constraints
        split = constraints.split

        def spy(seqs):
            early, late = split(seqs)
            records.append(([(seqs[i], seqs[i].pending_samples) for i in early], [seqs[i] for i in late]))
            return early, late
        constraints.split = spy
    return inspect


def test_region_rows_are_sampled_at_launch_at_depth_2(md, want):
    """The region grammar's mask is a function of the output index (EOS ends the request), so at depth
    2 its rows are sampled right behind the forward, also while their previous token is still on the
    device (2 samples pending), never in finalize; a JSON-schema row beside them keeps the late path.
    (Mutant: constraints._by_index always False, the old late path: region rows show up late.)"""
    records = []
    results, extra = skills(md[0], 2, EXTRA, inspect=spy_on_split(records))
    region = RegionMatcher
    late = [seq for _, late in records for seq in late]
    assert not [seq for seq in late if isinstance(seq.matcher, region)]
    assert late  # the JSON-schema row
    pipelined = [n for early, _ in records for seq, n in early if isinstance(seq.matcher, region) and n == 2]
    assert len(pipelined) >= len(CASES)
    for (kind, i), got in zip(CASES, results):
        same_result(got, want[(kind, i)])


def test_a_region_request_with_stop_strings_keeps_the_late_path(md, want):
    """With stop strings the tick does not end the request at the grammar's completion (the output stage
    does), so an EOS before max_objects may be followed by more samples: the index mask would force a
    coordinate there and the matcher would fail the request. Such rows are sampled late, and the results
    are unchanged. (Mutant: ends_with_grammar=True for every request: the early-EOS cases fail with a
    GrammarMatchError.)"""
    records = []

    async def go():
        async with Engine(config(md[0], 2, max_batch_size=8)) as e:
            spy_on_split(records)(e)
            sp = SamplingParams(temperature=0.0, stop=["never in the output"])
            return await asyncio.gather(*[(e.point if kind == "point" else e.detect)(
                "", OBJECTS[i], MAX_OBJECTS, sp, images=[IMAGES[i]]) for kind, i in CASES])
    for (kind, i), got in zip(CASES, asyncio.run(go())):
        same_result(got, want[(kind, i)])
    assert not [seq for early, _ in records for seq, _ in early if seq.matcher is not None]


def test_region_index_masks_follow_the_matcher():
    """mask_for_output_index(i) is the mask fill_bitmask gives after i accepted tokens, on every path
    (EOS at an object's start, max_objects reached); it reads no state, and accept still checks each
    token against the committed state."""
    from slipstream.errors import GrammarMatchError
    from slipstream.grammar.bitmask import words_for
    from slipstream.grammar.region import RegionGrammar

    V, coord, size, eos = 70, 5, 6, 2
    for kind, path in [("point", [coord] * 4), ("detect", [coord, coord, size] * 2),
                       ("detect", [coord, coord, size, eos]), ("point", [eos])]:
        m = RegionGrammar(kind, 2, coord, size, [eos], V).matcher()
        probe = RegionGrammar(kind, 2, coord, size, [eos], V).matcher()
        # after max_objects objects the next index allows EOS only (after an EOS nothing follows)
        for i in range(len(path) + (path[-1] != eos)):
            a, b = np.full(words_for(V), -1, np.int32), np.full(words_for(V) + 1, -1, np.int32)
            m.fill_bitmask(a)
            probe.mask_for_output_index(i, b)
            assert (a == b[:-1]).all() and b[-1] == 0, (kind, path, i)
            if i < len(path):
                m.accept(path[i])
        assert m.is_terminated() and probe._history == [] and not probe.is_terminated()
    m = RegionGrammar("detect", 2, coord, size, [eos], V).matcher()
    m.accept(coord)
    with pytest.raises(GrammarMatchError):
        m.accept(eos)  # y is forced: the index mask's promise is checked at commit


def test_region_values_never_pass_through_the_host_between_steps(md, want):
    """The carry table guarded (tests/test_carry_engine.py's HostReadGuard: no conversion to Python or
    numpy, no use off the device's stream threads) through Moondream detect and point requests.
    (Mutant: runtime/step/carry.py's carry_input reading the values with .tolist(): the guard fails.)"""
    HostReadGuard.violations.clear()

    def guard(engine):
        rows = engine._parts.runner.rows
        rows.carry_values = rows.carry_values.as_subclass(HostReadGuard)

    results, _ = skills(md[0], 2, inspect=guard)
    assert not HostReadGuard.violations
    for (kind, i), got in zip(CASES, results):
        same_result(got, want[(kind, i)])


def test_region_skill_refusals(md):
    async def go():
        async with Engine(config(md[0], 1)) as e:
            assert (await e.health()).region_skills
            with pytest.raises(InvalidRequestError, match="empty prompt") as err:
                await e.point("Find it", "cat", images=[IMAGES[0]])
            assert err.value.param == "prompt"
            with pytest.raises(InvalidRequestError, match="one image") as err:
                await e.detect("", "cat")
            assert err.value.param == "images"
            with pytest.raises(InvalidRequestError, match="object name") as err:
                await e.detect("", " ", images=[IMAGES[0]])
            assert err.value.param == "object"
            # a query is still a query (the region grammar only for point/detect specs)
            out = await e.complete("What?", TEXT, images=[IMAGES[0]])
            assert out.carried is None and len(out.token_ids) == TEXT.max_tokens
    asyncio.run(go())


def test_stream_skill_yields_each_object(md, want):
    async def go():
        async with Engine(config(md[0], 2)) as e:
            return [o async for o in e.stream_skill("detect", "", OBJECTS[0], MAX_OBJECTS, images=[IMAGES[0]])]
    same_result({"objects": asyncio.run(go())}, want[("detect", 0)])


async def test_a_client_gets_the_engines_regions_over_the_worker(md, want, tmp_path):
    """point/detect through a worker: the Client takes the region path from the health reply, and the
    carried values (integer keys) survive the wire."""
    from worker_util import free_tcp_address, start_worker

    from slipstream import Client

    w = start_worker(free_tcp_address(), tmp_path, "--model", str(md[0]), "--log-level", "warning")
    try:
        async with Client(w.address, timeout=30) as client:
            assert client.info.region_skills
            for kind, i in CASES:
                call = client.point if kind == "point" else client.detect
                same_result(await call("", OBJECTS[i], MAX_OBJECTS, images=[IMAGES[i]]), want[(kind, i)])
    finally:
        w.stop()
