"""Fair-share accounts: tokens served per job, a job waking from idle placed level (as CFS does).

The scheduler ranks equal-priority jobs by virtual time, tokens served / weight
(`tltd.scheduler`). Counted over a job's whole life, a job that was idle for a while comes back
far behind and, with few workers, holds them until it has caught up: the jobs that kept working
starve meanwhile. Linux CFS places a waking task at the queue's minimum virtual runtime; here a
job going from no work (waiting or running) to some is lifted to at least the smallest virtual
time among the jobs of its priority that were already competing, so it starts level, not with
credit. Its account is never lowered: a job cannot shed what it was served by going idle.

With none of its priority competing, the smallest virtual time seen when some last were is used
(the jobs that all woke together then start level with where the last ones left off).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Set
from typing import Protocol

from tltd.supervisor.work_queue import WorkQueue


class Share(Protocol):
    """What the lift reads of a job (`tltd.domain.Job` and `tltd.scheduler.JobView` fit)."""

    @property
    def job_id(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def priority(self) -> int: ...


def lift_waking(
    accounts: Mapping[str, int],
    jobs: Iterable[Share],
    active: Set[str],
    was_active: Set[str],
    floors: Mapping[int, float],
) -> tuple[dict[str, int], dict[int, float]]:
    """The accounts of the jobs that woke (in `active`, not in `was_active`) that must rise,
    and the floor per priority for the next call: the smallest virtual time (account / weight)
    among the jobs of that priority active before and now, else the previous floor."""
    jobs = [j for j in jobs if j.job_id in active]

    def vt(j: Share) -> float:
        return accounts.get(j.job_id, 0) / max(j.weight, 1e-9)

    new_floors = dict(floors)
    for p in {j.priority for j in jobs}:
        competing = [vt(j) for j in jobs if j.priority == p and j.job_id in was_active]
        if competing:
            new_floors[p] = min(competing)
    lifted: dict[str, int] = {}
    for j in jobs:
        if j.job_id in was_active or j.priority not in new_floors:
            continue
        # Level, never a hair ahead: the scheduler splits workers only to a job that does not
        # lead in virtual time, so the floor (not the ceiling) of the product, checked in the
        # scheduler's own float arithmetic.
        floor, weight = new_floors[j.priority], max(j.weight, 1e-9)
        level = math.floor(floor * weight)
        if level / weight > floor:
            level -= 1
        if accounts.get(j.job_id, 0) < level:
            lifted[j.job_id] = level
    return lifted, new_floors


def active_jobs(queue: WorkQueue) -> set[str]:
    """Jobs with samples waiting for a worker or running on one."""
    return {
        live.job_id for live in queue if live.running or (live.pending and live.outcome is None)
    }


class FairShare:
    """The supervisor's fair-share accounts (`served`: tokens decoded per job, which it adds
    to) and what the lift remembers between ticks."""

    def __init__(self) -> None:
        self.served: Counter[str] = Counter()
        self._active: set[str] = set()
        self._floors: dict[int, float] = {}

    def accounts(self, jobs: Iterable[Share], active: Set[str]) -> Counter[str]:
        """The accounts for this tick's snapshot, waking jobs lifted (see the module
        docstring); `active` is the jobs with work now (`active_jobs`)."""
        lifted, self._floors = lift_waking(self.served, jobs, active, self._active, self._floors)
        for job_id, level in lifted.items():
            self.served[job_id] = level
        self._active = set(active)
        return self.served
