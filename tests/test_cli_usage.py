"""The CLI's surface as a newcomer meets it: a mistyped flag is refused with its command's usage (no
prefix of a flag is taken for the flag), an empty prompt is refused in chat and raw mode alike, before
any model loads, and `python -m slipstream` is the `slipstream` command."""
import runpy
import sys
from pathlib import Path

import pytest

from slipstream import cli


def parsers(parser):
    yield parser
    for action in parser._actions:
        for sub in getattr(action, "choices", None).values() if isinstance(action.choices, dict) else ():
            yield from parsers(sub)


def test_no_parser_takes_a_prefix_for_a_flag():
    every = list(parsers(cli.build_parser()))
    assert len(every) == 1 + len(cli.COMMANDS)
    assert all(p.allow_abbrev is False for p in every)


@pytest.mark.parametrize("argv", [["generate", "hi", "--max-token", "3"], ["generate", "hi", "--max-tokns", "3"],
                                  ["bench", "--stream", "1"], ["worker", "--bind", "ipc:///tmp/x", "--max-queue", "1"],
                                  ["serve", "--prot", "1"], ["timeline", "--zom", "2"]])
def test_a_mistyped_flag_is_refused_with_its_commands_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: slipstream {argv[0]} " in err and f"slipstream {argv[0]}: error: unrecognized arguments" in err


@pytest.mark.parametrize("raw", [False, True])
def test_an_empty_prompt_is_refused_in_both_modes_before_loading(raw, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("slipstream.api.engine.Engine.start", no_load)
    assert cli.main(["generate", "", "--model", "tiny-random", *(["--raw"] if raw else [])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("slipstream: error: prompt is empty"), err


def test_python_dash_m_slipstream_is_the_command(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["slipstream", "--version"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("slipstream", run_name="__main__")
    assert e.value.code == 0 and capsys.readouterr().out.startswith("slipstream ")


def test_the_missing_extra_hint_is_the_readme_command():
    hint = str(cli.needs_extra("plot", "slipstream timeline", ImportError("No module named 'matplotlib'")))
    assert '.venv/bin/pip install -e ".[plot]"' in hint and "slipstream[" not in hint
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert '.venv/bin/pip install -e ".[NAME]"' in readme
