"""slipstream: pipelined LLM inference — the GPU never waits for the CPU."""
from slipstream.api.engine import Engine
from slipstream.errors import (
    EngineClosedError,
    InvalidRequestError,
    ModelLoadError,
    SlipstreamError,
)
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta
from slipstream.params import EngineConfig, SamplingParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestMetrics",
    "SamplingParams",
    "SlipstreamError",
    "StreamDelta",
]
__version__ = "0.1.0"
