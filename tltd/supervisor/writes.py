"""Store writes of the supervisor, run one at a time in order, off the event loop.

Order matters: a request's RUNNING must land before its COMPLETED, a worker's READY before its
BUSY. One queue drained by one task gives that order without holding the loop on the database.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from tltd.domain import Sample, Worker
from tltd.errors import TltError, Unavailable

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)


# At most this many queued writes share one transaction (a bound on how long one batch holds
# SQLite's write lock, which the workers' sample writes wait for).
MAX_BATCH = 64

# (call, its arguments, who waits for it, the request whose rows it writes: "" for none)
_Item = tuple[Callable[..., Any], tuple, "asyncio.Future | None", str]


class WritesClosed(Unavailable):
    """The writer has stopped (the daemon is stopping): the write was not run."""


class OrderedWrites:
    """A FIFO of store calls run by one task (`run`) in a worker thread.

    With `batch` (`Store.batch`), the writes queued while one transaction runs go together in
    the next: one thread hop and one commit for all of them, each in a savepoint of its own, so
    one that raises undoes only itself and gets its own error. A batch that does not commit (the
    database gone, a deadlock) is undone whole and run again one call at a time, as without it.

    A batch writes the rows of requests in request id order (writes of one request in the
    order queued), the order in which a sample batch locks them (`store.sample_batches.store`): on
    PostgreSQL two transactions that lock request rows in different orders deadlock, and the
    database breaks the tie only after `deadlock_timeout` (1 s).
    """

    def __init__(self, batch: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch = batch
        self._closed = False

    def bind(self) -> None:
        """Create the queue on the running loop (the supervisor's `start`)."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()

    async def run(self) -> None:
        """Runs queued store writes in order (RUNNING before COMPLETED)."""
        assert self._queue is not None
        while True:
            items = [await self._queue.get()]
            while self._batch is not None and len(items) < MAX_BATCH and not self._queue.empty():
                items.append(self._queue.get_nowait())
            try:
                try:
                    if len(items) == 1:
                        outcomes = [await asyncio.to_thread(_call, items[0])]
                    else:
                        outcomes = await asyncio.to_thread(self._run_batch, items)
                except asyncio.CancelledError:
                    # The stop cancelled the writer with these in its thread: nobody will hand
                    # over their results, so their callers are told now (the calls may still
                    # commit; what they wrote is in the store for whoever reads it next).
                    for item in items:
                        _deliver(item, (False, WritesClosed(_closed_message(item[0]))))
                    raise
                except Exception as exc:  # the hop to a thread failed: these writes fail
                    log.exception("store writes not run")
                    outcomes = [(False, exc)] * len(items)
                for item, outcome in zip(items, outcomes, strict=True):
                    try:
                        _deliver(item, outcome)
                    except Exception:  # one write's caller must not end the writer
                        log.exception("store write result not delivered")
            finally:
                for _ in items:
                    self._queue.task_done()

    def _run_batch(self, items: list[_Item]) -> list[tuple[bool, Any]]:
        assert self._batch is not None
        order = sorted(range(len(items)), key=lambda i: items[i][3])  # stable
        outcomes: list[tuple[bool, Any]] = [(False, None)] * len(items)
        try:
            with self._batch():
                for i in order:
                    outcomes[i] = _call(items[i])
            return outcomes
        except Exception:
            log.warning("batched store writes not committed; writing them one by one")
            return [_call(item) for item in items]

    async def write(self, fn: Callable[..., Any], *args: Any, request: str = "") -> Any:
        """Queue `fn(*args)` and wait for its result (or its exception); `request`: the
        request whose rows it writes, if any."""
        assert self._queue is not None and self._loop is not None
        if self._closed:
            raise WritesClosed(_closed_message(fn))
        fut = self._loop.create_future()
        self._queue.put_nowait((fn, args, fut, request))
        return await fut

    def write_nowait(self, fn: Callable[..., Any], *args: Any, request: str = "") -> None:
        """Queue `fn(*args)`; failures are logged, nobody waits."""
        if self._closed:
            log.warning(_closed_message(fn))
        elif self._queue is not None:
            self._queue.put_nowait((fn, args, None, request))

    def close(self) -> None:
        """The writer has stopped for good (the supervisor's stop, after `join`): writes still
        queued (queued after the join) fail with WritesClosed instead of waiting for ever,
        and so do later ones."""
        self._closed = True
        if self._queue is None:
            return
        left = []
        while not self._queue.empty():
            fn, _, fut, _ = self._queue.get_nowait()
            self._queue.task_done()
            left.append(_name(fn))
            if fut is not None and not fut.done():
                fut.set_exception(WritesClosed(_closed_message(fn)))
        if left:
            log.warning("store writes queued after the stop's last wait, not written: %s", left)

    async def join(self, writer: asyncio.Task | None = None) -> None:
        """Wait until everything queued so far is written, or until `writer` (the task that
        runs `run`) has ended: a writer that ended leaves what is queued unwritten for good,
        and waiting for it would never end (logged)."""
        if self._queue is None:
            return
        if writer is None:
            await self._queue.join()
            return
        joined = asyncio.ensure_future(self._queue.join())
        await asyncio.wait({joined, writer}, return_when=asyncio.FIRST_COMPLETED)
        if not joined.done():
            joined.cancel()
            log.error("the store writer has ended with %d writes queued", self._queue.qsize())


def _name(fn: Callable[..., Any]) -> str:
    # A repository's method by its class too ("JobRecords.create"): its name alone says little.
    return getattr(fn, "__qualname__", repr(fn))


def _closed_message(fn: Callable[..., Any]) -> str:
    return f"{_name(fn)}: not written, the store writer has stopped"


def _call(item: _Item) -> tuple[bool, Any]:
    fn, args, _, _ = item
    try:
        return True, fn(*args)
    except Exception as exc:
        return False, exc
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # e.g. a CancelledError out of a store call: as the writer's
        # own it would end the writer, and nothing queued after it would be stored
        return False, RuntimeError(f"store call raised {exc!r}")


def _deliver(item: _Item, outcome: tuple[bool, Any]) -> None:
    """Hand a write's result (or error) to whoever waits for it; log it when nobody does."""
    ok, value = outcome
    fut = item[2]
    if fut is not None and not fut.done():
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
    elif not ok and isinstance(value, TltError):
        log.debug("store write refused: %s", value)
    elif not ok:
        log.error("store write failed", exc_info=value)


# ---- store calls run in the writer's thread ---------------------------------------------------


def add_samples(store: Store, samples: list[Sample]) -> None:
    """Store samples in one transaction; raises the first sample's error, if any (the others
    are stored all the same)."""
    for outcome in store.sample_batches.add(samples):
        if isinstance(outcome, Exception):
            raise outcome


def upsert_worker(store: Store, worker: Worker) -> None:
    """A restart goes FAILED/STOPPED -> STARTING; the store checks every other move."""
    store.workers.record(worker)
