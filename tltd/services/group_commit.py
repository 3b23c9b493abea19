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
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger(__name__)

# At most this many calls share one transaction (a bound on how long a group holds SQLite's
# write lock, which the workers' sample writes wait for).
MAX_GROUP = 32

# A group running this long is waiting on something: calls behind it get another lane.
STALL_SECONDS = 0.05

_Outcome = tuple[bool, Any]  # (returned, its value or the exception raised)


class GroupCommit:
    """Runs store calls off the event loop, those that arrive together in one transaction.

    One group runs at a time while groups finish quickly. A call still waiting after a group
    has run `STALL_SECONDS` (a lock held elsewhere, a slow disk) gets another lane, another
    thread, up to `lanes`: it never waits long behind a group that is itself waiting."""

    def __init__(self, batch: Callable[[], AbstractContextManager[None]], lanes: int = 4) -> None:
        self._batch = batch
        self.lanes = lanes
        self._waiting: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._running: dict[asyncio.Task, float] = {}  # each lane: when its group started
        self._timer: asyncio.TimerHandle | None = None
        self.groups = 0  # transactions run (for tests and benchmarks)

    async def run(self, call: Callable[[], Any]) -> Any:
        """`call()` in a worker thread, in the next group; its result or its exception."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((call, fut))
        if not self._running:
            self._open_lane()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(STALL_SECONDS, self._stalled)
        return await fut

    def _open_lane(self) -> None:
        # (held in `_running`: a task only the loop holds may vanish)
        lane = asyncio.get_running_loop().create_task(self._drain())
        self._running[lane] = time.monotonic()
        lane.add_done_callback(lambda t: self._running.pop(t, None))

    def _stalled(self) -> None:
        """Calls are waiting: another lane when every lane's group has run too long."""
        self._timer = None
        if not self._waiting:
            return
        now = time.monotonic()
        if len(self._running) < self.lanes and all(
            now - started >= STALL_SECONDS for started in self._running.values()
        ):
            self._open_lane()
        else:
            self._timer = asyncio.get_running_loop().call_later(STALL_SECONDS, self._stalled)

    async def _drain(self) -> None:
        lane = asyncio.current_task()
        assert lane is not None
        while self._waiting:
            group, self._waiting = self._waiting[:MAX_GROUP], self._waiting[MAX_GROUP:]
            self._running[lane] = time.monotonic()
            try:
                outcomes = await asyncio.to_thread(self._run_group, [c for c, _ in group])
            except BaseException as exc:  # the hop failed or the loop is stopping
                group, self._waiting = group + self._waiting, []
                for _, fut in group:
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
