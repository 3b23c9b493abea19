"""The drafter trainers' messages, handled on the event loop one at a time, in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Inbox(Generic[T]):
    """Items put from the loop (a pipe reader delivers there) handled in order by one task;
    a failing item is logged and the next one handled."""

    def __init__(self, handle: Callable[[T], Awaitable[None]], name: Callable[[T], str]) -> None:
        self._handle, self._name = handle, name
        self._queue: asyncio.Queue[T] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._consume())

    def put(self, item: T) -> None:
        self._queue.put_nowait(item)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _consume(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                await self._handle(item)
            except Exception:
                log.exception("drafter trainer message failed", extra={"kind": self._name(item)})
