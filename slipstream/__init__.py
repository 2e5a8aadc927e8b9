"""slipstream: pipelined LLM inference — the GPU never waits for the CPU."""
from slipstream.api.client import Client
from slipstream.api.engine import Engine
from slipstream.api.interface import EngineAPI
from slipstream.api.offline import LLM
from slipstream.errors import (
    EngineClosedError,
    InvalidRequestError,
    ModelLoadError,
    OverloadedError,
    SlipstreamError,
    WorkerError,
    WorkerUnavailableError,
)
from slipstream.logging_setup import install_library_defaults
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta, Usage
from slipstream.params import EngineConfig, SamplingParams

__all__ = [
    "Client",
    "CompletionOutput",
    "Engine",
    "EngineAPI",
    "EngineClosedError",
    "EngineConfig",
    "InvalidRequestError",
    "LLM",
    "ModelLoadError",
    "OverloadedError",
    "RequestMetrics",
    "SamplingParams",
    "SlipstreamError",
    "StreamDelta",
    "Usage",
    "WorkerError",
    "WorkerUnavailableError",
]
__version__ = "0.1.0"

install_library_defaults()  # silent as a library: events go to stdlib logging (NullHandler)
