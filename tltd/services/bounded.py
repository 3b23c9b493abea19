"""A bounded Generate stream (asynchronous RL): whole groups, each once, until the bound.

The stream sends what the store records as sent to it (`tltd.store.deliveries`): first, on a
retry, the groups it sent before; then groups taken as they are done, the job's carried ones
first when asked, until `bound_groups` were sent or no more can come. The request's other
prompts keep running after the stream ends; a later bounded request of the job that sets
`carried` sends them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tltd.domain import JobStatus, RolloutRequest, Sample
from tltd.metrics import METRICS
from tltd.store.deliveries import Delivery, SentGroup, version_spread

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.supervisor.live_requests import StreamEvent


@dataclass
class Taken:
    """Groups a bounded stream took in this call (not counting those a retry re-sends)."""

    groups: int = 0


async def follow_bounded(
    store: Store,
    req: RolloutRequest,
    events: asyncio.Queue[StreamEvent],
    poll_seconds: float,
    taken: Taken | None = None,
) -> AsyncIterator[list[Sample]]:
    """The samples of the groups sent to `req`'s stream, a list per take (never empty);
    `taken` counts the groups this call took."""
    rid, want = req.request_id, req.bound_groups
    before = await asyncio.to_thread(store.deliveries.sent_groups, rid)
    sent = len(before)
    if before:
        yield _samples(before)
    end = _deadline(req)
    while sent < want and time.time() < end:
        took = await asyncio.to_thread(store.deliveries.take_groups, rid, want - sent, req.carried)
        _observe(req.job_id, took)
        if took.groups:
            sent += len(took.groups)
            if taken is not None:
                taken.groups += len(took.groups)
            yield _samples(took.groups)
            continue  # more may be done already
        if not took.more_may_come:
            return  # every unit it could take is sent or dropped: fewer than asked
        await _woken(events, min(poll_seconds, max(0.0, end - time.time())))


def _deadline(req: RolloutRequest) -> float:
    """When the stream ends with what it sent (wall clock): `bound_deadline_ms` after the
    request's acceptance, which a retry keeps; never without one."""
    if not req.bound_deadline_ms or req.created_at is None:
        return math.inf
    return req.created_at.timestamp() + req.bound_deadline_ms / 1000.0


def staleness_allows(
    prompts_so_far: int, new_prompts: int, bound_groups: int, version: int, eta: int | None
) -> bool:
    """AReaL's admission rule for a job with staleness bound `eta`: the bounded prompts it has
    accepted stay within (eta + version + 1) x B, B the step's groups, so the daemon starts no
    sample more than eta versions before the trainer will take it. A job's first request is
    always admitted."""
    if eta is None or prompts_so_far == 0:
        return True
    return prompts_so_far + new_prompts <= (eta + version + 1) * bound_groups


async def wait_for_staleness(store: Store, req: RolloutRequest, poll_seconds: float) -> None:
    """Hold a new bounded request until its job's staleness bound admits it (a new policy
    version raises the bound); a job without a bound admits it at once."""
    while True:
        job = await asyncio.to_thread(store.jobs.get, req.job_id)
        if job.max_staleness is None or job.status is not JobStatus.ACTIVE:
            return  # (admission refuses a job that is not active)
        so_far = await asyncio.to_thread(store.deliveries.bounded_prompts, req.job_id)
        if staleness_allows(
            so_far, len(req.prompts), req.bound_groups, job.policy_version, job.max_staleness
        ):
            return
        await asyncio.sleep(poll_seconds)


def _samples(groups: tuple[SentGroup, ...] | list[SentGroup]) -> list[Sample]:
    return [x for g in groups for x in g.samples]


def _observe(job_id: str, took: Delivery) -> None:
    if took.groups or took.stale:
        METRICS.observe_groups(
            job_id,
            [g.staleness for g in took.groups],
            [g.carried for g in took.groups],
            len(took.stale),
            [version_spread(x) for g in took.groups for x in g.samples],
        )


async def _woken(events: asyncio.Queue[StreamEvent], seconds: float) -> None:
    """Wait for a sample stored here (or any wake-up), at most `seconds`: a group carried
    from another request, or done on another node, is found by the next take."""
    if events.empty():
        try:  # asyncio.timeout: wait_for (3.11) can swallow the stream's cancel
            async with asyncio.timeout(seconds):
                await events.get()
        except TimeoutError:
            return
    while not events.empty():
        events.get_nowait()
