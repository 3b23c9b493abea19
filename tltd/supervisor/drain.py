"""A node drain: finish what fits in the grace, then hand the rest to the other nodes (what
runs comes back as partial samples first), or, alone, return what runs and fail the rest."""

from __future__ import annotations

import asyncio
import logging
import time

from tltd.domain import DRAINED_REASON
from tltd.supervisor.lease_keeper import LeaseKeeper
from tltd.supervisor.live_requests import LiveRequests
from tltd.supervisor.rollout_workers import RolloutWorkers
from tltd.supervisor.work_queue import WorkQueue

log = logging.getLogger(__name__)

# How long workers get to answer a node drain's Drain (return what runs as partial samples)
# after its grace; a shutdown's one deadline replaces it.
DRAIN_ANSWER_SECONDS = 5.0


class NodeDrain:
    """At most one drain per daemon; a later, shorter one only moves its deadlines earlier."""

    def __init__(
        self,
        queue: WorkQueue,
        requests: LiveRequests,
        workers: RolloutWorkers,
        leases: LeaseKeeper | None = None,
    ) -> None:
        self.queue = queue
        self.leases = leases
        self.requests = requests
        self.workers = workers
        self.started = False  # no new request is taken, no worker started
        self.assigning = True  # work is still handed out (until the grace ends)
        # Units go to the other nodes: a partial sample a worker returns now is the tokens so
        # far of a sample another node runs again, not the end of it.
        self.handing_over = False
        self.handed_over = False  # streams here end: their callers re-attach elsewhere
        self.why = ""
        self._task: asyncio.Future | None = None
        self._work_end = self._end = 0.0  # monotonic deadlines

    def start(self, seconds: float, why: str, end: float | None = None) -> asyncio.Future:
        """Begin draining now (event loop thread): work runs `seconds`, then workers have
        until `end` (monotonic; default `DRAIN_ANSWER_SECONDS` later) to return what runs.
        A drain already under way is returned, its deadlines shortened to these if earlier
        (SIGTERM during a node drain keeps the shutdown's grace)."""
        work_end = time.monotonic() + max(0.0, seconds)
        end = work_end + DRAIN_ANSWER_SECONDS if end is None else end
        if self._task is None:
            self.started = True
            self.why = f"{why} (grace {seconds:g}s)"
            self._work_end, self._end = work_end, end
            self._task = asyncio.ensure_future(self._run())
        else:
            self._work_end = min(self._work_end, work_end)
            self._end = min(self._end, end)
        return self._task

    async def _run(self) -> None:
        while len(self.queue) and time.monotonic() < self._work_end:
            await asyncio.sleep(0.05)
        self.assigning = False
        if not len(self.queue):
            return
        if self.leases is not None and await asyncio.to_thread(self.leases.others_up):
            await self._hand_over(self.leases)
            return
        reason = DRAINED_REASON + self.why
        log.info("draining workers", extra={"requests": len(self.queue)})
        busy = self.workers.ask_to_drain()
        await self.requests.fail_all(reason)
        await self.workers.await_drained(busy, lambda: self._end)
        # The final status writes of the requests just failed (store writes, not workers:
        # they get a second past the deadline).
        writes_end = max(self._end, time.monotonic() + 1.0)
        while len(self.queue) and time.monotonic() < writes_end:
            await asyncio.sleep(0.05)

    async def _hand_over(self, leases: LeaseKeeper) -> None:
        """Other nodes finish the work, nothing fails. The workers first return what runs as
        partial samples (ABORTED, the tokens so far), stored while this node still holds the
        units: streams that asked for partial samples get them, on any node. Then every unit
        goes back to the queue; another node runs its missing samples again from the stored
        seed, and each complete sample replaces its partial one."""
        self.handing_over = True
        busy = self.workers.ask_to_drain()
        log.info(
            "drain: workers return what runs before the hand-over", extra={"workers": len(busy)}
        )
        # A worker's samples are stored (by its pipe's reader) before its Drained is seen.
        while any(not h.drained.is_set() for h in busy) and time.monotonic() < self._end:
            await asyncio.sleep(0.05)
        units = leases.hand_over()
        self.handed_over = True
        self.requests.wake_streams()
        log.info("drain: units handed to the other nodes", extra={"units": units})
