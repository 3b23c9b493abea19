"""Parking a bounded request at its bound (`StepBound.park`): its running samples pause where
they are, their tokens stored, and its unfinished prompts wait in the store, held by no node,
until the job's next carried request queues them again; the node that claims one then goes on
from the stored tokens (`LiveRequests.take_claims`), under the job's newest policy version.

Order matters for durability: a paused sample is stored (by its worker's pipe reader, while
this node still holds the unit) before the unit is parked, so a crash in between leaves a
held unit whose lease lapses and whose stored tokens the next claimer resumes from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tltd.contract import rollout_messages as msg
from tltd.supervisor.live_requests import LiveRequests
from tltd.supervisor.work_queue import Key
from tltd.supervisor.worker_process import WorkerHandle
from tltd.supervisor.writes import OrderedWrites

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)


class Parking:
    def __init__(
        self,
        store: Store,
        requests: LiveRequests,
        handles: Mapping[str, WorkerHandle],
        writes: OrderedWrites,
    ) -> None:
        self.store = store
        self.requests = requests
        self.queue = requests.queue
        self.handles = handles
        self.writes = writes

    async def park(self, request_id: str, answer_seconds: float) -> int:
        """Pause the request's running samples (their workers return them within
        `answer_seconds`, stored partial and ABORTED) and park its unfinished units; returns
        the units parked. A sample not back by then runs again from its seed when resumed.
        Not live here (run elsewhere, or done): nothing to park on this node."""
        live = self.queue.get(request_id)
        if live is None or live.outcome is not None or live.parking:
            return 0
        live.parking = True  # nothing more of it is handed out
        for wid in sorted(set(live.running.values())):
            handle = self.handles.get(wid)
            if handle is not None:
                handle.send(msg.Cancel(request_id, pause=True))
        end = time.monotonic() + answer_seconds
        while live.running and time.monotonic() < end:
            await asyncio.sleep(0.02)
        units = {(request_id, p) for p in live.units if not live.unit_complete(p)}
        lost = self.requests.lose_units(units, "unit parked at its step bound", logging.DEBUG)
        for wid, rid in lost:  # still running past the answer time: its tokens are dropped
            handle = self.handles.get(wid)
            if handle is not None:
                handle.send(msg.Cancel(rid))
        # Awaited: the job's next carried request, once admitted, finds them parked.
        for rid, p in sorted(units):
            try:
                await self.writes.write(self.store.leases.park_unit, rid, p, request=rid)
            except Exception:  # held, not parked: its lease lapses and it is claimed again
                log.exception("cannot park a unit", extra={"request_id": rid, "prompt": p})
        if units:
            log.info("request parked at its step bound", extra={"request_id": request_id,
                                                                 "prompts": len(units)})  # fmt: skip
        return len(units)

    def returned(self, request_id: str, key: Key) -> bool:
        """A sample of a parking request came back paused (stored by the pipe's reader): it
        no longer runs here; True when it was one of that request's running samples."""
        live = self.queue.get(request_id)
        return live is not None and live.parking and self.queue.paused(request_id, key)
