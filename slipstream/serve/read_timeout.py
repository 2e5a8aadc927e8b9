"""A deadline for reading each HTTP request: idle and slow-dripping connections are closed.

uvicorn times out a connection only between requests (`timeout_keep_alive`, after a response);
one that connects and sends nothing, or drips a byte a second into its headers or body, is held
for ever. This protocol (uvicorn's httptools one, as `slipstream serve` uses) arms a timer when
the connection opens and when a request begins, and disarms it once the request is fully read:
a request not read within `read_timeout_s` closes its connection. The handler, if one is waiting
on the body, sees the client disconnect; the request's scope says the timer did it (`READ_TIMED_OUT`,
a 408 then, slipstream/serve/body.py).
"""
from __future__ import annotations

from typing import cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from slipstream.serve.body import READ_TIMED_OUT

DEFAULT_READ_TIMEOUT_S = 30.0  # `slipstream serve --request-read-timeout`


def read_timeout_protocol(read_timeout_s: float) -> type[HttpToolsProtocol]:
    class ReadTimeoutProtocol(HttpToolsProtocol):
        _read_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                cast(dict, self.cycle.scope)[READ_TIMED_OUT] = True  # (our own key in the ASGI scope)
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return ReadTimeoutProtocol
