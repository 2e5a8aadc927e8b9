"""Grammar plugins: in-process registration, discovery through the `slipstream.grammars` entry-point
group (the example plugin in examples/grammar_plugin, installed as a dist-info on sys.path, exactly
what `pip install` writes, without running pip), and failure isolation."""
from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from grammar_helpers import allowed, smollm_tokenizer

from slipstream.errors import GrammarCompileError, GrammarMatchError
from slipstream.grammar import (
    ENTRY_POINT_GROUP,
    GrammarCompiler,
    GrammarSpec,
    available_kinds,
    bitmask_to_bool,
    register_grammar,
    unregister_grammar,
)
from slipstream.grammar.registry import PluginGrammar
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grammar_plugin"
BT = ByteTokenizer()


@pytest.fixture
def installed_example(tmp_path, monkeypatch):
    """Install examples/grammar_plugin the way pip would, minus pip: a dist-info carrying the entry points
    its pyproject.toml declares, plus the source folder on sys.path (an editable install's .pth)."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    eps = project["entry-points"][ENTRY_POINT_GROUP]
    dist = tmp_path / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE))
    importlib.invalidate_caches()
    yield eps
    for name in eps:
        unregister_grammar(name)  # forget the cached load
    sys.modules.pop("slipstream_charset_grammar", None)
    importlib.invalidate_caches()


def test_example_plugin_via_entry_point_end_to_end(installed_example):
    """Discover, compile, and decode with masked sampling until EOS: only A/C/G/T text comes out."""
    assert installed_example == {"charset": "slipstream_charset_grammar:build"}
    assert "charset" in available_kinds()
    tok = smollm_tokenizer()
    v = 49152 + 64
    grammar = GrammarCompiler(tok, v).compile(GrammarSpec("charset", "ACGT"))
    assert isinstance(grammar, PluginGrammar)
    m = grammar.matcher()
    assert m.depends_on_previous_token is False  # the flag is passed through
    gen = torch.Generator().manual_seed(0)
    out: list[int] = []
    row = np.zeros((1, (v + 31) // 32), dtype=np.int32)
    for step in range(40):
        m.fill_bitmask(row[0])
        ok = bitmask_to_bool(torch.from_numpy(row), v)[0]
        logits = torch.randn(v, generator=gen)
        logits[tok.eos_token_ids[0]] = -1.0 if step < 12 else 99.0  # end after a dozen tokens
        token = int(torch.where(ok, logits, float("-inf")).argmax())
        m.accept(token)
        out.append(token)
        if m.is_terminated():
            break
    assert m.is_terminated() and out[-1] == tok.eos_token_ids[0] and len(out) == 13
    text = tok.decode(out[:-1])
    assert text and set(text) <= set("ACGT"), text


def test_broken_entry_point_fails_with_its_name(tmp_path, monkeypatch):
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbroken = no_such_module_xyz:build\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        with pytest.raises(GrammarCompileError, match="grammar plugin 'broken' failed to load.*ModuleNotFoundError"):
            GrammarCompiler(BT, 512).compile(GrammarSpec("broken"))
    finally:
        importlib.invalidate_caches()


def test_register_grammar_in_process():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from slipstream_charset_grammar import build

        register_grammar("dna", build)
        with pytest.raises(ValueError, match="already registered"):
            register_grammar("dna", build)
        with pytest.raises(ValueError, match="built-in"):
            register_grammar("json_schema", build)
        m = GrammarCompiler(BT, 512).compile(GrammarSpec("dna", "AC")).matcher()
        assert allowed(m, 512) == set(BT.encode("AC")) | {2}
        with pytest.raises(GrammarMatchError, match="charset grammar"):
            m.accept(BT.encode("G")[0])
        with pytest.raises(NotImplementedError):
            m.rollback(1)
        with pytest.raises(GrammarCompileError, match="value must list"):  # a plugin's own GrammarError
            GrammarCompiler(BT, 512).compile(GrammarSpec("dna", ""))
    finally:
        unregister_grammar("dna")
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("slipstream_charset_grammar", None)


class _Raising:
    """A plugin whose grammar/matcher raises in the method named by `where`."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, spec, tokenizer, vocab_size):
        if self.where == "factory":
            raise ValueError("schema too clever")
        return self

    def matcher(self):
        if self.where == "matcher":
            raise KeyError("state")
        return self

    depends_on_previous_token = True

    def fill_bitmask(self, row):
        if self.where == "fill_bitmask":
            raise RuntimeError("mask boom")
        row[:] = -1  # also writes padding bits, which the adapter must clear

    def accept(self, token):
        if self.where == "accept":
            raise IndexError("accept boom")

    def is_terminated(self):
        return False


@pytest.mark.parametrize(
    "where,exc,message",
    [
        ("factory", GrammarCompileError, "grammar plugin 'boom' raised ValueError: schema too clever"),
        ("matcher", GrammarMatchError, "grammar plugin 'boom' raised KeyError: 'state'"),
        ("fill_bitmask", GrammarMatchError, r"grammar plugin 'boom' raised RuntimeError: mask boom \(in fill_bitmask\)"),
        ("accept", GrammarMatchError, r"grammar plugin 'boom' raised IndexError: accept boom \(in accept\)"),
    ],
)
def test_raising_plugin_fails_with_a_named_error(where, exc, message):
    register_grammar("boom", _Raising(where))
    try:
        with pytest.raises(exc, match=message):
            m = GrammarCompiler(BT, 512).compile(GrammarSpec("boom")).matcher()
            m.fill_bitmask(np.zeros(16, dtype=np.int32))
            m.accept(5)
    finally:
        unregister_grammar("boom")


def test_plugin_padding_bits_are_cleared():
    register_grammar("boom", _Raising("nowhere"))
    try:
        m = GrammarCompiler(BT, 600).compile(GrammarSpec("boom")).matcher()
        row = np.zeros(19, dtype=np.int32)
        m.fill_bitmask(row)  # the plugin sets every bit
        assert allowed(m, 600) == set(range(512))  # ids 512..599 are padding
        with pytest.raises(NotImplementedError):
            m.rollback(1)
    finally:
        unregister_grammar("boom")


class _ByIndex(_Raising):
    """A plugin declaring the optional mask_by_output_index capability (grammar/base.py)."""

    mask_by_output_index = True

    def mask_for_output_index(self, index, row):
        row[:] = -1  # padding bits too, which the adapter must clear
        self.asked = index


def test_plugin_mask_by_output_index_is_passed_through():
    """The adapter declares the capability only when the plugin does, and clears padding as for
    fill_bitmask (without it the engine samples the plugin's rows late, as before)."""
    for grammar, declared in [(_Raising("nowhere"), False), (_ByIndex("nowhere"), True)]:
        register_grammar("boom", grammar)
        try:
            m = GrammarCompiler(BT, 600).compile(GrammarSpec("boom")).matcher()
            assert m.mask_by_output_index is declared
            if declared:
                row = np.zeros(19, dtype=np.int32)
                m.mask_for_output_index(7, row)
                assert grammar.asked == 7
                assert {32 * w + b for w in range(19) for b in range(32) if row.view(np.uint32)[w] >> b & 1} \
                    == set(range(512))
        finally:
            unregister_grammar("boom")
