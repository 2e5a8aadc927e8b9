"""uvicorn's Server, ending the streams that outlive the graceful shutdown with an SSE error event.

On SIGTERM uvicorn stops accepting, waits up to `timeout_graceful_shutdown` for responses to
finish, then cancels what still runs: a stream would just stop, its client left to guess why.
Shortly before that deadline this server cancels the streams itself (ServerState.end_streams);
each catches it, sends `data: {"error": ...}` (503, code "shutting_down") and `data: [DONE]`, and
ends, which aborts its request.
"""
from __future__ import annotations

import asyncio

import uvicorn

END_STREAMS_BEFORE_S = 0.5  # how long before uvicorn's own cancellation the streams are ended


class Server(uvicorn.Server):
    async def shutdown(self, sockets=None) -> None:
        state = self.config.app.state.server if hasattr(self.config.app, "state") else None
        handle = None
        if state is not None:
            delay = max(0.0, (self.config.timeout_graceful_shutdown or 0.0) - END_STREAMS_BEFORE_S)
            handle = asyncio.get_running_loop().call_later(delay, state.end_streams)
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()
