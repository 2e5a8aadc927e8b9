"""OpenAI-compatible HTTP serving (`slipstream serve`): see docs/serving.md.

`create_app` needs the `serve` extra (fastapi); it is imported on first use so that the modules
beside it (backends, request types, the prefix router) import on a base install.
"""
from slipstream.serve.backend import ClientsBackend, EngineBackend

__all__ = ["create_app", "ClientsBackend", "EngineBackend"]


def __getattr__(name):
    if name == "create_app":
        from slipstream.serve.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
