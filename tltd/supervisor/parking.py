"""Parking a bounded request's unfinished prompts: at its bound (`StepBound.park`) its running
samples pause where they are, and with a step token budget (`StepBound.max_tokens`) each
sample pauses once it has emitted that many tokens here. A paused sample's tokens are stored;
its prompt (work unit) parks in the store, held by no node, until the job's next carried
request queues it again; the node that claims it then goes on from the stored tokens
(`LiveRequests.take_claims`), under the job's newest policy version.

Order matters for durability: a paused sample is stored (by its worker's pipe reader, while
this node still holds the unit) before the unit is parked, so a crash in between leaves a
held unit whose lease lapses and whose stored tokens the next claimer resumes from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from tltd.contract import rollout_messages as msg
from tltd.domain import FinishReason, Sample
from tltd.supervisor.live_requests import LiveRequests, StreamEvent
from tltd.supervisor.work_queue import RequestLedger
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
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self.store = store
        self.requests = requests
        self.queue = requests.queue
        self.handles = handles
        self.writes = writes
        self._spawn = spawn

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
        await self._park_units(units)
        return len(units)

    def took(self, live: RequestLedger, sample: Sample, stored: bool) -> bool:
        """A sample came back paused (a park, or the step's token budget): it no longer runs
        here and is not finished here; True when it was such a sample (then it is handled)."""
        budget = live.req.bound_tokens > 0
        if sample.finish_reason is not FinishReason.ABORTED or live.outcome is not None:
            return False
        if not (live.parking or budget):
            return False
        key = (sample.prompt_index, sample.sample_index)
        if not self.queue.paused(live.request_id, key):
            return True  # not running here (a duplicate): nothing changes
        if stored:  # to the callers that asked for partial samples
            self.requests.publish(live.request_id, StreamEvent(sample))
        if not live.parking:
            live.paused.add(key)
            self._spawn(self.settle(live, key[0]))
        return True

    async def settle(self, live: RequestLedger, p: int) -> None:
        """Park a unit of a budgeted request once each of its samples is done or paused, one
        of them paused: the job's next carried request goes on from the paused ones."""
        keys = {(p, s) for s in range(live.req.sampling.n)}
        paused = keys & live.paused
        if not paused or p not in live.units or not keys <= live.finished | live.paused:
            return
        live.paused -= paused
        await self._park_units({(live.request_id, p)})

    async def _park_units(self, units: set[tuple[str, int]]) -> None:
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
            log.info("prompts parked at their step bound", extra={"units": len(units)})
