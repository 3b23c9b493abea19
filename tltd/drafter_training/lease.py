"""Several nodes on PostgreSQL: which node trains a job's drafter, and from which samples.

A job's drafter trains on one node at a time, under the drafter lease of
`tltd.store.drafter_leases`. A round starts only on the node that holds (or takes) the lease;
`renew` (a periodic job) extends it while the trainer lives and reports the jobs whose lease
was lost (their trainer is stopped: another node may train that drafter now); a stopped
trainer releases it. Samples come from the store, every node's, after the lease's cursor (the
held-out ones are those whose row id is a multiple of `training_held_out_every`, the same on
every node); a publish is fenced by the lease epoch and moves the cursor to the last sample
read before it (what a holder read and never published is read again by the next one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tltd.domain import DrafterLease
from tltd.drafter_training.samples import SampleBuffers, training_sample
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.store.drafter_leases import FinishedSample

log = logging.getLogger(__name__)


class LeaseHolder:
    """This node's drafter leases, its read position in every job's samples, and how many
    samples of every node wait for each job (`backlog`)."""

    def __init__(self, store: Store, settings: Settings, buffers: SampleBuffers) -> None:
        self.store = store
        self.settings = settings
        self.buffers = buffers
        self.held: dict[str, DrafterLease] = {}  # the leases held here
        self.backlog: dict[str, int] = {}  # unconsumed samples of every node, per job
        self.asked: set[str] = set()  # jobs the scheduler asked about
        self.read_to: dict[str, int] = {}  # job -> the last sample id read into its buffers
        self._pulled: dict[str, int] = {}  # job -> lease epoch its buffers were filled under
        self._renewer = ThreadPoolExecutor(1, thread_name_prefix="drafter-lease")

    async def claim(self, job_id: str) -> DrafterLease | None:
        """Take or extend the job's drafter lease; None while another node holds it."""
        try:
            lease = await asyncio.to_thread(
                self.store.drafter_leases.claim, job_id, self.settings.drafter_lease_seconds
            )
        except Exception:
            log.exception("drafter lease claim failed", extra={"job_id": job_id})
            return None
        if lease is None:
            log.debug("drafter training runs on another node", extra={"job_id": job_id})
            self.held.pop(job_id, None)
            return None
        held = self.held.get(job_id)
        if held is None or held.lease_epoch != lease.lease_epoch:
            log.info(
                "drafter lease taken",
                extra={
                    "job_id": job_id,
                    "lease_epoch": lease.lease_epoch,
                    "taken_from": lease.taken_from or "-",
                    "cursor": lease.cursor,
                },
            )
        self.held[job_id] = lease
        return lease

    async def pull(self, job_id: str, lease: DrafterLease) -> bool:
        """Read the job's samples (every node's) after what this node has read under the
        lease, at first after the lease's cursor, into the buffers; a new lease first refills
        them with the newest samples up to the cursor (what the drafter was trained on). The
        cursor moves when a version is published. False when the samples cannot be read."""
        store, cfg = self.store, self.settings
        recent = cfg.training_recent_samples
        try:
            if self._pulled.get(job_id) != lease.lease_epoch:
                self.buffers.clear(job_id)
                n = recent + cfg.training_held_out_samples * cfg.training_held_out_every
                older = await asyncio.to_thread(
                    store.drafter_leases.finished_samples,
                    job_id,
                    0,
                    n,
                    up_to=lease.cursor,
                    newest=True,
                )
                self._take(job_id, older)
                self._pulled[job_id] = lease.lease_epoch
                self.read_to[job_id] = lease.cursor
            after = max(self.read_to.get(job_id, 0), lease.cursor)
            new = await asyncio.to_thread(
                store.drafter_leases.finished_samples, job_id, after, recent
            )
        except Exception:
            log.exception("drafter samples not read", extra={"job_id": job_id})
            return False
        if new:
            self._take(job_id, new)
            self.read_to[job_id] = new[-1].sample_id
        return True

    def _take(self, job_id: str, samples: list[FinishedSample]) -> None:
        """Samples read from the store into the buffers: held out when their row id is a
        multiple of training_held_out_every (the same split on every node)."""
        every = self.settings.training_held_out_every
        for f in samples:
            item = training_sample(f.prompt, f.token_ids, f.policy_version)
            if item is not None:
                self.buffers.add(job_id, item, held_out=f.sample_id % every == 0)

    async def renew(self, live_epoch: Callable[[str], int | None]) -> list[str]:
        """Extend the lease of every job whose trainer lives here (`live_epoch`: the lease
        epoch its live trainer runs under, None: none) and read how many samples of every node
        wait for each job. Returns the jobs whose lease was lost."""
        lost = []
        for job_id, lease in list(self.held.items()):
            if live_epoch(job_id) != lease.lease_epoch:
                continue
            try:
                # Its own thread: a renewal queued behind busy store calls could let it lapse.
                ok = await asyncio.get_running_loop().run_in_executor(
                    self._renewer,
                    self.store.drafter_leases.renew,
                    job_id,
                    lease.lease_epoch,
                    self.settings.drafter_lease_seconds,
                )
            except Exception:
                log.exception("drafter lease renewal failed", extra={"job_id": job_id})
                continue
            if ok:
                continue
            lost.append(job_id)
            self.held.pop(job_id, None)
            log.warning("drafter lease lost: trainer stopped", extra={"job_id": job_id})
        try:
            self.backlog = await asyncio.get_running_loop().run_in_executor(
                self._renewer,
                self.store.drafter_leases.backlog,
                sorted(self.asked),
                dict(self.read_to),
            )
        except Exception:
            log.exception("drafter backlog not read")
        return lost

    def waiting(self) -> bool:
        """Whether some job has enough samples of every node waiting for a round."""
        need = self.settings.training_min_fresh_samples
        return any(n >= need for n in self.backlog.values())

    def forget_if_held(self, job_id: str, lease_epoch: int) -> bool:
        """Whether this node holds the job's lease at this epoch; forgets it if so."""
        lease = self.held.get(job_id)
        if lease is None or lease.lease_epoch != lease_epoch:
            return False
        self.held.pop(job_id, None)
        return True
