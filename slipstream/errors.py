"""Exception types raised by slipstream. Callers match on types, never on messages."""
from __future__ import annotations


class SlipstreamError(Exception):
    """Base class of every error slipstream raises on purpose."""


# --- model loading -------------------------------------------------------------------------


class ModelLoadError(SlipstreamError):
    """A model could not be loaded; the message names the file and the problem."""


class ModelNotFoundError(ModelLoadError):
    """The model name or path does not point at anything loadable."""


class CorruptModelError(ModelLoadError):
    """The file exists but cannot be parsed (truncated, wrong magic, missing tensors)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one slipstream implements."""


class UnsupportedQuantizationError(ModelLoadError):
    """A GGUF tensor uses a quantisation type slipstream cannot dequantise."""


# --- requests --------------------------------------------------------------------------------


class InvalidRequestError(SlipstreamError, ValueError):
    """A request or configuration value is invalid; raised at the call, before scheduling."""


class RequestAbortedError(SlipstreamError):
    """Raised to a waiter whose request was aborted by someone else."""


class EngineClosedError(SlipstreamError):
    """The engine is not running (never started, shut down, or its loop died)."""


# --- runtime invariants ----------------------------------------------------------------------


class SlotReuseError(SlipstreamError, RuntimeError):
    """A DecodeSlot was relaunched while the commit reading its host buffer was pending."""


class PipelineInvariantError(SlipstreamError, AssertionError):
    """An internal pipeline invariant was broken (a bug in slipstream, never user input)."""
