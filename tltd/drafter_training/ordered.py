"""In-order work on the event loop: trainer messages handled one at a time, store writes
applied one at a time (so a READY is never overtaken by a BUSY written after it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from tltd.errors import Fenced, TltError

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


class OrderedWrites:
    """`write(fn, *args)`: fn(*args) in a thread, one at a time in call order; errors logged,
    not raised (Fenced is, with `fenced`): a launch or a stop must still give its device back
    and stop its processes when the store refuses or fails a write."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def write(self, fn: Callable[..., Any], *args: Any, fenced: bool = False) -> Any:
        async with self._lock:
            try:
                return await asyncio.to_thread(fn, *args)
            except Fenced:
                if fenced:
                    raise
                log.warning("training store write fenced", extra={"fn": fn.__name__})
                return None
            except TltError as exc:
                log.warning("training store write refused: %s", exc)
                return None
            except Exception:
                # e.g. "database is locked" past the busy timeout, a dropped PostgreSQL
                # connection.
                log.exception("training store write failed", extra={"fn": fn.__name__})
                return None
