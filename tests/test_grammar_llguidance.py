"""JSON schema, regex and choice grammars through llguidance, on SmolLM2's tokenizer and the byte one."""
from __future__ import annotations

import json

import pytest
from grammar_helpers import allowed, drive, mask_of, smollm_tokenizer

from slipstream.errors import GrammarCompileError, GrammarMatchError
from slipstream.grammar import GrammarCompiler, GrammarSpec, allowed_ids, words_for
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

jsonschema = pytest.importorskip("jsonschema")

V = 49152 + 64  # logits width with padding columns past the tokenizer's 49152 ids
EOS = 2

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol():
    return smollm_tokenizer()


@pytest.fixture(scope="module")
def compiler(smol):
    return GrammarCompiler(smol, V)


def test_json_schema_accepts_a_valid_document(smol, compiler):
    m = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).matcher()
    assert m.depends_on_previous_token is True
    text = '{"name": "Bob", "age": 42}'
    ids = smol.encode(text)
    drive(m, ids[:-1], V)
    assert not m.is_terminated()
    drive(m, ids[-1:], V)
    assert m.is_terminated()  # nothing can follow the closing brace
    assert allowed(m, V) == {EOS}
    m.accept(EOS)  # the engine may still commit EOS after completion
    jsonschema.validate(json.loads(smol.decode(ids)), SCHEMA)


def test_json_mask_forbids_invalid_continuations(smol, compiler):
    m = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).matcher()
    first = allowed(m, V)
    assert first and all(smol.decode([t]).startswith("{") for t in first)
    bad = smol.encode("[")[0]
    with pytest.raises(GrammarMatchError, match="json_schema grammar: token .* is not allowed"):
        m.accept(bad)
    drive(m, smol.encode('{"name": "A", "age": '), V)  # the rejection left the matcher usable
    row = allowed(m, V)
    assert smol.encode("7")[0] in row and smol.encode('"')[0] not in row and EOS not in row


def test_regex_and_eos(smol, compiler):
    m = compiler.compile(GrammarSpec("regex", r"[a-c]+x?")).matcher()
    drive(m, smol.encode("abc"), V)
    assert not m.is_terminated() and EOS in allowed(m, V)
    drive(m, smol.encode("x"), V)
    assert m.is_terminated()
    m2 = compiler.compile(GrammarSpec("regex", r"[a-c]+x?")).matcher()
    assert EOS not in allowed(m2, V)  # the empty string does not match
    with pytest.raises(GrammarMatchError):
        m2.accept(smol.encode("d")[0])
    drive(m2, smol.encode("ab") + [EOS], V)
    assert m2.is_terminated()


def test_choice_exactly_one(smol, compiler):
    spec = GrammarSpec("choice", json.dumps(["yes", "no", "maybe so", "a.b (c)|d"]))
    for text in ("yes", "maybe so", "a.b (c)|d"):
        m = compiler.compile(spec).matcher()
        drive(m, smol.encode(text), V)
        assert m.is_terminated() or EOS in allowed(m, V), text
    for good, bad in (("a.b", "X"), ("a", "X"), ("yes", " no")):  # "." is literal; one choice only
        m = compiler.compile(spec).matcher()
        drive(m, smol.encode(good), V)
        t = smol.encode(bad)[0]
        assert t not in allowed(m, V)
        with pytest.raises(GrammarMatchError):
            m.accept(t)


@pytest.mark.parametrize(
    "spec,message",
    [
        (GrammarSpec("json_schema", '{"type": "foo"}'), "invalid JSON schema: .*foo"),
        (GrammarSpec("json_schema", '{"type": "object",'), "invalid JSON schema: not valid JSON"),
        (GrammarSpec("json_schema", "[1, 2]"), "invalid JSON schema: expected an object"),
        (GrammarSpec("regex", "a(b"), r"invalid regex: unclosed group \(in 'a\(b'\)"),
        (GrammarSpec("regex", "a{3,1}"), "invalid regex: invalid repetition count"),
        (GrammarSpec("choice", '"yes"'), "invalid choice list"),
        (GrammarSpec("choice", "[]"), "invalid choice list"),
        (GrammarSpec("choice", "[1, 2]"), "invalid choice list"),
    ],
)
def test_invalid_specs_fail_with_the_cause(compiler, spec, message):
    with pytest.raises(GrammarCompileError, match=message):
        compiler.compile(spec)


def test_padding_columns_and_row_overwrite(compiler):
    m = compiler.compile(GrammarSpec("regex", r"[a-z ]*")).matcher()
    row = mask_of(m, V, fill=-1)  # garbage in the row must not survive
    assert row.shape == (words_for(V),)
    ids = allowed_ids(row, V)
    assert ids and max(ids) < 49152
    assert not row[49152 // 32:].any()


def test_logits_narrower_than_tokenizer(smol):
    c = GrammarCompiler(smol, 49000)  # ids past the logits width can never be allowed
    m = c.compile(GrammarSpec("regex", r"[a-z ]*")).matcher()
    row = mask_of(m, 49000, fill=-1)
    assert row.shape == (words_for(49000),) and max(allowed_ids(row, 49000)) < 49000


def test_rollback(smol, compiler):
    m = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).matcher()
    ids = smol.encode('{"name": "Bob", "age": 42}')
    drive(m, ids[:4], V)
    before = allowed(m, V)
    drive(m, ids[4:], V)
    m.accept(EOS)  # counted, so rolling it back lines up
    m.rollback(len(ids) - 4 + 1)
    assert allowed(m, V) == before
    drive(m, ids[4:], V)
    assert m.is_terminated()


def test_byte_tokenizer_through_llguidance():
    bt = ByteTokenizer()
    c = GrammarCompiler(bt, 520)
    m = c.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).matcher()
    assert allowed(m, 520) == set(bt.encode("{"))
    drive(m, bt.encode('{"name": "x", "age": 7}'), 520)
    assert m.is_terminated()
    m = c.compile(GrammarSpec("choice", '["héllo", "hi"]')).matcher()
    drive(m, bt.encode("héllo"), 520)  # a multi-byte character, one byte per token
    assert m.is_terminated() or EOS in allowed(m, 520)


def test_unsupported_tokenizer():
    class Odd:
        vocab_size = 10
        eos_token_ids = (0,)

        def decode(self, ids):
            return ""

    with pytest.raises(GrammarCompileError, match="llguidance grammars need"):
        GrammarCompiler(Odd(), 10).compile(GrammarSpec("regex", "a"))


def _char_level(decoder: str | None):
    """A character-level `tokenizers` BPE (as the tiny Idefics3's) with a decoder llguidance cannot
    read from tokenizer.json (it reads byte-level and byte-fallback ones only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from slipstream.models.tokenizers.tokenizer import Tokenizer as SlipTokenizer

    special = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(special + [chr(c) for c in range(32, 127)] + ["\n", "ab", "\u2581no"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    if decoder is not None:
        backend.decoder = getattr(decoders, decoder)()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return SlipTokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)


@pytest.mark.parametrize("decoder", ["Fuse", "Metaspace"])
def test_grammars_work_with_tokenizers_llguidance_cannot_read(decoder):
    """issue 37, item 7: the tiny Idefics3's tokenizer (decoder Fuse) failed every regex, choice and
    json_schema request with "can't determine decoder type"."""
    tok = _char_level(decoder)
    n = tok.vocab_size
    c = GrammarCompiler(tok, n + 5)
    m = c.compile(GrammarSpec("regex", "[a-z]{1,6}( [a-z]{1,6})?")).matcher()
    assert allowed(m, n + 5) == {tok.token_to_id(ch) for ch in "abcdefghijklmnopqrstuvwxyz"} | {tok.token_to_id("ab")}
    drive(m, [tok.token_to_id(ch) for ch in "ab cd"], n + 5)
    assert 2 in allowed(m, n + 5)  # EOS may end it here
    m = c.compile(GrammarSpec("choice", '["yes", "no"]')).matcher()
    assert allowed(m, n + 5) == {tok.token_to_id("y"), tok.token_to_id("n")}
    m = c.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).matcher()
    drive(m, [tok.token_to_id(ch) for ch in '{"name": "x", "age": 7}'], n + 5)
    assert m.is_terminated() or 2 in allowed(m, n + 5)
    if decoder == "Metaspace":  # "\u2581no" is " no" after another token, though "no" alone
        m = c.compile(GrammarSpec("regex", "a[ x]no")).matcher()
        drive(m, [tok.token_to_id("a"), tok.token_to_id("\u2581no")], n + 5)
        assert 2 in allowed(m, n + 5)


def test_the_tiny_idefics3_tokenizer_takes_grammars():
    from idefics3_fixture import _char_tokenizer

    from slipstream.models.tokenizers.tokenizer import Tokenizer as SlipTokenizer

    backend, n = _char_tokenizer()
    tok = SlipTokenizer(backend, bos_token_id=1, eos_token_ids=[3], chat_template=None)
    m = GrammarCompiler(tok, n).compile(GrammarSpec("choice", '["yes", "no", "maybe"]')).matcher()
    drive(m, tok.encode("maybe"), n)
    assert m.is_terminated() or 3 in allowed(m, n)
