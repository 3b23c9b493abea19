"""A worker process's pipe, served by two threads: the one layer under rollout workers and
drafter trainers alike.

Two threads per process (one reads and may write to the store, one writes commands) keep a slow
or hung process from ever blocking the daemon's event loop. What the reader keeps is handed to
the loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue as threading_queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tltd.errors import NotFound

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# How often a worker's heartbeat is written to the store (`tltctl workers` shows it); the
# liveness check itself uses the in-memory time of the last message.
HEARTBEAT_WRITE_SECONDS = 2.0
# A heartbeat whose worker is still not recorded this long after the first is logged.
MISSING_WORKER_WARN_SECONDS = 30.0


# At most this many messages already waiting in a pipe are handled as one batch (one store
# transaction for their samples, one wake-up of the loop).
MAX_BATCH = 256


def serve_pipe(
    name: str,
    conn: Connection,
    loop: asyncio.AbstractEventLoop,
    *,
    receive: Callable[[list[Any]], list[Any]],
    deliver: Callable[[Any], None],
    closed: Callable[[], None],
) -> threading_queue.Queue:
    """Start the reader and writer threads of one process's pipe; returns the writer's outbox
    (put a message to send it, None to end the writer).

    The reader takes every message already waiting (up to `MAX_BATCH`; a list sent as one
    message counts as its messages), calls
    `receive(messages)` in its own thread (store writes belong there: one transaction for
    them all) and posts `deliver(result)` to the loop, in order, for each result that is not
    None, with one wake-up; `closed()` is posted once the pipe ends (the process exited or
    broke it)."""

    def read() -> None:
        broken = False
        while not broken:
            batch: list[Any] = []
            try:
                _take(batch, conn.recv())
                while len(batch) < MAX_BATCH and conn.poll(0):
                    _take(batch, conn.recv())
            except (EOFError, OSError):
                broken = True
            except Exception:  # an unpicklable message: treat the process as broken
                log.exception("bad message from worker", extra={"worker_id": name})
                broken = True
            if batch:
                kept = [k for k in receive(batch) if k is not None]
                if kept:
                    post(loop, _deliver_all, deliver, kept)
        post(loop, closed)

    outbox: threading_queue.Queue = threading_queue.Queue()
    threading.Thread(target=_write, args=(outbox, conn), name=f"{name}-tx", daemon=True).start()
    threading.Thread(target=read, name=f"{name}-rx", daemon=True).start()
    return outbox


def _take(batch: list[Any], message: Any) -> None:
    """A list is messages sent together (a worker step's samples)."""
    if isinstance(message, list):
        batch.extend(message)
    else:
        batch.append(message)


def _deliver_all(deliver: Callable[[Any], None], results: list[Any]) -> None:
    for r in results:
        deliver(r)


def _write(outbox: threading_queue.Queue, conn: Connection) -> None:
    """Writer thread: a process busy in a long step never blocks the event loop."""
    while True:
        m = outbox.get()
        if m is None:
            return
        try:
            conn.send(m)
        except (OSError, ValueError):
            return  # the process is gone; the reader notices


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` on the loop, from any thread; nothing once the loop is closed."""
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed meanwhile


class HeartbeatStamp:
    """Writes a worker's heartbeat to the store at most every `HEARTBEAT_WRITE_SECONDS`
    (reader thread)."""

    def __init__(self, store: Store, worker_id: str) -> None:
        self.store, self.worker_id, self._last = store, worker_id, 0.0
        self._missing_since: float | None = None  # first heartbeat with no worker row

    def __call__(self) -> None:
        if time.monotonic() - self._last < HEARTBEAT_WRITE_SECONDS:
            return
        self._last = time.monotonic()
        try:
            self.store.workers.heartbeat(self.worker_id)
        except NotFound:
            # A worker's first heartbeat can reach the reader before the loop has recorded
            # the worker: nothing to stamp yet, and the next heartbeat tries again. A worker
            # still unrecorded after MISSING_WORKER_WARN_SECONDS is worth a line.
            now, self._last = time.monotonic(), 0.0
            if self._missing_since is None:
                self._missing_since = now
            elif now - self._missing_since > MISSING_WORKER_WARN_SECONDS:
                self._missing_since = now  # at most one line per period
                log.warning(
                    "heartbeat of an unrecorded worker", extra={"worker_id": self.worker_id}
                )
        except Exception:  # e.g. "database is locked": the reader must keep reading
            log.warning(
                "cannot record heartbeat", extra={"worker_id": self.worker_id}, exc_info=True
            )
        else:
            self._missing_since = None


async def join_or_kill(proc: Any, grace: float) -> None:
    """Wait `grace` seconds for a process to exit, then kill it (never left running)."""
    await asyncio.to_thread(proc.join, max(0.0, grace))
    if proc.is_alive():
        proc.kill()
        await asyncio.to_thread(proc.join, 5.0)
