"""OpenAI-compatible HTTP serving (`slipstream serve`): see docs/serving.md."""
from slipstream.serve.app import create_app
from slipstream.serve.backend import ClientsBackend, EngineBackend

__all__ = ["create_app", "ClientsBackend", "EngineBackend"]
