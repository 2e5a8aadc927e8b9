"""slipstream: pipelined LLM inference — the GPU never waits for the CPU."""
from slipstream.api.client import Client
from slipstream.api.engine import Engine
from slipstream.errors import (
    EngineClosedError,
    InvalidRequestError,
    ModelLoadError,
    OverloadedError,
    SlipstreamError,
    WorkerError,
    WorkerUnavailableError,
)
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta
from slipstream.params import EngineConfig, SamplingParams

__all__ = [
    "Client",
    "CompletionOutput",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "OverloadedError",
    "RequestMetrics",
    "SamplingParams",
    "SlipstreamError",
    "StreamDelta",
    "WorkerError",
    "WorkerUnavailableError",
]
__version__ = "0.1.0"
