"""Store writes of the supervisor, run one at a time in order, off the event loop.

Order matters: a request's RUNNING must land before its COMPLETED, a worker's READY before its
BUSY. One queue drained by one task gives that order without holding the loop on the database.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tltd.domain import Sample, Worker
from tltd.errors import TltError

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)


class OrderedWrites:
    """A FIFO of store calls run by one task (`run`) in a worker thread each."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self) -> None:
        """Create the queue on the running loop (the supervisor's `start`)."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()

    async def run(self) -> None:
        """Runs queued store writes one at a time, in order (RUNNING before COMPLETED)."""
        assert self._queue is not None
        while True:
            fn, args, fut = await self._queue.get()
            try:
                result = await asyncio.to_thread(fn, *args)
                if fut is not None and not fut.done():
                    fut.set_result(result)
            except Exception as exc:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                elif isinstance(exc, TltError):
                    log.debug("store write refused: %s", exc)
                else:
                    log.exception("store write failed")
            finally:
                self._queue.task_done()

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Queue `fn(*args)` and wait for its result (or its exception)."""
        assert self._queue is not None and self._loop is not None
        fut = self._loop.create_future()
        self._queue.put_nowait((fn, args, fut))
        return await fut

    def write_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)`; failures are logged, nobody waits."""
        if self._queue is not None:
            self._queue.put_nowait((fn, args, None))

    async def join(self) -> None:
        """Wait until everything queued so far is written."""
        if self._queue is not None:
            await self._queue.join()


# ---- store calls run in the writer's thread ---------------------------------------------------


def add_samples(store: Store, samples: list[Sample]) -> None:
    """Store samples in one transaction; raises the first sample's error, if any (the others
    are stored all the same)."""
    for outcome in store.add_samples(samples):
        if isinstance(outcome, Exception):
            raise outcome


def upsert_worker(store: Store, worker: Worker) -> None:
    """A restart goes FAILED/STOPPED -> STARTING; the store checks every other move."""
    store.record_worker(worker)
