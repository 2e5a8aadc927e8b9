"""Logging (silent as a library, levels, JSON, event names) and the CLI's user-facing behaviour."""
from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from slipstream.cli import main
from slipstream.errors import InvalidRequestError
from slipstream.logging_setup import LEVEL_ENV, configure_logging, reset_logging, resolve_level

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True)
def _library_default_logging():
    yield
    reset_logging()


def test_library_use_prints_nothing_until_the_application_configures_logging():
    """An engine run plus a warning-level event print nothing; after logging.basicConfig, the
    application's handler gets the events (message = event name, fields = record attributes)."""
    code = (
        "import asyncio, logging, sys, structlog\n"
        "from slipstream import Engine, EngineConfig, SamplingParams\n"
        "async def main():\n"
        "    async with Engine(EngineConfig(model='tiny-random')) as e:\n"
        "        await e.complete('hi', SamplingParams(max_tokens=3))\n"
        "asyncio.run(main())\n"
        "structlog.get_logger('slipstream.test').warning('test_warning', detail='must not print')\n"
        "sys.stderr.write('configured\\n')\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s|%(message)s|%(layers)s')\n"
        "import torch\n"
        "from slipstream.models.loading.build import build_model\n"
        "build_model('tiny-random', 'float32', torch.device('cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    silent, configured = out.stderr.split("configured\n")
    assert silent == ""
    assert "slipstream.models.llama.build|model_ready|2" in configured.splitlines()


def test_json_lines_have_iso_utc_millisecond_timestamps():
    buf = io.StringIO()
    configure_logging("info", json=True, stream=buf)
    structlog.get_logger("slipstream.test").info("test_event", answer=42)
    structlog.get_logger("slipstream.test").debug("below_the_level")
    (line,) = buf.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["event"] == "test_event" and doc["answer"] == 42 and doc["level"] == "info"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", doc["timestamp"])


def test_level_comes_from_the_flag_then_the_environment(monkeypatch):
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    assert resolve_level(None) == "warning" and resolve_level(None, "info") == "info"
    monkeypatch.setenv(LEVEL_ENV, "DEBUG")
    assert resolve_level(None, "info") == "debug" and resolve_level("error") == "error"
    monkeypatch.setenv(LEVEL_ENV, "loud")
    with pytest.raises(InvalidRequestError, match=LEVEL_ENV):
        resolve_level(None)


def _log_calls():
    for path in sorted((ROOT / "slipstream").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            f = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                    and f.value.id == "log" and f.attr in ("debug", "info", "warning", "error", "exception"):
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0] if node.args else None
            elif isinstance(node, ast.Call) and isinstance(f, ast.BoolOp):  # (log.warning if x else log.info)(...)
                yield f"{path.relative_to(ROOT)}:{node.lineno}", node.args[0] if node.args else None


def test_every_event_name_is_snake_case():
    calls = list(_log_calls())
    assert len(calls) > 40
    bad = [(where, ast.unparse(arg) if arg is not None else None) for where, arg in calls
           if not (isinstance(arg, ast.Constant) and re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)+", str(arg.value)))]
    assert bad == []


# --- CLI ------------------------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"slipstream \S+\n", capsys.readouterr().out)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--max-tokens MAX_TOKENS most tokens to generate (default: 128)", "(default: 0.0)",
                  "(default: smollm2-135m)", "(default: 30.0)", "--pipeline-depth {1,2}"):
        assert shown in text, shown


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_one_line(capsys):
    assert main(["generate", "hi", "--device", "cuda", "--model", "tiny-random"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream: error: --device cuda") and err.count("\n") == 1


def test_generate_prints_a_summary_line(capsys):
    assert main(["generate", "hi", "--model", "tiny-random", "--max-tokens", "5", "--raw"]) == 0
    *_, last = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\[5 tokens, [\d.]+ tok/s, TTFT \d+ ms, finish: length \(hit --max-tokens 5\)\]", last)
    assert main(["generate", "hi", "--model", "tiny-random", "--max-tokens", "5", "--raw", "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_connect_without_a_worker_fails_in_one_line(tmp_path, capsys):
    t0 = time.monotonic()
    assert main(["generate", "hi", "--connect", f"ipc://{tmp_path}/none.sock", "--wait-ready", "1"]) == 1
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 20  # a 'does not wait' guard: 1 s expected, the default --wait-ready is 30
    assert err.startswith("slipstream: error: no worker answered") and "--wait-ready" in err and err.count("\n") == 1


def test_wait_ready_waits_for_a_worker_that_is_still_loading(tmp_path):
    """--wait-ready outlasts --timeout (2 s here): the handshake is retried until the worker binds."""
    from worker_util import ipc_address, start_worker

    address = ipc_address(tmp_path)
    gen = subprocess.Popen([sys.executable, "-m", "slipstream.cli", "generate", "hello", "--raw", "--max-tokens", "4",
                            "--connect", address, "--timeout", "2", "--wait-ready", "120"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        time.sleep(2.0)  # the client is up and retrying before the worker even starts
        assert gen.poll() is None
        w = start_worker(address, tmp_path)
        try:
            out, err = gen.communicate(timeout=120)
        finally:
            w.stop()
    finally:
        if gen.poll() is None:
            gen.kill()
    assert gen.returncode == 0, err
    assert re.search(r"\[4 tokens, .* finish: length", err)


def test_load_progress_bar_only_for_the_cli_on_a_terminal(monkeypatch):
    from slipstream import logging_setup

    class Tty(io.StringIO):
        def isatty(self):
            return True

    items = [1, 2, 3]
    monkeypatch.setattr(sys, "stderr", Tty())
    assert logging_setup.load_progress(items, 3, "x") is items  # library use: never a bar
    configure_logging("warning")
    bar = logging_setup.load_progress(items, 3, "loading weights")
    assert list(bar) == items and "loading weights" in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    assert logging_setup.load_progress(items, 3, "x") is items


@pytest.mark.parametrize("argv", [
    ["timeline", "--steps", "0", "--model", "tiny-random"],
    ["bench", "--repeats", "0", "--model", "tiny-random"],
    ["serve", "--ray", "--connect", "ipc:///tmp/none.sock"],
    ["serve", "--ray", "--min-replicas", "1"],
])
def test_bad_values_of_every_command_are_one_error_line(argv, capsys):
    """issue 37, item 14: timeline, bench and serve --ray printed their own formats (or exit 1)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream: error: ") and err.count("\n") == 1, err


def test_every_option_of_every_command_says_what_it_does():
    """issue 37, item 15: --max-message-bytes, --max-batch-size, --page-size, --seed, --max-replicas,
    bench/timeline's --model/--device/--dtype had no help; `--no-trace (default: True)` read backwards."""
    import argparse

    from slipstream.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing, backwards = [], []
    for name, sub in subs.choices.items():
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help.startswith("(default"):
                missing.append(f"{name} {action.option_strings[0]}")
            if isinstance(action, argparse._StoreFalseAction):
                backwards.append(f"{name} {action.option_strings[0]}")
    assert not missing, missing
    assert not backwards, backwards  # a --no-X flag whose default shows as True: use --X/--no-X


def test_an_unknown_model_is_told_every_name_it_could_have_been(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    for name in ("smollm2-135m", "tiny-random", "random-smollm2-135m"):
        assert name in err, err



class _ConfigBuilt(Exception):
    """Raised instead of building the engine: a flag the command ignored let it get that far."""


@pytest.mark.parametrize("command", ["generate", "bench", "serve", "worker"])
@pytest.mark.parametrize("flags,names", [
    (["--num-drafts", "3"], ["--num-drafts", "--speculative"]),  # ignored without --speculative (issue 48)
    (["--num-drafts", "4"], ["--num-drafts", "--speculative"]),  # (the old default: still refused)
    (["--draft-model", "tiny-random"], ["--draft-model", "--speculative"]),
    (["--speculative", "draft"], ["--speculative draft", "--draft-model"]),
    (["--speculative", "ngram", "--draft-model", "tiny-random"], ["--draft-model", "--speculative draft"]),
])
def test_speculative_flags_that_mean_nothing_alone_are_one_error_line(command, flags, names, capsys, monkeypatch):
    """issue 48, item 8: --num-drafts / --draft-model without --speculative were ignored, and
    `--speculative draft` alone said "speculative.draft_model is given with method 'draft', and only then"."""
    import argparse

    from slipstream import params
    from slipstream.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = {a.dest: a for a in sub._actions}
    if "--draft-model" in flags and "draft_model" not in options or \
            "draft" in flags and "draft" not in options["speculative"].choices:
        pytest.skip(f"{command} has no --speculative draft")

    def built(*a, **kw):
        raise _ConfigBuilt(kw.get("speculative"))

    monkeypatch.setattr(params, "EngineConfig", built)  # (bench builds it inside bench(): never reached)
    monkeypatch.setattr("slipstream.bench.bench", built)
    argv = [command, *(["hi"] if command == "generate" else []), "--model", "tiny-random", *flags,
            *(["--bind", "ipc:///tmp/slipstream-never.sock"] if command == "worker" else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream: error: ") and err.count("\n") == 1, err
    assert all(n in err for n in names), err
