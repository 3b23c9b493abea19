"""Which model each rollout worker holds: job, policy version and drafter, and loading them.

Which job a worker serves is the scheduler's decision (`tltd.scheduler`, a `Switch` sets
`handle.next_job`); this module carries it out. Policy versions: a request runs entirely on the
policy version that was current when it was accepted ("finish on the old version"). A worker
switches version (or job) only when it has nothing running, to the oldest version that still has
waiting work, else to its job's current version; a promoted drafter is hot-swapped in between
steps. A job with PolicySwitch.NEXT_STEP opts out: its workers load its current version as soon
as it is recorded, busy or not, and running samples continue on it from their next decode step
(the engine records the switch per sample); its waiting work runs on whatever version a worker
holds.

A node runs the active drafter version when it can read it (shared storage, or its own, and
the directory is there); otherwise the newest promoted version it can read, else none.

A version that failed to load is held back (not loaded, its new requests refused) for a while
that doubles with each failure in a row, from 30 s up to 10 min, and is forgotten once it loads:
a failure may be transient (a disk hiccup, out of memory), so it must not condemn the version
for the daemon's life, nor be retried in a tight loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.contract import rollout_messages as msg
from tltd.domain import (
    MODEL_FREE_DRAFTERS,
    Backend,
    DeviceKind,
    DrafterStatus,
    DrafterVersion,
    Job,
    PolicySwitch,
    SpeculativeMode,
)
from tltd.settings import Settings
from tltd.supervisor.work_queue import WorkQueue
from tltd.supervisor.worker_process import Load, LoadKind, Phase, WorkerHandle

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# Restart a worker's process on another backend (the supervisor owns processes).
SwitchBackend = Callable[[WorkerHandle, Backend], Awaitable[None]]

# How long a node runs another drafter version than the active one before it looks again
# whether it can read the active one (a shared mount back, a directory copied in).
_DRAFTER_RECHECK_SECONDS = 30.0


def switches_at_step(job: Job | None) -> bool:
    """The job's running samples move to a new policy version at the next decode step."""
    return job is not None and job.policy_switch is PolicySwitch.NEXT_STEP


class HeldBack:
    """Keys (job, version) that failed, each held back until a retry time; the hold starts at
    `first` seconds and doubles with every failure in a row, up to `longest`. `clock` is
    monotonic seconds (tests pass their own)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        first: float = 30.0,
        longest: float = 600.0,
    ) -> None:
        self.clock, self.first, self.longest = clock, first, longest
        self._failures: dict[Hashable, int] = {}  # failures in a row, kept after a hold ends
        self._until: dict[Hashable, float] = {}

    def fail(self, key: Hashable) -> float:
        """Record a failure; returns how long `key` is held back. A failure while it is held
        back already (another worker's load, sent before the first failure) is the same try."""
        if (left := self.retry_in(key)) is not None:
            return left
        n = self._failures[key] = self._failures.get(key, 0) + 1
        hold = min(self.longest, self.first * 2 ** min(n - 1, 32))  # no float overflow
        self._until[key] = self.clock() + hold
        return hold

    def clear(self, key: Hashable) -> None:
        """`key` worked: the next failure starts the backoff afresh."""
        self._failures.pop(key, None)
        self._until.pop(key, None)

    def retry_in(self, key: Hashable) -> float | None:
        """Seconds until `key` may be tried again; None when it is not held back."""
        left = self._until.get(key, 0.0) - self.clock()
        return left if left > 0 else None

    def __contains__(self, key: Hashable) -> bool:
        return self.retry_in(key) is not None


class ModelPlanner:
    """Points every empty worker at the (job, policy version) it should hold next."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        switch_backend: SwitchBackend | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.settings = settings
        self.switch_backend = switch_backend
        self.bad_versions = HeldBack(clock)  # (job, policy version) that failed to load
        self.bad_drafters = HeldBack(clock)  # (job, drafter version) that failed to load
        self.clock = clock
        # (job, active drafter version) -> (version run here, its path, until when)
        self._drafters: dict[tuple[str, int], tuple[int, str, float]] = {}
        self._told: set[tuple[str, int]] = set()  # unreadable active versions already logged
        # (worker, job, policy version) that failed on one worker while another runs it: that
        # device's trouble (out of memory there), not the version's.
        self.bad_here = HeldBack(clock)
        self._paths: dict[tuple[str, int], str] = {}

    async def plan(
        self, handles: Mapping[str, WorkerHandle], queue: WorkQueue, jobs: dict[str, Job]
    ) -> None:
        """Send each ready worker the load it needs now (policy first, else the drafter)."""
        pending: dict[str, set[int]] = {}
        for p in queue.pending_work():
            if not switches_at_step(jobs.get(p.job_id)):
                pending.setdefault(p.job_id, set()).add(p.policy_version or 0)
        for handle in handles.values():
            if handle.phase is not Phase.READY:
                continue
            job = jobs.get(handle.job_id)
            if await self._broadcast_recorded(handle, job):
                # An SGLang engine holds the recorded version's weights already and its
                # samples wait for them (none runs): switch now, whatever is in flight.
                await self._load(handle, job, job.policy_version)  # type: ignore[union-attr]
                continue
            if queue.inflight(handle.worker_id) == 0:
                target = self._target(handle, jobs, pending)
                if target is not None and target != (handle.job_id, handle.policy_version):
                    await self._load(handle, jobs[target[0]], target[1])
                    continue
            elif (
                job is not None
                and switches_at_step(job)
                and not handle.next_job
                and handle.policy_version < job.policy_version
                and (job.job_id, job.policy_version) not in self.bad_versions
                and (handle.worker_id, job.job_id, job.policy_version) not in self.bad_here
            ):
                await self._load(handle, job, job.policy_version)  # between two steps
                continue
            if job is not None:
                await self._sync_drafter(handle, job)

    def _target(
        self,
        handle: WorkerHandle,
        jobs: dict[str, Job],
        pending: dict[str, set[int]],
    ) -> tuple[str, int] | None:
        """What an empty worker should hold: the job the scheduler switched it to; else its
        job's oldest version with waiting work; else its job's current version (an idle worker
        pre-loads a pushed policy); a worker with no job takes the newest job when no work
        waits (else the scheduler picks its job)."""

        def ok(job_id: str, v: int) -> bool:
            here = (handle.worker_id, job_id, v)
            return (job_id, v) not in self.bad_versions and here not in self.bad_here

        def oldest(job_id: str) -> int | None:
            return min((v for v in pending.get(job_id, ()) if ok(job_id, v)), default=None)

        own = handle.job_id if handle.job_id in jobs else ""
        if handle.next_job == handle.job_id or handle.next_job not in jobs:
            handle.next_job = ""  # done, called off, or its job ended
        if nxt := handle.next_job:
            if (v := oldest(nxt)) is not None:
                return nxt, v
            if ok(nxt, jobs[nxt].policy_version):
                return nxt, jobs[nxt].policy_version
            handle.next_job = ""  # its job cannot be loaded: the scheduler picks again
        if own and (v := oldest(own)) is not None:
            return own, v  # old requests finish on their version
        if own and ok(own, jobs[own].policy_version):
            return own, jobs[own].policy_version
        if not own and jobs and not pending:
            newest = max(jobs.values(), key=lambda j: (j.created_at or 0, j.job_id))
            if ok(newest.job_id, newest.policy_version):
                return newest.job_id, newest.policy_version
        return None

    async def _load(self, handle: WorkerHandle, job: Job, version: int) -> None:
        if job.backend is not handle.backend and self.switch_backend is not None:
            # Another engine, another process: the fresh one is empty and gets this load then.
            await self.switch_backend(handle, job.backend)
            return
        path = await self._policy_path(job.job_id, version)
        if handle.job_id == job.job_id:
            handle.start_load(Load(LoadKind.POLICY, job.job_id, version))
            handle.send(msg.LoadPolicy(path, version))
            handle.reason = f"loading policy version {version}"
            return
        device = "cpu" if handle.device.kind is DeviceKind.CPU else handle.device.device_id
        engine = msg.EngineSpec.for_job(
            job.speculative,
            max_batch=self.settings.worker_max_batch,
            max_seq_len=self.settings.worker_max_seq_len,
            gate=self.settings.spec_gate,
            device=device,
            prefix_cache_bytes=self.settings.worker_prefix_cache_mb << 20,
            cost_budget_s=self.settings.worker_cost_budget_seconds,
        )
        handle.start_load(Load(LoadKind.MODEL, job.job_id, version))
        every = self.settings.sample_checkpoint_seconds
        handle.send(msg.LoadModel(job.job_id, path, version, engine, checkpoint_seconds=every))
        handle.reason = f"loading job {job.job_id} policy version {version}"

    async def _broadcast_recorded(self, handle: WorkerHandle, job: Job | None) -> bool:
        """The broadcast the worker's engine joined became the job's current version."""
        if not handle.broadcast_path or job is None or handle.policy_version >= job.policy_version:
            return False
        if (job.job_id, job.policy_version) in self.bad_versions:
            return False  # it failed to load: the usual path retries it after the backoff
        return await self._policy_path(job.job_id, job.policy_version) == handle.broadcast_path

    async def _policy_path(self, job_id: str, version: int) -> str:
        key = (job_id, version)
        if key not in self._paths:
            pv = await asyncio.to_thread(self.store.policies.get, job_id, version)
            self._paths[key] = pv.path
        return self._paths[key]

    async def _sync_drafter(self, handle: WorkerHandle, job: Job) -> None:
        """Hot-swap the job's learned drafter into the worker (between steps): the active
        version, or the one this node runs in its place (`_drafter_here`)."""
        wanted, path = job.drafter_version, ""
        if (
            job.speculative.mode is SpeculativeMode.OFF
            or job.speculative.drafter in MODEL_FREE_DRAFTERS
        ):
            wanted = 0
        if wanted:
            wanted, path = await self._drafter_here(job.job_id, wanted)
        if wanted == handle.drafter_version or (job.job_id, wanted) in self.bad_drafters:
            return
        handle.start_load(Load(LoadKind.DRAFTER, job.job_id, wanted))
        handle.send(msg.SetDrafter(path, wanted))

    async def _drafter_here(self, job_id: str, active: int) -> tuple[int, str]:
        """The drafter version this node runs for `active` and its path (0, "": none)."""
        key = (job_id, active)
        hit = self._drafters.get(key)
        if hit is None or hit[2] <= self.clock():
            hit = await asyncio.to_thread(self._choose_drafter, job_id, active)
            self._drafters[key] = hit
        return hit[0], hit[1]

    def _choose_drafter(self, job_id: str, active: int) -> tuple[int, str, float]:
        """`active` when this node can read it; else the newest promoted version it can read
        (one it trained itself, one on shared storage), else none, looked at again after
        `_DRAFTER_RECHECK_SECONDS`. Why the active one is not run is logged once."""
        dv = self.store.drafters.get(job_id, active)
        why = self._unreadable(dv)
        if why is None:
            return active, dv.path, math.inf
        readable = [
            v
            for v in self.store.drafters.list(job_id)
            if v.version != active
            and v.status is DrafterStatus.PROMOTED
            and self._unreadable(v) is None
        ]
        version, path = (readable[-1].version, readable[-1].path) if readable else (0, "")
        if (job_id, active) not in self._told:
            self._told.add((job_id, active))
            log.warning(
                "active drafter version %d not readable on this node (%s): running %s",
                active,
                why,
                f"version {version}" if version else "without a learned drafter",
                extra={"job_id": job_id, "version": active, "fallback_version": version},
            )
        return version, path, self.clock() + _DRAFTER_RECHECK_SECONDS

    def _unreadable(self, dv: DrafterVersion) -> str | None:
        """Why this node cannot load `dv`, or None when it can."""
        if not dv.readable_on(self.store.node_id):
            return f"on node {dv.node_id}'s own storage"
        if not Path(dv.path).is_dir():
            return f"no directory {dv.path} on this node"
        return None

    def load_failed(
        self, m: msg.LoadFailed, handle: WorkerHandle, handles: Mapping[str, WorkerHandle]
    ) -> str | None:
        """Hold back a version that failed to load on `handle`; for a policy, the reason its
        live requests fail. A policy version another worker runs is held back on `handle` only:
        its requests run there, and new ones are taken."""
        key = (m.job_id, m.policy_version)
        if not m.drafter and any(
            o is not handle and o.answered and (o.job_id, o.policy_version) == key
            for o in handles.values()
        ):
            hold = self.bad_here.fail((handle.worker_id, *key))
            log.error(
                "policy load failed on one worker; another runs it",
                extra={
                    "job_id": m.job_id,
                    "worker_id": handle.worker_id,
                    "error": m.message,
                    "retry_in_seconds": round(hold),
                },
            )
            return None
        if m.drafter:
            hold = self.bad_drafters.fail(key)
            log.error(
                "drafter load failed",
                extra={"job_id": m.job_id, "error": m.message, "retry_in_seconds": round(hold)},
            )
            return None
        hold = self.bad_versions.fail(key)
        log.error(
            "policy load failed",
            extra={"job_id": m.job_id, "error": m.message, "retry_in_seconds": round(hold)},
        )
        return (
            f"cannot load policy version {m.policy_version} of job {m.job_id}: {m.message} "
            f"(retried in {math.ceil(hold)}s)"
        )

    def loaded(self, m: msg.Ready, handle: WorkerHandle) -> None:
        """A worker reports what it holds now: those versions do load (a failure elsewhere was
        transient or that device's), so they are held back no more."""
        if m.job_id:
            self.bad_versions.clear((m.job_id, m.policy_version))
            self.bad_here.clear((handle.worker_id, m.job_id, m.policy_version))
            if m.drafter_version:
                self.bad_drafters.clear((m.job_id, m.drafter_version))

    def refusal(self, job_id: str, version: int) -> str | None:
        """Why a new request on this policy version is refused now, if it is."""
        left = self.bad_versions.retry_in((job_id, version))
        if left is None:
            return None
        return (
            f"cannot load policy version {version} of job {job_id}: its last load failed; "
            f"it is retried in {math.ceil(left)}s"
        )
