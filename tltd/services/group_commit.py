"""Concurrent store calls written together: one thread hop and one transaction per group.

While one group is in its transaction, the calls that arrive wait and go together in the next
(group commit, as databases do it): a call that finds nothing running goes at once, alone, so
one client waits no longer than before, and sixteen clients' admissions share a few commits
instead of taking sixteen (each a thread hop, a write turn, a BEGIN and a COMMIT). Requests
admitted together also reach the workers together, and their samples come back in fewer,
larger batches.

Each call runs in a savepoint of its own (`Store.batch`): one that raises undoes only its own
writes and gets its own error. A group that does not commit (the database gone, a lock
timeout) is undone whole and its calls are run again one at a time, as without grouping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger(__name__)

# At most this many calls share one transaction (a bound on how long a group holds SQLite's
# write lock, which the workers' sample writes wait for).
MAX_GROUP = 32

_Outcome = tuple[bool, Any]  # (returned, its value or the exception raised)


class GroupCommit:
    """Runs store calls off the event loop, those that arrive together in one transaction."""

    def __init__(self, batch: Callable[[], AbstractContextManager[None]]) -> None:
        self._batch = batch
        self._waiting: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None  # (held: a task only the loop holds may vanish)
        self.groups = 0  # transactions run (for tests and benchmarks)

    async def run(self, call: Callable[[], Any]) -> Any:
        """`call()` in a worker thread, in the next group; its result or its exception."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((call, fut))
        if self._drainer is None:
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._waiting:
                group, self._waiting = self._waiting[:MAX_GROUP], self._waiting[MAX_GROUP:]
                try:
                    outcomes = await asyncio.to_thread(self._run_group, [c for c, _ in group])
                except BaseException as exc:  # the hop failed or the loop is stopping
                    left, self._waiting = group + self._waiting, []
                    for _, fut in left:
                        if not fut.done():
                            fut.set_exception(exc if isinstance(exc, Exception) else
                                              asyncio.CancelledError())  # fmt: skip
                    raise
                for (_, fut), (ok, value) in zip(group, outcomes, strict=True):
                    if fut.done():  # its caller was cancelled: what it stored stays stored
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
        finally:
            self._drainer = None

    def _run_group(self, calls: list[Callable[[], Any]]) -> list[_Outcome]:
        self.groups += 1
        if len(calls) == 1:
            return [_outcome(calls[0])]
        try:
            with self._batch():
                return [_outcome(c) for c in calls]
        except Exception:
            log.warning("a group of %d store calls did not commit; running them one by one",
                        len(calls))  # fmt: skip
            return [_outcome(c) for c in calls]


def _outcome(call: Callable[[], Any]) -> _Outcome:
    try:
        return True, call()
    except Exception as exc:
        return False, exc
