"""Logging: structlog events routed through stdlib `logging`, silent until the application asks.

As a library, slipstream prints nothing: its events go to the stdlib logger "slipstream" (which
has a NullHandler), so they appear only if the application configures logging (e.g.
`logging.basicConfig(level="INFO")`; the event name is the message, its fields are record
attributes). The CLI calls `configure_logging`: key=value lines (or JSON) on stderr, ISO-8601 UTC
timestamps with milliseconds, level from --log-level, else $SLIPSTREAM_LOG_LEVEL, else "warning".
At a level above "info" the CLI also prints one plain line for each slow first-start phase
(`first_start_phase`: compiling the CPU kernels, converting a GGUF, measuring the forward's threads),
so a first start that takes seconds says why; a second start, with everything cached, prints none.

Event names are snake_case identifiers (`model_ready`, `engine_started`, `step_failed`); the
details go in fields, never into the name.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import weakref

import structlog

LOGGER_NAME = "slipstream"
LEVEL_ENV = "SLIPSTREAM_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "warning"
_CLI_HANDLERS: weakref.WeakSet[logging.Handler] = weakref.WeakSet()  # what configure_logging installed
_progress = False  # model-loading progress bars (on only via configure_logging, and only on a terminal)
_phases = False  # first_start_phase lines on stderr (on only via configure_logging, above "info")


def utc_timestamp(_logger, _name, event_dict):
    """ISO-8601 UTC with milliseconds: 2026-11-23T13:10:30.123Z."""
    now = datetime.datetime.now(datetime.timezone.utc)
    event_dict["timestamp"] = now.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return event_dict


def install_library_defaults() -> None:
    """Run at `import slipstream`. Leaves a structlog configuration the application made alone."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())  # no "last resort" printing of warnings to stderr
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,  # first: a disabled level costs one isEnabledFor
            # event → message, fields → record attributes, exc_info → the record's (tracebacks
            # then print with any stdlib formatter)
            structlog.stdlib.render_to_log_kwargs,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,  # structlog.testing.capture_logs must keep working
    )


def resolve_level(level: str | None, default: str = DEFAULT_LEVEL) -> str:
    """The flag if given, else $SLIPSTREAM_LOG_LEVEL, else `default`; an unknown name is an error."""
    from slipstream.errors import InvalidRequestError

    source = "--log-level"
    if level is None:
        level, source = os.environ.get(LEVEL_ENV) or default, LEVEL_ENV
    if level.lower() not in LEVELS:
        raise InvalidRequestError(f"{source}={level!r}: expected one of {', '.join(LEVELS)}", param=source)
    return level.lower()


def configure_logging(level: str | None = None, json: bool = False, stream=None) -> None:
    """What the CLI does: render slipstream's events on stderr (replacing an earlier call's handler)."""
    install_library_defaults()
    global _progress, _phases
    _progress = True
    # at info and below the phases' own events (cpu_kernels_compiled seconds=...) say the same
    _phases = logging.getLevelName(resolve_level(level).upper()) > logging.INFO
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=False, pad_event_to=0,
                                                   exception_formatter=structlog.dev.plain_traceback))
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.ExtraAdder(), utc_timestamp],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *([structlog.processors.format_exc_info] if json else []), renderer],
    )
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(formatter)
    _CLI_HANDLERS.add(handler)  # the handler a later call replaces
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if h in _CLI_HANDLERS]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(resolve_level(level).upper())
    logger.propagate = False  # the application's root handlers would print every line twice


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests and tools swap it)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def reset_logging() -> None:
    """Undo configure_logging: back to the library default (tests)."""
    global _progress, _phases
    _progress = _phases = False
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if getattr(h, "_slipstream_cli", False)]:
        logger.removeHandler(old)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


def load_progress(items, total: int, desc: str):
    """`items`, wrapped in a tqdm bar when the CLI configured logging and stderr is a terminal."""
    if not (_progress and sys.stderr.isatty()):
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False, dynamic_ncols=True)


def first_start_phase(done: str, seconds: float, cached_in: str | None = None) -> None:
    """One line on stderr for a slow phase a first start pays once (`done`: what was done, past tense), when
    the CLI configured logging above "info"; a library user sees only the phase's own log event."""
    if not _phases:
        return
    later = f" (once: later starts reuse {cached_in})" if cached_in else ""
    print(f"slipstream: {done} in {seconds:.1f} s{later}", file=sys.stderr, flush=True)
