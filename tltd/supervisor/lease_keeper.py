"""This node's side of the work leases: claim units sized to the free capacity, renew what it
holds, stop what it lost, and follow cancels recorded by other nodes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tltd.contract import rollout_messages as msg
from tltd.domain import ENDED_STATUSES, FinishReason, NodeStatus, RequestStatus
from tltd.settings import Settings
from tltd.store.leases import Claim, ClaimedState
from tltd.supervisor.live_requests import LiveRequests
from tltd.supervisor.worker_process import ALIVE, Phase, WorkerHandle

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

_ALL = 1 << 20  # a claim with no capacity bound (a draining node alone ends what is queued)


class LeaseKeeper:
    """This node keeping its work leases: what it claims, renews, gives back and loses. The
    lease rows, shared by every node, are the store's (`tltd.store.leases.WorkLeases`)."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        requests: LiveRequests,
        handles: Mapping[str, WorkerHandle],
        close: Callable[[str, RequestStatus, str], Awaitable[None]],
    ) -> None:
        self.store = store
        self.settings = settings
        self.requests = requests
        self.queue = requests.queue
        self.handles = handles
        self._close = close  # closes a live request (a cancel or failure decided elsewhere)
        self.claim_soon = True  # a request was just stored here: claim at the next tick
        self._last_claim = 0.0
        self._others: tuple[float, bool] = (-1e9, False)  # (when read, another node up)
        self._renewer = ThreadPoolExecutor(1, thread_name_prefix="lease-renewal")

    def free_capacity(self) -> int:
        """Samples this node's ready workers could take beyond what they run and what waits."""
        free, waiting = self._slots((Phase.READY,))
        return max(0, free - waiting)

    def _slots(self, phases: tuple[Phase, ...]) -> tuple[int, int]:
        """(free slots of the workers in `phases`, samples waiting for one) on this node."""
        cap = self.settings.worker_max_batch
        free = sum(
            cap - self.queue.inflight(h.worker_id)
            for h in self.handles.values()
            if h.phase in phases and h.device.schedulable
        )
        waiting = sum(len(idx) for live in self.queue for idx in live.pending.values())
        return free, waiting

    def admission_capacity(self, draining: bool) -> int:
        """Samples a request admitted here now may lease to this node in its own transaction
        (`store.requests.admit`): all of them while this node is alone (it would claim every
        queued unit at its next tick anyway); none while other nodes are up (their queued
        units come first, in the order `claim_units` takes them), or while it drains. A store
        call (`others_up`): not on the event loop."""
        if draining or self.others_up():
            return 0
        return _ALL

    def release_excess(self) -> int:
        """With other nodes up, give back units none of whose samples started here while more
        samples wait than this node's free slots (it claimed everything while alone, or lost
        a worker, or a device was cordoned): the others run them. The youngest go first, and
        only while what stays still fills the free slots, so nothing is claimed straight
        back. Returns the units released."""
        # A worker loading a policy or starting again keeps its slots: a push does not give
        # the backlog away.
        free, waiting = self._slots(ALIVE)
        excess, units = waiting - free, set[tuple[str, int]]()
        lives = sorted(self.queue, key=lambda live: live.enqueued_at, reverse=True)
        for live in lives:
            started = {p for p, _ in live.running} | {p for p, _ in live.finished}
            # A unit that lost a worker stays: given back, its claim would not count, and a
            # sample that kills workers would go from node to node for ever.
            started |= {p for (p, _), n in live.attempts.items() if n}
            for p in sorted(live.units - started, reverse=True):
                size = len(live.pending.get(p, ()))
                if 0 < size <= excess:
                    units.add((live.request_id, p))
                    excess -= size
        if units:
            self.requests.lose_units(units, "unit released: another node has room")
            self.requests.release(units)
        return len(units)

    async def claim(
        self,
        refuse: Callable[[str, int], tuple[FinishReason, str] | None],
        *,
        draining: bool = False,
        everything: bool = False,
    ) -> int:
        """Claim what fits (at most every `claim_interval_seconds`, sooner after a local
        submit); returns the units claimed. With other nodes up, a node claims what its free
        capacity fits, so that work spreads; alone, it claims every queued unit, so that its
        scheduler's priorities and fair share see all the work; once others are up, it gives
        back what it cannot start (`release_excess`). A draining node claims nothing while
        another node is up to run the work; alone, it goes on claiming during the grace
        and then (`everything`) ends what is queued through `refuse`: nobody else would."""
        now = time.monotonic()
        if not self.claim_soon and now - self._last_claim < self.settings.claim_interval_seconds:
            return 0
        others = self._others_known()
        if others is None:
            others = await asyncio.to_thread(self.others_up)
        if draining and others:
            self._last_claim, self.claim_soon = now, False
            return 0
        if others and not everything:
            self.release_excess()
        free = _ALL if everything or not others else self.free_capacity()
        if free <= 0:
            return 0
        self._last_claim, self.claim_soon = now, False
        claims, state = await asyncio.to_thread(self._claim_and_read, free)
        if claims:
            await self.requests.take_claims(claims, state, refuse)
        return len(claims)

    def _claim_and_read(self, free: int) -> tuple[list[Claim], ClaimedState | Exception]:
        """Claim (its own transaction: committed, the units are this node's) and read what the
        claimed units need (`store.leases.claimed_state`), in one thread hop. A failed read is
        returned, not raised: the claims stand, and `take_claims` lets their leases lapse."""
        s = self.settings
        claims = self.store.leases.claim_units(free, s.lease_seconds, s.session_affinity_seconds)
        if not claims:
            return claims, {}
        try:
            return claims, self.store.leases.claimed_state(sorted({c.request_id for c in claims}))
        except Exception as exc:
            return claims, exc

    def hand_over(self) -> int:
        """A draining node with others up gives them every unit it holds (after its workers
        returned what runs as partial samples, see `NodeDrain`): a worker still running one
        cancels it (its late samples are fenced, not stored), the units go back to the
        queue, and another node re-runs their missing samples. Returns the units."""
        units = {(live.request_id, p) for live in self.queue for p in live.units}
        for wid, rid in self.requests.lose_units(units, "unit handed to the other nodes"):
            handle = self.handles.get(wid)
            if handle is not None:
                handle.send(msg.Cancel(rid))
        self.requests.release(units)
        return len(units)

    def others_up(self) -> bool:
        """Another node is up (its heartbeat younger than node_down_seconds); read at most
        once per heartbeat period."""
        now = time.monotonic()
        if now - self._others[0] >= self.settings.node_heartbeat_seconds:
            self._others = (now, self._others_up())
        return self._others[1]

    def _others_known(self) -> bool | None:
        """`others_up` while its last read is fresh (no thread hop needed), else None."""
        if time.monotonic() - self._others[0] >= self.settings.node_heartbeat_seconds:
            return None
        return self._others[1]

    def _others_up(self) -> bool:
        nodes = self.store.nodes.list(self.settings.node_down_seconds)
        return any(n.status is NodeStatus.UP and n.node_id != self.store.node_id for n in nodes)

    async def renew(self) -> set[tuple[str, int]]:
        """Renew the lease of every unit this node runs; stop the units not renewed (their
        lease expired: another node may run them now) and close requests ended elsewhere (a
        cancel on another node). A unit leased here that runs nowhere here (its claim met a
        database outage) is not renewed: its lease lapses and it is claimed again. Returns
        the units lost."""
        held = {(live.request_id, p): c for live in self.queue for p, c in live.claims.items()}
        # Its own thread: a renewal queued behind busy store calls could let leases lapse.
        renewed = await asyncio.get_running_loop().run_in_executor(
            self._renewer, self.store.leases.renew, set(held), self.settings.lease_seconds
        )
        # Only the claims this renewal was for: a unit lost meanwhile (e.g. at a rejoin while
        # the store was locked) and claimed again is a new lease this renewal did not cover.
        lost = {k for k in held.keys() - renewed if self.queue.claim_of(*k) == held[k]}
        if lost:
            self.stop(lost)
        ids = [live.request_id for live in self.queue if live.outcome is None]
        statuses = await asyncio.to_thread(self.store.leases.request_statuses, ids)
        for rid, (status, reason) in statuses.items():
            live = self.queue.get(rid)
            if live is not None and live.outcome is None and status in ENDED_STATUSES:
                await self._close(rid, RequestStatus(status), reason)
        return lost

    async def follow(self, request_id: str) -> None:
        """A request ended on another node (a notification): close it here if it runs here."""
        live = self.queue.get(request_id)
        if live is None or live.outcome is not None:
            return
        statuses = await asyncio.to_thread(self.store.leases.request_statuses, [request_id])
        status, reason = statuses.get(request_id, ("", ""))
        if status in ENDED_STATUSES:
            await self._close(request_id, RequestStatus(status), reason)

    def stop(self, lost: set[tuple[str, int]]) -> None:
        """Forget lost units; a worker running samples of one cancels its request's samples
        (workers cancel by request), so every other unit of it held here is given back."""
        cancels = self.requests.lose_units(lost)
        for wid, rid in cancels:
            handle = self.handles.get(wid)
            if handle is not None:
                handle.send(msg.Cancel(rid))
        for rid in {rid for _, rid in cancels}:
            live = self.queue.get(rid)
            if live is not None:
                units = {(rid, p) for p in live.units}
                self.requests.lose_units(units)
                self.requests.release(units)
