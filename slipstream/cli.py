"""Command line entry point: `slipstream <command>`. Each command lives in slipstream/commands/."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
COMMANDS = [
    "slipstream.commands.generate",
    "slipstream.commands.bench",
    "slipstream.commands.timeline",
    "slipstream.commands.worker",
    "slipstream.commands.serve",
]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every default; an option without help text still gets its default shown."""

    def _get_help_string(self, action):
        help = action.help or ""
        if "%(default)" in help or not _shows_default(action):
            return help
        return f"{help} (default: %(default)s)"

    def _format_action(self, action):
        if not action.help and _shows_default(action):
            action.help = "(default: %(default)s)"  # argparse skips the help column of help=None
        return super()._format_action(action)


def _shows_default(action) -> bool:
    d = action.default  # identity: 0 and 0.0 compare equal to False but are defaults worth showing
    return bool(action.option_strings) and not (d is None or d is argparse.SUPPRESS or d is False)


class _Parser(argparse.ArgumentParser):
    subparsers: Any = None  # the top level's: main() reports a stray argument with its command's usage

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)  # `--max-token` is a typo, not --max-tokens
        super().__init__(*args, **kwargs)


def add_log_args(p: argparse.ArgumentParser, default: str = "warning") -> None:
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help=f"log level on stderr (default: $SLIPSTREAM_LOG_LEVEL, else {default})")
    p.add_argument("--log-json", action="store_true", help="log lines as JSON (ISO-8601 UTC timestamps)")
    p.set_defaults(default_log_level=default)


def add_model_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf path, HF folder, or random weights: tiny-random, random-smollm2-135m, "
                        "random-llama-3.2-1b / -3b (Llama-3.2 shapes, drawn on the device)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    if dtype:
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                       help="weights and activations")


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The engine's batch and page knobs (EngineConfig), for the commands that serve (worker, serve)."""
    p.add_argument("--max-batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per step: decode rows first, then prompt chunks share the rest")
    p.add_argument("--page-size", type=int, default=16, help="KV positions per page of the paged cache")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling of requests that give no seed")


def add_engine_args(p: argparse.ArgumentParser, log_level: str = "warning") -> None:
    add_model_args(p)
    p.add_argument("--pipeline-depth", type=int, default=2, choices=[1, 2], help="1: blocking, 2: pipelined")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV pool in tokens (default: 32768 on the CPU, whose untouched pages take no memory; "
                        "sized from free memory on CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch's kernels; the CPU forward runs on one fewer (at least 1), leaving "
                        "the engine loop a core (default: torch's own choice, or OMP_NUM_THREADS)")
    p.add_argument("--weights", default="quantized", choices=["quantized", "dequantized"],
                   help="a GGUF's quantized matrices: kept quantized and computed with as such, or expanded to "
                        "--dtype at load (more memory; docs/models.md)")
    p.add_argument("--activations", default="auto", choices=["auto", "float", "int8", "int16"],
                   help="quantized weights on the CPU: float32 multiply-adds, or activations rounded to int8 / "
                        "int16 per group and multiplied in integers (faster, most of all for speculative decoding; "
                        "outputs differ slightly: docs/models.md); auto: int16 on the CPU's compiled kernels")
    p.add_argument("--batch-invariant", action="store_true",
                   help="CPU: results independent of batch composition and pipeline depth (row padding, "
                        "float64 attention; slower: docs/architecture.md)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of a cached prompt prefix instead of recomputing every prompt from "
                        "its first token (on by default; --no-prefix-caching turns it off: docs/prefix-caching.md)")
    p.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: decode rows feed drafted tokens and keep those the model agrees "
                        "with; the output is unchanged (off by default: docs/speculative.md)")
    add_num_drafts_arg(p)
    p.add_argument("--draft-model", default=None,
                   help="with --speculative draft (needed there): the smaller model that drafts (same tokenizer as "
                        "--model)")
    add_log_args(p, log_level)


def add_num_drafts_arg(p: argparse.ArgumentParser) -> None:
    # default None, not 4: a --num-drafts given without --speculative is refused, not ignored
    p.add_argument("--num-drafts", type=int, default=None,
                   help="with --speculative: the most drafts a row feeds per step (1..16; default 4)")


def speculative_config(args):
    """--speculative's SpeculativeConfig, or None. The flags that mean something only with it are
    refused without it (they were silently ignored: issue 48), each error one line naming its flag."""
    from slipstream.errors import InvalidRequestError
    from slipstream.params import SpeculativeConfig

    method = getattr(args, "speculative", None)
    num_drafts, draft_model = getattr(args, "num_drafts", None), getattr(args, "draft_model", None)
    if method is None:
        for flag, value in (("--num-drafts", num_drafts), ("--draft-model", draft_model)):
            if value is not None:
                raise InvalidRequestError(f"{flag} needs --speculative (without it no drafts are fed)",
                                          param=flag[2:].replace("-", "_"))
        return None
    if method == "draft" and draft_model is None:
        raise InvalidRequestError("--speculative draft needs --draft-model M: the smaller model that drafts "
                                  "(same tokenizer as --model)", param="draft_model")
    if method != "draft" and draft_model is not None:
        raise InvalidRequestError(f"--draft-model is read only with --speculative draft, not --speculative {method}",
                                  param="draft_model")
    return SpeculativeConfig(method=method, draft_model=draft_model,
                             **({} if num_drafts is None else {"num_drafts": num_drafts}))


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters loaded at start (the commands that serve an engine: worker, serve; docs/lora.md)."""
    p.add_argument("--lora", action="append", metavar="NAME=PATH", default=None,
                   help="a PEFT LoRA adapter folder served as model NAME (repeatable; docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=8, help="LoRA adapters loaded at once")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank a load accepts")


def lora_adapters(specs: list[str] | None) -> dict[str, str] | None:
    """--lora NAME=PATH values as EngineConfig.lora_adapters."""
    from slipstream.errors import InvalidRequestError

    if not specs:
        return None
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"--lora takes NAME=PATH, got {spec!r}", param="lora")
        if name in out:
            raise InvalidRequestError(f"--lora: {name!r} is given twice", param="lora")
        out[name] = path
    return out


def lora_fields(args) -> dict[str, Any]:
    """The EngineConfig fields of add_lora_args' flags ({} without --lora: the knobs keep their defaults)."""
    adapters = lora_adapters(getattr(args, "lora", None))
    if adapters is None:
        return {}
    return {"lora_adapters": adapters, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}


def engine_config(args, **overrides):
    from slipstream.params import EngineConfig

    fields = dict(model=args.model, device=args.device, dtype=args.dtype, pipeline_depth=args.pipeline_depth,
                  kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
                  batch_invariant=getattr(args, "batch_invariant", False),
                  weights=getattr(args, "weights", "quantized"),
                  activations=getattr(args, "activations", "auto"),
                  prefix_caching=getattr(args, "prefix_caching", True))
    spec = speculative_config(args)
    if spec is not None:
        fields["speculative"] = spec
    fields.update(overrides)
    return EngineConfig(**fields)


def apply_threads(args) -> None:
    """--threads: torch's intra-op threads for this process (before any model work)."""
    threads = getattr(args, "threads", None)
    if threads is None:
        return
    from slipstream.errors import InvalidRequestError

    if threads < 1:
        raise InvalidRequestError(f"--threads must be >= 1, got {threads}", param="threads")
    import torch

    torch.set_num_threads(threads)


def check_device(args) -> None:
    """`--device cuda` without a GPU: one error line, before minutes of model loading."""
    if getattr(args, "device", None) != "cuda" or getattr(args, "connect", None):
        return
    import torch

    from slipstream.errors import DeviceUnavailableError

    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"--device cuda: no CUDA GPU is usable here (torch {torch.__version__}, "
                                     "torch.cuda.is_available() is False); use --device cpu")
    try:
        importlib.import_module("triton")  # the CUDA forward is the triton backend: needed a minute from now anyway
    except ImportError as e:
        raise DeviceUnavailableError(f"--device cuda needs the `triton` package ({e}): "
                                     f"{install_hint('gpu')}") from None


def needs_extra(extra: str, what: str, error: ImportError):
    """The error a command raises when `extra` is not installed (one line, exit status 2)."""
    from slipstream.errors import MissingExtraError

    return MissingExtraError(f"{what} needs the `{extra}` extra ({error}): {install_hint(extra)}")


def install_hint(extra: str) -> str:
    """How to install an extra: slipstream installs from its checkout (it is not on the package index)."""
    return f"in the slipstream checkout, .venv/bin/pip install -e \".[{extra}]\""


def run_async(coro) -> int:
    """Run a command coroutine on uvloop (the engine's loop of choice)."""
    import uvloop

    return uvloop.run(coro)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slipstream")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> _Parser:
    parser = _Parser(prog="slipstream", description="Pipelined LLM inference.")
    parser.add_argument("--version", action="version", version=f"slipstream {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    parser.subparsers = sub
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's, says what the command takes
        parser.subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was asked, for provenance headers

    from slipstream.errors import (DeviceUnavailableError, InvalidRequestError, MissingExtraError, ModelLoadError,
                                   SlipstreamError)
    from slipstream.logging_setup import configure_logging, resolve_level

    try:
        args.log_level = resolve_level(getattr(args, "log_level", None), getattr(args, "default_log_level", "warning"))
        configure_logging(args.log_level, json=getattr(args, "log_json", False))
        check_device(args)
        apply_threads(args)
        return args.func(args)
    except SlipstreamError as e:
        # one line, no traceback: 2 for what was asked that cannot be done here (bad value, missing
        # model, no GPU, an extra not installed), 1 for what failed while running (worker gone, engine died)
        print(f"slipstream: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (InvalidRequestError, DeviceUnavailableError, ModelLoadError,
                                   MissingExtraError)) else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
