"""The devices and active jobs a scheduler tick decides on, read again only when they may have
changed.

Every sample, admission and lease event wakes the tick, several times per request; the devices
and jobs it reads change far more rarely. A read is reused while the store's count of committed
writes to those tables (`Database.scheduling_writes`) is unchanged and it is younger than
`max_age`. Another node's writes (a job created or re-weighted there, a device cordoned
through it, a drafter it promoted) move the count through a notification on PostgreSQL; a
notification can be missed, so a read is never reused past `max_age`, the tick's period: a
tick then sees such a write no later than a tick woken by nothing would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tltd.domain import Device, Job, JobStatus

KEEP_IN_PLACE = "keep"  # the pause mode (tltd.services.pause.PauseMode.KEEP) that freezes

if TYPE_CHECKING:
    from tltd.store import Store


@dataclass(frozen=True)
class _Read:
    generation: int
    at: float
    devices: list[Device]
    jobs: dict[str, Job]
    frozen: frozenset[str]  # jobs paused with their requests kept in place


class TickState:
    """The tick's last read of devices and active jobs, and whether it may be reused."""

    def __init__(self, store: Store, max_age: float) -> None:
        self.store = store
        self.max_age = max_age
        self._last: _Read | None = None
        self.reads = 0  # store reads made (the rest were reused)

    @property
    def frozen(self) -> frozenset[str]:
        """The jobs paused with their requests kept in place, as of the last read."""
        return self._last.frozen if self._last is not None else frozenset()

    def reusable(self) -> tuple[list[Device], dict[str, Job]] | None:
        """The last read, when nothing it holds can have changed since (no store access)."""
        last = self._last
        if last is None or last.generation != self.store.db.scheduling_writes.generation:
            return None
        if time.monotonic() - last.at >= self.max_age:
            return None
        return last.devices, last.jobs

    def read(self) -> tuple[list[Device], dict[str, Job]]:
        """Read the store (worker thread)."""
        # Taken before the read: a write committed while it runs moves it, so this read is not
        # reused after that write.
        generation = self.store.db.scheduling_writes.generation
        at = time.monotonic()
        devices, jobs = self.store.jobs.devices_and_jobs([JobStatus.ACTIVE])
        frozen = self.store.jobs.paused(KEEP_IN_PLACE)
        self.reads += 1
        self._last = _Read(generation, at, devices, {j.job_id: j for j in jobs}, frozen)
        return self._last.devices, self._last.jobs
