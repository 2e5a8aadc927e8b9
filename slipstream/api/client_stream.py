"""ClientStream: the deltas of one request served by a worker (Client.stream / chat_stream)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from slipstream.outputs import StreamDelta
from slipstream.params import SamplingParams

if TYPE_CHECKING:
    from slipstream.api.client_connection import Pending
    from slipstream.api.client_requests import ClientRequests


class ClientStream:
    """The deltas of one request served by a worker (Client.stream / chat_stream). Not an async
    generator: those are closed a loop pass after the caller leaves them. Leaving early (break, an
    exception, dropping the iterator) frees the request id and sends the worker an Abort at once."""

    def __init__(self, requests: ClientRequests, request_id: str | None, params: SamplingParams | None, prompt: dict):
        self._requests, self._args = requests, (request_id, params, prompt)
        self._pending: Pending | None = None
        self._done = False

    def __aiter__(self) -> "ClientStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._pending is None:
                request_id, params, prompt = self._args
                if prompt.get("images"):
                    prompt = {**prompt, "images": await self._requests.wire_images(prompt["images"])}
                self._pending = self._requests.submit(request_id, params, True, prompt)
            item = await self._pending.queue.get()
        except BaseException:
            self._close(finished=False)
            raise
        if isinstance(item, BaseException):
            self._close(finished=True)
            raise item
        if item.finish_reason is not None:
            self._close(finished=True)  # the last delta is returned; the next call stops
        return item

    async def aclose(self) -> None:
        self._close(finished=False)

    def _close(self, finished: bool) -> None:
        if not self._done:
            self._done = True
            if self._pending is not None:
                self._requests.forget(self._pending, finished)

    def __del__(self) -> None:
        try:
            self._close(finished=False)
        except Exception:  # noqa: BLE001 - at interpreter exit the socket may be gone
            pass
