"""A request's outputs for its single reader: put never blocks; get waits for the next item.

What asyncio.Queue does for one producer and one consumer, with less work per item (no task
accounting, no list of getters): the output stage puts one delta per request and pass, so at a
few hundred streams this is paid hundreds of times a step.
"""
from __future__ import annotations

import asyncio
from collections import deque


class Mailbox:
    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (a reader cancelled while waiting left it cancelled)
                waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()

    def pending(self) -> list:
        """The items not read yet, oldest first (a copy)."""
        return list(self._items)

