"""Grammar core: bitmask packing, the spatial-skill state machines, their results, the compiler."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import numpy as np
import pytest
import torch
from grammar_helpers import allowed, drive, mask_of, smollm_tokenizer

from slipstream.errors import (
    GrammarCompileError,
    GrammarError,
    GrammarMatchError,
    GrammarTimeoutError,
    SlipstreamError,
)
from slipstream.grammar import (
    GrammarCompiler,
    GrammarSpec,
    allocate_bitmask,
    allowed_ids,
    bitmask_to_bool,
    parse_skill_output,
    register_grammar,
    set_allowed,
    unregister_grammar,
    words_for,
)
from slipstream.grammar.bitmask import clear_from
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BT = ByteTokenizer()  # ids 3..258 = bytes, EOS = 2, vocab 512
BT_EOS = 2


def bt_ids(text: str) -> list[int]:
    return BT.encode(text)


@pytest.fixture(scope="module")
def smol():
    return smollm_tokenizer()


@pytest.fixture(scope="module")
def smol_compiler(smol):
    return GrammarCompiler(smol, 49152 + 64)  # logits padded past the 49152-token vocabulary


@pytest.fixture(scope="module")
def bt_compiler():
    return GrammarCompiler(BT, 600)  # 88 padding columns, V not a multiple of 32


# --- bitmask -------------------------------------------------------------------------------


def test_error_hierarchy():
    for cls in (GrammarCompileError, GrammarTimeoutError, GrammarMatchError):
        assert issubclass(cls, GrammarError) and issubclass(cls, SlipstreamError)


def test_words_for():
    assert [words_for(v) for v in (0, 1, 31, 32, 33, 64, 49152, 49153)] == [0, 1, 1, 1, 2, 2, 1536, 1537]
    assert allocate_bitmask(3, 50).shape == (3, 2) and allocate_bitmask(3, 50).dtype == np.int32
    assert not allocate_bitmask(2, 70).any()


def test_set_allowed_roundtrip_including_sign_bit_and_last_id():
    v = 70  # not a multiple of 32
    row = allocate_bitmask(1, v)[0]
    ids = [0, 1, 31, 32, 63, 64, 69]
    set_allowed(row, ids)
    assert allowed_ids(row, v) == ids
    assert row[0] < 0  # bit 31 is the int32 sign bit
    set_allowed(row, [5])  # keeps the others
    assert allowed_ids(row, v) == sorted(ids + [5])
    with pytest.raises(IndexError):
        set_allowed(row, [96])


def test_clear_from_keeps_padding_disallowed():
    row = np.full(4, -1, dtype=np.int32)
    clear_from(row, 70)
    assert allowed_ids(row, 128) == list(range(70))
    row = np.full(4, -1, dtype=np.int32)
    clear_from(row, 64)
    assert allowed_ids(row, 128) == list(range(64))


@pytest.mark.parametrize("v", [1, 31, 32, 33, 100, 515])
def test_bitmask_to_bool_matches_numpy(v):
    rng = np.random.default_rng(v)
    w = words_for(v) + 1  # extra words past V are ignored
    masks = rng.integers(-(2**31), 2**31, size=(3, w), dtype=np.int64).astype(np.int32)
    out = bitmask_to_bool(torch.from_numpy(masks), v)
    assert out.dtype == torch.bool and out.shape == (3, v)
    for r in range(3):
        assert np.flatnonzero(out[r].numpy()).tolist() == allowed_ids(masks[r], v)


def test_bitmask_to_bool_rejects_short_masks():
    with pytest.raises(ValueError):
        bitmask_to_bool(torch.zeros((1, 1), dtype=torch.int32), 33)


@pytest.mark.cuda
def test_bitmask_to_bool_on_cuda():
    masks = torch.tensor([[-1, 5], [0, -2**31]], dtype=torch.int32)
    want = bitmask_to_bool(masks, 40)
    assert torch.equal(bitmask_to_bool(masks.cuda(), 40).cpu(), want)


# --- skills over the byte tokenizer: layouts, property test against a reference regex ----------

_V = r"(?:0|[1-9][0-9]{0,2}|10[01][0-9]|102[0-3])"


def _reference(kind: str, n: int) -> re.Pattern:
    if kind == "point":
        return re.compile(rf"(?:{_V} {_V}\n){{0,{n}}}")
    if kind == "detect":
        return re.compile(rf"(?:{_V} {_V} {_V} {_V}\n){{0,{n}}}")
    if n == 0:
        return re.compile("")
    return re.compile(rf"(?:{_V} {_V} {_V} {_V}\n(?:{_V} {_V}\n){{{min(3, n)},{n}}})?")


def _run(matcher, ids) -> bool:
    """Accept ids; after each step check the mask agrees with accept. True if all were accepted."""
    for t in ids:
        ok_by_mask = t in allowed(matcher, 600)
        try:
            matcher.accept(t)
        except GrammarMatchError:
            assert not ok_by_mask, f"mask allowed {t} but accept rejected it"
            return False
        assert ok_by_mask, f"accept took {t} but the mask forbade it"
    return True


_values = st.integers(0, 1023).map(str) | st.sampled_from(["00", "01", "1024", "9999", "", "1023"])
_lines = st.lists(st.lists(_values, min_size=1, max_size=5).map(" ".join), max_size=6)
_texts = _lines.map(lambda ls: "".join(line + "\n" for line in ls)) | st.text("0123456789 \n", max_size=24)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["point", "detect", "segment"]), n=st.integers(0, 4), text=_texts)
def test_skill_accepts_exactly_the_reference_language(bt_compiler, kind, n, text):
    m = bt_compiler.compile(GrammarSpec(kind, max_objects=n)).matcher()
    accepted = _run(m, bt_ids(text)) and _run(m, [BT_EOS])
    assert accepted == bool(_reference(kind, n).fullmatch(text)), (kind, n, text)
    if accepted:
        assert m.is_terminated()


def test_point_layout_and_masks(bt_compiler):
    m = bt_compiler.compile(GrammarSpec("point", max_objects=2)).matcher()
    digits = set(bt_ids("0123456789"))
    sp, nl = bt_ids(" ")[0], bt_ids("\n")[0]
    assert m.depends_on_previous_token is True
    assert allowed(m, 600) == digits | {BT_EOS}  # zero objects: EOS first is fine
    drive(m, bt_ids("10"), 600)
    assert allowed(m, 600) == digits | {sp}  # 100..109 are fine
    drive(m, bt_ids("2"), 600)
    assert allowed(m, 600) == set(bt_ids("0123")) | {sp}  # 1020..1023, not 1024
    drive(m, bt_ids("3"), 600)
    assert allowed(m, 600) == {sp}  # 1023 is the largest value
    drive(m, bt_ids(" 0"), 600)
    assert allowed(m, 600) == {nl}  # no leading zeros: "0" is complete
    drive(m, bt_ids("\n"), 600)
    assert allowed(m, 600) == digits | {BT_EOS}
    assert not m.is_terminated()
    drive(m, bt_ids("5 6\n"), 600)
    assert m.is_terminated()  # max_objects lines: complete
    assert allowed(m, 600) == {BT_EOS}
    with pytest.raises(GrammarMatchError, match="expected EOS"):
        m.accept(bt_ids("7")[0])
    m.accept(BT_EOS)  # EOS after completion is fine
    assert m.is_terminated()


def test_zero_objects(bt_compiler):
    for kind in ("point", "detect", "segment"):
        m = bt_compiler.compile(GrammarSpec(kind)).matcher()
        m.accept(BT_EOS)
        assert m.is_terminated()
    m = bt_compiler.compile(GrammarSpec("point", max_objects=0)).matcher()
    assert m.is_terminated() and allowed(m, 600) == {BT_EOS}


@pytest.mark.parametrize(
    "kind,text,why",
    [
        ("point", "05", "'5'"),  # leading zero
        ("point", "1024", "digit"),  # > 1023
        ("point", "1 2 ", "' '"),  # a third value on a point line
        ("point", "1\n", "'\\n'"),  # line ends after one value
        ("point", " ", "a digit"),  # separator before any digit
        ("point", "1  ", "expected a digit"),  # double space
        ("point", "1 2x", "'x'"),  # not a layout token
        ("detect", "1 2 3\n", "'\\n'"),  # detect lines have four values
    ],
)
def test_invalid_tokens_are_rejected_with_state_kept(bt_compiler, kind, text, why):
    m = bt_compiler.compile(GrammarSpec(kind)).matcher()
    ids = bt_ids(text)
    drive(m, ids[:-1], 600)
    before = allowed(m, 600)
    with pytest.raises(GrammarMatchError, match=re.escape(why)):
        m.accept(ids[-1])
    assert allowed(m, 600) == before  # a rejected token changes nothing


def test_eos_only_at_line_boundaries(bt_compiler):
    m = bt_compiler.compile(GrammarSpec("detect")).matcher()
    drive(m, bt_ids("1 2"), 600)
    with pytest.raises(GrammarMatchError):
        m.accept(BT_EOS)
    drive(m, bt_ids(" 3 4\n"), 600)
    m.accept(BT_EOS)
    assert m.is_terminated()


def test_segment_needs_bbox_then_three_points(bt_compiler):
    m = bt_compiler.compile(GrammarSpec("segment", max_objects=4)).matcher()
    drive(m, bt_ids("10 20 300 400\n"), 600)
    assert BT_EOS not in allowed(m, 600)
    drive(m, bt_ids("10 20\n30 40\n"), 600)
    assert BT_EOS not in allowed(m, 600)
    drive(m, bt_ids("50 60\n"), 600)
    assert BT_EOS in allowed(m, 600) and not m.is_terminated()
    drive(m, bt_ids("70 80\n"), 600)
    assert m.is_terminated()  # bbox + max_objects outline points


def test_rollback(bt_compiler):
    m = bt_compiler.compile(GrammarSpec("point")).matcher()
    drive(m, bt_ids("12 3"), 600)
    snapshot = allowed(m, 600)
    drive(m, bt_ids("4\n9 "), 600)
    m.rollback(4)
    assert allowed(m, 600) == snapshot
    drive(m, bt_ids("\n"), 600)
    with pytest.raises(GrammarMatchError):
        m.rollback(99)


def test_padding_columns_stay_zero(bt_compiler):
    m = bt_compiler.compile(GrammarSpec("point")).matcher()
    row = mask_of(m, 600, fill=-1)  # the matcher must overwrite the whole row
    assert row.shape == (words_for(600),)
    assert max(allowed_ids(row, 600)) < 512
    assert allowed_ids(row, 600) == sorted(set(bt_ids("0123456789")) | {BT_EOS})


def test_missing_token_is_a_compile_error():
    class NoNewline(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return "" if ids == [10 + 3] else super().decode(ids)

    with pytest.raises(GrammarCompileError, match=r"no single token for '\\n'"):
        GrammarCompiler(NoNewline(), 512).compile(GrammarSpec("point"))


# --- skills over SmolLM2's real vocabulary ---------------------------------------------------


def test_smollm_natural_tokenisation_is_the_layout(smol, smol_compiler):
    text = "512 300\n0 1023\n"
    ids = smol.encode(text)
    assert ids == [37, 33, 34, 216, 35, 32, 32, 198, 32, 216, 33, 32, 34, 35, 198]  # digits, 'Ġ', 'Ċ'
    m = smol_compiler.compile(GrammarSpec("point", "cat", max_objects=2)).matcher()
    assert allowed(m, 49216) == set(range(32, 42)) | {2}
    drive(m, ids, 49216)
    assert m.is_terminated()
    assert parse_skill_output("point", smol.decode(ids))["points"][1] == {"x": 0.0, "y": 1.0}


def test_smollm_detect_and_segment(smol, smol_compiler):
    m = smol_compiler.compile(GrammarSpec("detect", "dog")).matcher()
    drive(m, smol.encode("512 512 100 200\n"), 49216)
    drive(m, [2], 49216)
    assert m.is_terminated()
    m = smol_compiler.compile(GrammarSpec("segment", "dog")).matcher()
    drive(m, smol.encode("1 2 30 40\n1 2\n30 2\n30 40\n"), 49216)
    drive(m, [2], 49216)
    row = mask_of(m, 49216, fill=-1)
    assert allowed_ids(row, 49216) == [2]


def test_skill_cache_ignores_object_name(smol_compiler):
    a = smol_compiler.compile(GrammarSpec("point", "cat"))
    assert smol_compiler.compile(GrammarSpec("point", "dog")) is a
    assert smol_compiler.compile(GrammarSpec("point", "dog", max_objects=3)) is not a


# --- results --------------------------------------------------------------------------------


def test_parse_point():
    out = parse_skill_output("point", "1023 0\n512 256\n")
    assert out == {"points": [{"x": 1.0, "y": 0.0}, {"x": 512 / 1023, "y": 256 / 1023}]}
    assert parse_skill_output("point", "") == {"points": []}
    assert parse_skill_output("point", "1 2\n3 4") == {"points": [{"x": 1 / 1023, "y": 2 / 1023}]}  # cut line


def test_parse_detect_centre_size_to_corners_clamped():
    (obj,) = parse_skill_output("detect", "100 900 400 400\n")["objects"]
    assert obj["x_min"] == 0.0 and obj["y_max"] == 1.0  # clamped to [0, 1]
    assert obj["x_max"] == pytest.approx(300 / 1023) and obj["y_min"] == pytest.approx(700 / 1023)
    assert set(obj) == {"x_min", "y_min", "x_max", "y_max"}
    assert parse_skill_output("detect", "") == {"objects": []}


def test_parse_segment():
    out = parse_skill_output("segment", "0 1023 1023 0\n0 0\n1023 0\n512 1023\n")
    assert out["bbox"] == {"x_min": 0.0, "y_min": 0.0, "x_max": 1.0, "y_max": 1.0}
    assert out["path"] == "M 0,0 L 1,0 L 0.5005,1 Z"
    assert parse_skill_output("segment", "") == {"path": "", "bbox": None}


def test_parse_rejects_malformed():
    with pytest.raises(GrammarError, match="line 1"):
        parse_skill_output("point", "1 2 3\n")
    with pytest.raises(GrammarError, match="not integers"):
        parse_skill_output("detect", "a b c d\n")
    with pytest.raises(GrammarError, match="unknown skill"):
        parse_skill_output("caption", "x\n")


# --- compiler: cache, errors, timeout ---------------------------------------------------------


def test_unknown_kind_and_bad_spec(bt_compiler):
    with pytest.raises(GrammarCompileError, match="unknown grammar kind 'nope'.*point"):
        bt_compiler.compile(GrammarSpec("nope"))
    with pytest.raises(GrammarCompileError, match="max_objects"):
        bt_compiler.compile(GrammarSpec("point", max_objects=-1))
    with pytest.raises(GrammarCompileError, match="kind"):
        bt_compiler.compile(GrammarSpec(["point"]))  # type: ignore[arg-type]


def test_compile_is_cached_and_failures_are_not():
    calls = []

    class G:
        def matcher(self):
            raise AssertionError

    def factory(spec, tok, v):
        calls.append(spec)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return G()

    register_grammar("flaky", factory)
    try:
        c = GrammarCompiler(BT, 512)
        with pytest.raises(GrammarCompileError, match="grammar plugin 'flaky' raised RuntimeError: transient"):
            c.compile(GrammarSpec("flaky"))
        g = c.compile(GrammarSpec("flaky"))
        assert c.compile(GrammarSpec("flaky")) is g and c.cached(GrammarSpec("flaky"))
        assert len(calls) == 2
    finally:
        unregister_grammar("flaky")


def test_timeout_sync_and_async_and_one_attempt_per_spec():
    release = threading.Event()
    calls, built = [], []

    class G:
        def matcher(self):
            raise AssertionError

    def slow(spec, tok, v):
        calls.append(spec)
        release.wait(10)
        built.append(spec)
        return G()

    register_grammar("slow", slow)
    try:
        c = GrammarCompiler(BT, 512, timeout_s=0.2)
        with pytest.raises(GrammarTimeoutError, match="timed out after 0.2 s"):
            c.compile(GrammarSpec("slow"))
        assert not built  # it gave up while the build still ran (not a wall-time bound: issue 48, item 6)
        with pytest.raises(GrammarTimeoutError):
            asyncio.run(c.compile_async(GrammarSpec("slow")))
        assert len(calls) == 1  # the second wait joined the pending attempt
        release.set()
        assert c.compile(GrammarSpec("slow")) is not None  # the attempt finished and was cached
        # other specs never queue behind a stuck one
        assert c.compile(GrammarSpec("point")) is not None
    finally:
        release.set()
        unregister_grammar("slow")


async def test_compile_async_off_the_loop(bt_compiler):
    g1, g2 = await asyncio.gather(
        bt_compiler.compile_async(GrammarSpec("detect", max_objects=5)),
        bt_compiler.compile_async(GrammarSpec("detect", max_objects=5)),
    )
    assert g1 is g2
    with pytest.raises(GrammarCompileError):
        await bt_compiler.compile_async(GrammarSpec("regex", "a(b"))


def test_concurrent_compiles_share_one_build():
    calls = []

    class G:
        def matcher(self):
            raise AssertionError

    def factory(spec, tok, v):
        calls.append(1)
        time.sleep(0.05)
        return G()

    register_grammar("shared", factory)
    try:
        c = GrammarCompiler(BT, 512)
        results = []
        threads = [threading.Thread(target=lambda: results.append(c.compile(GrammarSpec("shared")))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(calls) == 1 and len({id(r) for r in results}) == 1
    finally:
        unregister_grammar("shared")
