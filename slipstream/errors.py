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
    """A request or configuration value is invalid; raised at the call, before scheduling.
    `param` names the offending field where it is known (e.g. "stop[1]", "messages[0].role")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class AddressInUseError(InvalidRequestError):
    """A worker's --bind address or the server's --port is held by a live process (checked before the
    model loads); `param` names the flag."""


class LoraAdapterError(InvalidRequestError):
    """A LoRA adapter was refused at load (its folder, config or weights); `param` names the field
    or file (e.g. "r", "target_modules", "adapter_model.safetensors"). The engine is unchanged."""


class LoraNotFoundError(InvalidRequestError):
    """A request names a LoRA adapter the engine has not loaded (HTTP: 404 model_not_found)."""


class EngineClosedError(SlipstreamError):
    """The engine is not running (never started, shut down, or its loop died)."""


class WrongEventLoopError(SlipstreamError, RuntimeError):
    """An Engine was called from an event loop other than the one it was started on."""


class EngineAlreadyStartedError(SlipstreamError, RuntimeError):
    """Engine.start() on an engine that is running (close() it first)."""


class RequestFailedError(SlipstreamError):
    """The engine failed while processing this request (e.g. detokenising its output); only it is affected."""


class StepFailedError(RequestFailedError):
    """Work launched on the device for a step this request was in (forward or sampling) raised.

    Every request of that step (and of the step launched behind it, which read its results) fails
    with this error; the engine recovers its streams and goes on serving the others."""


class StepTimeoutError(StepFailedError):
    """A launched step did not complete within EngineConfig.step_timeout_s (the watchdog fired)."""


# --- runtime invariants ----------------------------------------------------------------------


class SlotReuseError(SlipstreamError, RuntimeError):
    """A StepSlot was relaunched while the commit reading its host buffer was pending."""


class DeviceUnavailableError(SlipstreamError, RuntimeError):
    """The requested device cannot be used here (e.g. device='cuda' without a GPU or a CUDA build of torch)."""


class MissingExtraError(SlipstreamError, ImportError):
    """A command or feature needs an optional extra that is not installed; the message names it
    (`.venv/bin/pip install -e ".[serve]"` in the checkout)."""


class PipelineInvariantError(SlipstreamError, AssertionError):
    """An internal pipeline invariant was broken (a bug in slipstream, never user input)."""


# --- grammars (structured output) ------------------------------------------------------------


class GrammarError(SlipstreamError):
    """A grammar-constrained request failed; only that request is affected. `param`: the request
    field the grammar came from ("json_schema", "regex", "choice", "grammar") where known."""

    param: str | None = None


class GrammarCompileError(GrammarError):
    """A grammar could not be built: invalid schema, regex or choice list, unknown kind, or a plugin failure."""


class GrammarTimeoutError(GrammarError):
    """Compiling a grammar took longer than the compiler's timeout."""


class GrammarMatchError(GrammarError):
    """A matcher rejected a token or failed while computing its mask."""


# --- worker mode (slipstream worker / slipstream.Client) ---------------------------------------


class WorkerError(SlipstreamError):
    """A worker-mode failure: the worker reported an unexpected error, or the link to it failed."""


class WorkerUnavailableError(WorkerError):
    """The worker cannot be reached: not started, exited, disconnected, or silent past the timeout."""


class WorkerShuttingDownError(WorkerUnavailableError):
    """The worker is shutting down: it admits no new request, or ended this one at its deadline."""


class OverloadedError(WorkerError):
    """The worker's request queue is full; nothing was admitted. Retry later."""


class ProtocolError(WorkerError):
    """A message broke the worker protocol (malformed frame, unknown message type, wrong field types)."""


class ProtocolVersionError(ProtocolError):
    """The message carries a protocol version this side does not speak."""


class MessageTooLargeError(ProtocolError):
    """The message is larger than the worker's max_message_bytes (or its images than max_image_bytes);
    `param` is "images" when the images are what is too large."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# --- scale-out (slipstream serve --ray) ------------------------------------------------------


class ReplicaUnavailableError(WorkerUnavailableError):
    """An engine replica died or became unreachable (Ray Serve); its in-flight requests fail with this."""
