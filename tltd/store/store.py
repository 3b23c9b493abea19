"""The Store: short synchronous SQL transactions that speak domain dataclasses and TltErrors."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import case, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from tltd.domain import (
    ENDED_STATUSES,
    Device,
    DeviceState,
    DrafterStatus,
    DrafterVersion,
    Event,
    Job,
    JobStatus,
    PolicyVersion,
    RequestStatus,
    RolloutRequest,
    Sample,
    Worker,
    WorkerState,
)
from tltd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from tltd.settings import default_node_id
from tltd.store import convert
from tltd.store.database import WRITE_OPTION, WriteTurn, make_engine
from tltd.store.drafter_leases import DrafterLeases
from tltd.store.leases import WorkLeases
from tltd.store.nodes import NodeRegistry
from tltd.store.notifications import REQUEST, SAMPLE, WORK, notify
from tltd.store.sample_batches import SampleBatches, first_not_finite
from tltd.store.status import check_transition, record_event, switch_status
from tltd.store.tables import (
    DeviceRow,
    DrafterVersionRow,
    EventRow,
    JobPauseRow,
    JobRow,
    PolicyVersionRow,
    PushRow,
    RolloutRequestRow,
    SampleRow,
    WorkerRow,
    WorkUnitRow,
    utcnow,
)

log = logging.getLogger(__name__)

_JOB_PARAMS = (
    "model_path",
    "name",
    "backend",
    "priority",
    "weight",
    "speculative",
    "policy_switch",
)
_REQUEST_PARAMS = ("job_id", "prompts", "sampling", "speculative")
_FINAL_WORKER_STATES = (WorkerState.STOPPED, WorkerState.FAILED)
# Version columns are SQL INTEGER (signed 32-bit): no version is numbered above this.
MAX_VERSION = 2**31 - 1


def prompt_key(prompt: Sequence[int]) -> str:
    """A prompt's token ids as a fixed-width key (sha256 hex): the history drafter's look-up
    of a prompt's earlier answers across requests."""
    return hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()


def _diff(a: object, b: object, fields: Sequence[str]) -> list[str]:
    return [f for f in fields if getattr(a, f) != getattr(b, f)]


def _flags(row: DeviceRow) -> str:
    names = [n for n in ("cordoned", "draining") if getattr(row, n)]
    return "+".join(names) or "schedulable"


class Store(NodeRegistry, WorkLeases, DrafterLeases, SampleBatches):
    """All persistent state of the daemon; tables come from `tltd.store.migrate.upgrade`.

    `node_id` names the node whose devices and workers this store reads and writes (default:
    the host name); `epoch` is set when the node joins (`join_node`)."""

    def __init__(self, url: str, node_id: str = "") -> None:
        self.url = url
        self.node_id = node_id or default_node_id()
        self.epoch = 0
        self.engine = make_engine(url)
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        # Writers announce themselves so that SQLite takes its write lock at BEGIN.
        writer_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._writer = sessionmaker(writer_engine, expire_on_commit=False)
        # PostgreSQL locks rows; SQLite's writers take turns (WriteTurn).
        self._write_turn = WriteTurn() if self.dialect == "sqlite" else nullcontext

    @property
    def dialect(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Session]:
        if not write:
            with self._reader.begin() as session:
                yield session
            return
        with self._write_turn(), self._writer.begin() as session:
            yield session

    # ---- lookups shared by the methods below -------------------------------------------

    @staticmethod
    def _job_row(s: Session, job_id: str, *, lock: bool = False, share: bool = False) -> JobRow:
        """lock: FOR UPDATE; share: FOR SHARE (PostgreSQL; SQLite serializes writers anyway)."""
        row = s.get(JobRow, job_id, with_for_update={"read": True} if share else lock)
        if row is None:
            raise NotFound(f"job {job_id!r} not found", field="job_id")
        return row

    @staticmethod
    def _request_row(s: Session, request_id: str, *, lock: bool = False) -> RolloutRequestRow:
        row = s.get(RolloutRequestRow, request_id, with_for_update=lock)
        if row is None:
            raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
        return row

    @staticmethod
    def _drafter_row(s: Session, job_id: str, version: int) -> DrafterVersionRow:
        Store._job_row(s, job_id)
        row = None
        if version <= MAX_VERSION:  # a larger number names no version (and no SQL integer)
            row = s.scalar(
                select(DrafterVersionRow).where(
                    DrafterVersionRow.job_id == job_id, DrafterVersionRow.version == version
                )
            )
        if row is None:
            raise NotFound(
                f"drafter version {version} of job {job_id!r} not found", field="version"
            )
        return row

    def _device_row(self, s: Session, device_id: str) -> DeviceRow:
        """This node's device, or another node's as "NODE/DEVICE" (device ids have no "/")."""
        node, _, device = device_id.rpartition("/")
        row = s.get(DeviceRow, (node or self.node_id, device))
        if row is None:
            raise NotFound(f"device {device_id!r} not found", field="device_id")
        return row

    def _worker_row(self, s: Session, worker_id: str) -> WorkerRow:
        row = s.get(WorkerRow, (self.node_id, worker_id))
        if row is None:
            raise NotFound(f"worker {worker_id!r} not found", field="worker_id")
        return row

    @staticmethod
    def _active_versions(s: Session, job_ids: Sequence[str]) -> dict[str, int]:
        """Active drafter per job: the pinned version if any, else the newest promoted, else 0."""
        if not job_ids:
            return {}
        dv = DrafterVersionRow
        promoted = dv.status == DrafterStatus.PROMOTED.value
        # One query for both (every job read runs this): the pinned and the newest promoted.
        rows = s.execute(
            select(
                dv.job_id,
                func.max(case((dv.pinned.is_(True), dv.version))),
                func.max(case((promoted, dv.version))),
            )
            .where(dv.job_id.in_(job_ids), or_(dv.pinned.is_(True), promoted))
            .group_by(dv.job_id)
        ).all()
        found = {job_id: pinned or newest for job_id, pinned, newest in rows}
        return {j: int(found.get(j) or 0) for j in job_ids}

    def _job(self, s: Session, row: JobRow) -> Job:
        return convert.job_from_row(row, self._active_versions(s, [row.job_id])[row.job_id])

    # ---- jobs and policy versions -------------------------------------------------------

    def create_job(
        self, job: Job, initial_drafter: DrafterVersion | None = None
    ) -> tuple[Job, bool]:
        """Create a job (with policy version 0 = its model_path); a retry with the same
        parameters returns the existing job and False, different parameters raise AlreadyExists.

        `initial_drafter` (a checkpoint already in the daemon's storage) is recorded in the same
        transaction as drafter version 1 against policy version 0, PROMOTED, so the job is
        never seen without it; a retry ignores it (the caller removes its copy).
        """
        try:
            with self._tx() as s:
                existing = s.get(JobRow, job.job_id)
                if existing is not None:
                    return self._same_job(s, existing, job), False
                now = utcnow()
                row = convert.job_to_row(job)
                row.status, row.status_reason, row.policy_version = JobStatus.ACTIVE.value, "", 0
                row.created_at = row.updated_at = now
                s.add(row)
                s.add(
                    PolicyVersionRow(
                        job_id=job.job_id,
                        version=0,
                        source="initial",
                        path=job.model_path,
                        note="",
                        created_at=now,
                    )
                )
                record_event(s, "job", job.job_id, "", JobStatus.ACTIVE, "created", at=now)
                s.flush()  # the job row before its drafter row (foreign key)
                if initial_drafter is None:
                    return convert.job_from_row(row, 0), True
                dv = DrafterVersion(
                    job_id=job.job_id,
                    version=1,
                    policy_version=0,
                    path=initial_drafter.path,
                    train_steps=initial_drafter.train_steps,
                    loss=initial_drafter.loss,
                    acceptance_length=initial_drafter.acceptance_length,
                    status=DrafterStatus.PROMOTED,
                    node_id=initial_drafter.node_id,
                    shared=initial_drafter.shared,
                )
                drafter = convert.drafter_to_row(dv, 1)
                drafter.created_at = drafter.updated_at = now
                s.add(drafter)
                why = f"initial drafter from {job.speculative.initial_drafter_path}"
                record_event(
                    s, "drafter", f"{job.job_id}/1", "", DrafterStatus.PROMOTED, why, at=now
                )
                s.flush()
                return convert.job_from_row(row, 1), True
        except IntegrityError:
            # A concurrent create of the same id committed first: answer as a retry would.
            with self._tx(write=False) as s:
                existing = s.get(JobRow, job.job_id)
                if existing is None:
                    raise
                return self._same_job(s, existing, job), False

    def _same_job(self, s: Session, existing: JobRow, job: Job) -> Job:
        current = self._job(s, existing)
        diff = _diff(current, job, _JOB_PARAMS)
        if diff:
            raise AlreadyExists(
                f"job {job.job_id!r} already exists with different {', '.join(diff)}",
                field="job_id",
            )
        return current

    def get_job(self, job_id: str) -> Job:
        with self._tx(write=False) as s:
            return self._job(s, self._job_row(s, job_id))

    def list_jobs(self, statuses: Sequence[JobStatus] | None = None, limit: int = 100) -> list[Job]:
        """Jobs, newest first."""
        with self._tx(write=False) as s:
            q = select(JobRow).order_by(JobRow.created_at.desc(), JobRow.job_id.desc())
            if statuses:
                q = q.where(JobRow.status.in_([str(x) for x in statuses]))
            rows = s.scalars(q.limit(limit)).all()
            active = self._active_versions(s, [r.job_id for r in rows])
            return [convert.job_from_row(r, active[r.job_id]) for r in rows]

    def job_and_devices(self, job_id: str) -> tuple[Job, list[Device]]:
        """A job and this node's devices, in one read (what admitting a request checks)."""
        with self._tx(write=False) as s:
            job = self._job(s, self._job_row(s, job_id))
            return job, [convert.device_from_row(r) for r in self._device_rows(s)]

    def devices_and_jobs(self, statuses: Sequence[JobStatus]) -> tuple[list[Device], list[Job]]:
        """This node's devices and the jobs of `statuses` (up to 10,000), in one read (what a
        scheduler tick decides on)."""
        with self._tx(write=False) as s:
            devices = [convert.device_from_row(r) for r in self._device_rows(s)]
            q = select(JobRow).where(JobRow.status.in_([str(x) for x in statuses]))
            rows = s.scalars(q.order_by(JobRow.created_at.desc()).limit(10_000)).all()
            active = self._active_versions(s, [r.job_id for r in rows])
            return devices, [convert.job_from_row(r, active[r.job_id]) for r in rows]

    def set_job_status(self, job_id: str, new: JobStatus, reason: str) -> Job:
        with self._tx() as s:
            row = self._job_row(s, job_id, lock=True)
            switch_status(s, "job", job_id, row, new, reason)
            return self._job(s, row)

    def add_policy_version(
        self, job_id: str, source: str, path: str, note: str = ""
    ) -> PolicyVersion:
        """Record a new policy version (current + 1) and make it the job's current one."""
        with self._tx() as s:
            job = self._job_row(s, job_id, lock=True)  # the lock serializes version numbering
            if job.status != JobStatus.ACTIVE:
                raise FailedPrecondition(f"job {job_id!r} is {job.status}", field="job_id")
            now = utcnow()
            pv = PolicyVersionRow(
                job_id=job_id,
                version=job.policy_version + 1,
                source=source,
                path=path,
                note=note,
                created_at=now,
            )
            s.add(pv)
            job.policy_version, job.updated_at = pv.version, now
            s.flush()
            return convert.policy_version_from_row(pv)

    # ---- paused jobs (every node's admission gate) -------------------------------------

    def set_job_paused(self, job_id: str, mode: str | None) -> bool:
        """Pause the job for every node (`mode`: how, for the record) or resume it (None);
        returns whether it was paused before."""
        with self._tx() as s:
            self._job_row(s, job_id)  # NotFound names the job
            row = s.get(JobPauseRow, job_id)
            was = row is not None
            if mode is None:
                if row is not None:
                    s.delete(row)
            elif row is None:
                s.add(JobPauseRow(job_id=job_id, mode=mode, paused_at=utcnow()))
            else:
                row.mode = mode
            return was

    def is_job_paused(self, job_id: str) -> bool:
        with self._tx(write=False) as s:
            return s.get(JobPauseRow, job_id) is not None

    # ---- unfinished pushes of this node ------------------------------------------------

    def save_push(
        self, job_id: str, update_id: str, header: dict[str, Any], received: dict[str, int]
    ) -> None:
        """Record (or update) what this node's staging file of a push holds."""
        with self._tx() as s:
            row = s.get(PushRow, (self.node_id, job_id, update_id))
            if row is None:
                row = PushRow(node_id=self.node_id, job_id=job_id, update_id=update_id)
                s.add(row)
            row.header, row.received, row.updated_at = header, dict(received), utcnow()

    def list_pushes(self) -> list[tuple[str, str, dict[str, Any], dict[str, int]]]:
        """This node's unfinished pushes: (job id, update id, header, received)."""
        with self._tx(write=False) as s:
            rows = s.scalars(select(PushRow).where(PushRow.node_id == self.node_id)).all()
            return [(r.job_id, r.update_id, r.header, dict(r.received)) for r in rows]

    def delete_push(self, job_id: str, update_id: str) -> None:
        with self._tx() as s:
            s.execute(
                delete(PushRow).where(
                    PushRow.node_id == self.node_id,
                    PushRow.job_id == job_id,
                    PushRow.update_id == update_id,
                )
            )

    def get_policy_version(self, job_id: str, version: int | None = None) -> PolicyVersion:
        """A policy version of the job; None = the current one."""
        with self._tx(write=False) as s:
            job = self._job_row(s, job_id)
            v = job.policy_version if version is None else version
            # A larger number names no version (and may not fit the driver's integers).
            row = s.get(PolicyVersionRow, (job_id, v)) if v <= MAX_VERSION else None
            if row is None:
                raise NotFound(f"policy version {v} of job {job_id!r} not found", field="version")
            return convert.policy_version_from_row(row)

    def list_policy_versions(self, job_id: str) -> list[PolicyVersion]:
        with self._tx(write=False) as s:
            self._job_row(s, job_id)
            rows = s.scalars(
                select(PolicyVersionRow)
                .where(PolicyVersionRow.job_id == job_id)
                .order_by(PolicyVersionRow.version)
            ).all()
            return [convert.policy_version_from_row(r) for r in rows]

    # ---- rollout requests and samples ---------------------------------------------------

    def create_request(self, req: RolloutRequest) -> tuple[RolloutRequest, bool]:
        """Queue a rollout request; idempotent on request_id (see create_job). The job must
        exist (NotFound) and be active (FailedPrecondition)."""
        try:
            with self._tx() as s:
                existing = s.get(RolloutRequestRow, req.request_id)
                if existing is not None:
                    return self._same_request(existing, req), False
                # FOR SHARE until commit: a concurrent cancel of the job (FOR UPDATE) waits for
                # this request and then sees it, and a new policy version waits too, so the
                # version recorded is the job's current one at acceptance.
                job = self._job_row(s, req.job_id, share=True)
                if job.status != JobStatus.ACTIVE:
                    raise FailedPrecondition(f"job {req.job_id!r} is {job.status}", field="job_id")
                now = utcnow()
                row = convert.request_to_row(req)
                row.status, row.status_reason, row.samples_done = RequestStatus.QUEUED.value, "", 0
                row.policy_version = job.policy_version
                row.created_at = row.updated_at = now
                s.add(row)
                # One work unit per prompt: what nodes claim (tltd.store.leases).
                s.add_all(
                    WorkUnitRow(
                        request_id=req.request_id,
                        prompt_index=p,
                        samples=req.sampling.n,
                        prompt_key=prompt_key(req.prompts[p]),
                        priority=job.priority,
                        state="queued",
                        owner_epoch=0,
                        attempts=0,
                        reason="",
                        created_at=now,
                        updated_at=now,
                    )  # fmt: skip
                    for p in range(len(req.prompts))
                )
                record_event(
                    s, "request", req.request_id, "", RequestStatus.QUEUED, "submitted", at=now
                )
                notify(s, WORK, req.request_id)
                s.flush()
                return convert.request_from_row(row), True
        except IntegrityError:
            with self._tx(write=False) as s:
                existing = s.get(RolloutRequestRow, req.request_id)
                if existing is None:
                    raise
                return self._same_request(existing, req), False

    @staticmethod
    def _same_request(existing: RolloutRequestRow, req: RolloutRequest) -> RolloutRequest:
        current = convert.request_from_row(existing)
        diff = _diff(current, req, _REQUEST_PARAMS)
        if diff:
            raise AlreadyExists(
                f"rollout request {req.request_id!r} already exists with different "
                f"{', '.join(diff)}",
                field="request_id",
            )
        return current

    def get_request(self, request_id: str) -> RolloutRequest:
        with self._tx(write=False) as s:
            return convert.request_from_row(self._request_row(s, request_id))

    def list_requests(
        self,
        statuses: Sequence[RequestStatus] | None = None,
        job_id: str | None = None,
        limit: int | None = 1000,
    ) -> list[RolloutRequest]:
        """Requests, oldest first (queue order); limit None = all of them."""
        with self._tx(write=False) as s:
            q = select(RolloutRequestRow)
            if statuses:
                q = q.where(RolloutRequestRow.status.in_([str(x) for x in statuses]))
            if job_id is not None:
                q = q.where(RolloutRequestRow.job_id == job_id)
            q = q.order_by(RolloutRequestRow.created_at, RolloutRequestRow.request_id)
            return [convert.request_from_row(r) for r in s.scalars(q.limit(limit)).all()]

    def set_request_status(
        self, request_id: str, new: RequestStatus, reason: str
    ) -> RolloutRequest:
        with self._tx() as s:
            row = self._request_row(s, request_id, lock=True)
            if switch_status(s, "request", request_id, row, new, reason):
                notify(s, REQUEST, request_id)  # streams and the nodes running it look now
            return convert.request_from_row(row)

    def add_sample(self, sample: Sample) -> bool:
        """Store a finished (or partial) sample; idempotent on (request_id, prompt_index,
        sample_index).

        Returns True when stored: a new sample, or a complete one replacing a partial one
        (a drained request that was resumed). Returns False for a duplicate, and for a
        replacement once the request has ended: what its streams were given stays what is
        stored (a late sample from a worker already given up on changes nothing). samples_done
        counts complete (non-partial) samples only, so it reaches samples_total exactly
        when every sample is done.

        Non-finite logprobs are refused (InvalidArgument) on every database: JSON has no
        NaN/Infinity, PostgreSQL rejects them and SQLite would store them as-is.
        """
        bad = first_not_finite(sample.logprobs)
        if bad is not None:
            lp = sample.logprobs[bad]
            raise InvalidArgument(f"logprob {lp} is not finite", field=f"logprobs[{bad}]")
        try:
            with self._tx() as s:
                req = self._request_row(s, sample.request_id, lock=True)
                if not 0 <= sample.prompt_index < len(req.prompts):
                    raise InvalidArgument(
                        f"{sample.prompt_index} out of range for {len(req.prompts)} prompts",
                        field="prompt_index",
                    )
                if not 0 <= sample.sample_index < req.n:
                    raise InvalidArgument(
                        f"{sample.sample_index} out of range for n={req.n}", field="sample_index"
                    )
                if self.epoch:  # a joined node writes only into units it holds
                    self.check_held(s, sample.request_id, sample.prompt_index)
                existing = s.scalar(
                    select(SampleRow).where(
                        SampleRow.request_id == sample.request_id,
                        SampleRow.prompt_index == sample.prompt_index,
                        SampleRow.sample_index == sample.sample_index,
                    )
                )
                if existing is not None and not (existing.partial and not sample.partial):
                    return False
                # A sample not stored yet is still recorded on an ended request: a cancel
                # closes the request in the store before its remaining samples are stored.
                if existing is not None and RequestStatus(req.status) in ENDED_STATUSES:
                    return False
                now = utcnow()
                row = convert.sample_to_row(sample)
                row.created_at = now
                if existing is not None:
                    # A new, larger row id: a stream reads its request's samples past the
                    # last row id it saw, and must see the complete sample that replaced a
                    # partial one (the request row's lock keeps one request's ids in commit
                    # order; SQLite would give the id freed by the delete again).
                    if self.dialect == "sqlite":
                        row.id = int(s.scalar(select(func.max(SampleRow.id))) or 0) + 1
                    s.delete(existing)
                    s.flush()
                s.add(row)
                if not sample.partial:
                    req.samples_done += 1
                req.updated_at = now
                notify(s, SAMPLE, sample.request_id)
                return True
        except IntegrityError:
            # Only a concurrent insert of the same key gets here (PostgreSQL locks the
            # request row above, SQLite serializes writers): the other one stored it.
            return False

    def list_samples(self, request_id: str) -> list[Sample]:
        """Samples of a request ordered by (prompt_index, sample_index)."""
        with self._tx(write=False) as s:
            self._request_row(s, request_id)
            rows = s.scalars(
                select(SampleRow)
                .where(SampleRow.request_id == request_id)
                .order_by(SampleRow.prompt_index, SampleRow.sample_index)
            ).all()
            return [convert.sample_from_row(r) for r in rows]

    def prompt_history(
        self, job_id: str, prompt: Sequence[int], limit: int
    ) -> list[tuple[tuple[str, int, int], tuple[int, ...]]]:
        """The job's `limit` most recent whole samples of this prompt, from any request and
        node, oldest first: ((request id, prompt index, sample index), token ids) each. What
        the history drafter starts from when the prompt is admitted again."""
        with self._tx(write=False) as s:
            rows = s.execute(
                select(SampleRow.request_id, SampleRow.prompt_index, SampleRow.sample_index,
                       SampleRow.token_ids_bin, SampleRow.token_ids)
                .join(WorkUnitRow, (WorkUnitRow.request_id == SampleRow.request_id)
                      & (WorkUnitRow.prompt_index == SampleRow.prompt_index))
                .join(RolloutRequestRow, RolloutRequestRow.request_id == SampleRow.request_id)
                .where(RolloutRequestRow.job_id == job_id,
                       WorkUnitRow.prompt_key == prompt_key(prompt),
                       SampleRow.partial.is_(False))
                .order_by(SampleRow.id.desc())
                .limit(limit)
            ).all()  # fmt: skip
        return [
            ((r[0], r[1], r[2]), convert.token_ids_from_columns(r[3], r[4])) for r in reversed(rows)
        ]

    # ---- drafter versions ---------------------------------------------------------------

    def add_drafter_version(self, dv: DrafterVersion) -> DrafterVersion:
        """Record a drafter checkpoint; its version is max + 1 per job (dv.version is ignored)."""
        with self._tx() as s:
            self._job_row(s, dv.job_id, lock=True)  # serializes version numbering per job
            last = s.scalar(
                select(func.max(DrafterVersionRow.version)).where(
                    DrafterVersionRow.job_id == dv.job_id
                )
            )
            now = utcnow()
            row = convert.drafter_to_row(dv, (last or 0) + 1)
            row.created_at = row.updated_at = now
            s.add(row)
            record_event(
                s, "drafter", f"{dv.job_id}/{row.version}", "", dv.status, "created", at=now
            )
            s.flush()
            active = self._active_versions(s, [dv.job_id])[dv.job_id]
            return convert.drafter_from_row(row, active)

    def get_drafter(self, job_id: str, version: int) -> DrafterVersion:
        with self._tx(write=False) as s:
            row = self._drafter_row(s, job_id, version)
            return convert.drafter_from_row(row, self._active_versions(s, [job_id])[job_id])

    def list_drafters(self, job_id: str) -> list[DrafterVersion]:
        """Drafter versions of a job, oldest first, with `active` set on the active one."""
        with self._tx(write=False) as s:
            self._job_row(s, job_id)
            rows = s.scalars(
                select(DrafterVersionRow)
                .where(DrafterVersionRow.job_id == job_id)
                .order_by(DrafterVersionRow.version)
            ).all()
            active = self._active_versions(s, [job_id])[job_id]
            return [convert.drafter_from_row(r, active) for r in rows]

    def active_drafter_version(self, job_id: str) -> int:
        """The pinned version if any, else the newest PROMOTED one, else 0 (no learned drafter)."""
        with self._tx(write=False) as s:
            self._job_row(s, job_id)
            return self._active_versions(s, [job_id])[job_id]

    def set_drafter_status(
        self, job_id: str, version: int, new: DrafterStatus, reason: str
    ) -> DrafterVersion:
        """Move a drafter version through candidate -> promoted|rejected -> retired. A
        rejected or retired version loses its pin (the active version falls back)."""
        with self._tx() as s:
            row = self._drafter_row(s, job_id, version)
            entity_id = f"{job_id}/{version}"
            now = utcnow()
            changed = switch_status(s, "drafter", entity_id, row, new, reason)
            if changed and row.pinned and new in (DrafterStatus.REJECTED, DrafterStatus.RETIRED):
                row.pinned = False
                record_event(
                    s, "drafter", entity_id, "pinned", "unpinned", f"{new}: {reason}", at=now
                )
            s.flush()
            return convert.drafter_from_row(row, self._active_versions(s, [job_id])[job_id])

    def reject_candidate_drafters(self, reason: str) -> list[DrafterVersion]:
        """Reject every drafter version this node wrote that is still a candidate: at
        start-up one is a leftover of an evaluation a crash interrupted (recorded, never
        judged). Rejected, GC collects it. On PostgreSQL only this node's (and those with no
        node): another node's candidate may be under evaluation there now. Returns the
        versions rejected."""
        dv = DrafterVersionRow
        query = select(dv.job_id, dv.version).where(dv.status == DrafterStatus.CANDIDATE.value)
        if self.dialect == "postgresql":
            query = query.where(dv.node_id.in_((self.node_id, "")))
        with self._tx(write=False) as s:
            keys = s.execute(query).all()
        rejected = []
        for job_id, version in keys:
            try:
                rejected.append(
                    self.set_drafter_status(job_id, version, DrafterStatus.REJECTED, reason)
                )
            except FailedPrecondition:
                pass  # judged meanwhile
        return rejected

    def retire_drafters(
        self, job_id: str, versions: Sequence[int], reason: str
    ) -> list[DrafterVersion]:
        """Retire those of `versions` that are, at the moment of the write, evaluated
        (promoted or rejected), unpinned and not the active one; returns the retired ones
        (only their checkpoints may be deleted). The job row is locked as `pin_drafter` locks
        it, so a pin lands either before (its version is kept) or after (refused: a retired
        version cannot be pinned), never in between a read of the pins and the retire."""
        if not versions:
            return []
        with self._tx() as s:
            self._job_row(s, job_id, lock=True)
            active = self._active_versions(s, [job_id])[job_id]
            dv = DrafterVersionRow
            rows = s.scalars(
                select(dv)
                .where(
                    dv.job_id == job_id,
                    dv.version.in_(list(versions)),
                    dv.version != active,
                    ~dv.pinned,
                    dv.status.in_([DrafterStatus.PROMOTED.value, DrafterStatus.REJECTED.value]),
                )
                .order_by(dv.version)
                .with_for_update()
            ).all()
            for row in rows:
                entity_id = f"{job_id}/{row.version}"
                switch_status(s, "drafter", entity_id, row, DrafterStatus.RETIRED, reason)
            s.flush()
            return [convert.drafter_from_row(r, active) for r in rows]

    def pin_drafter(self, job_id: str, version: int) -> int:
        """Pin `version` (a promoted one) as the job's active drafter (0 unpins); returns the
        active version."""
        with self._tx() as s:
            self._job_row(s, job_id, lock=True)
            target = None
            if version:
                target = self._drafter_row(s, job_id, version)
                # A candidate is not judged yet (its rejection would then have to race
                # the pin); only promoted versions are pinned.
                if target.status != DrafterStatus.PROMOTED:
                    raise FailedPrecondition(
                        f"drafter version {version} of job {job_id!r} is {target.status} "
                        "and cannot be pinned",
                        field="version",
                    )
            now = utcnow()
            for row in s.scalars(
                select(DrafterVersionRow).where(
                    DrafterVersionRow.job_id == job_id, DrafterVersionRow.pinned
                )
            ).all():
                if row is not target:
                    row.pinned, row.updated_at = False, now
                    record_event(
                        s,
                        "drafter",
                        f"{job_id}/{row.version}",
                        "pinned",
                        "unpinned",
                        "operator pin",
                        at=now,
                    )
            if target is not None and not target.pinned:
                target.pinned, target.updated_at = True, now
                record_event(
                    s,
                    "drafter",
                    f"{job_id}/{version}",
                    "unpinned",
                    "pinned",
                    "operator pin",
                    at=now,
                )
            s.flush()
            return self._active_versions(s, [job_id])[job_id]

    # ---- devices ------------------------------------------------------------------------

    def upsert_devices(self, devices: Sequence[Device]) -> list[Device]:
        """Apply an inventory refresh.

        Observed fields (memory, utilization, processes, foreign, ...) are overwritten;
        operator flags (cordoned, draining) and the scheduler's state are kept. A device that
        was UNAVAILABLE and is seen again takes the observed state; a device missing from
        `devices` becomes UNAVAILABLE. Returns the whole inventory.
        """
        # Long on purpose: one transaction (insert, update, vanish) must see one snapshot.
        with self._tx() as s:
            now = utcnow()
            mine = select(DeviceRow).where(DeviceRow.node_id == self.node_id)
            rows = {r.device_id: r for r in s.scalars(mine).all()}
            seen = set()
            for d in devices:
                seen.add(d.device_id)
                row = rows.get(d.device_id)
                if row is None:
                    row = DeviceRow(
                        node_id=self.node_id,
                        device_id=d.device_id,
                        cordoned=d.cordoned,
                        draining=d.draining,
                        state=str(d.state),
                        state_reason=d.state_reason,
                    )
                    s.add(row)
                    record_event(s, "device", d.device_id, "", d.state, "discovered", at=now)
                else:
                    self._refresh_device(s, row, d, now)
                row.kind, row.device_index, row.uuid, row.name = (
                    str(d.kind),
                    d.index,
                    d.uuid,
                    d.name,
                )
                row.memory_total_bytes, row.memory_used_bytes = (
                    d.memory_total_bytes,
                    d.memory_used_bytes,
                )
                row.utilization = d.utilization
                row.processes = convert.processes_to_json(d.processes)
                if row.foreign != d.foreign and d.device_id in rows:
                    record_event(
                        s,
                        "device",
                        d.device_id,
                        "foreign" if row.foreign else "ours",
                        "foreign" if d.foreign else "ours",
                        d.state_reason,
                        at=now,
                    )
                row.foreign = d.foreign
                row.updated_at = now
            for device_id, row in rows.items():
                if device_id not in seen and row.state != DeviceState.UNAVAILABLE:
                    reason = "not found by the last inventory refresh"
                    record_event(
                        s, "device", device_id, row.state, DeviceState.UNAVAILABLE, reason, at=now
                    )
                    row.state, row.state_reason, row.updated_at = (
                        DeviceState.UNAVAILABLE.value,
                        reason,
                        now,
                    )
            s.flush()
            return [convert.device_from_row(r) for r in self._device_rows(s)]

    @staticmethod
    def _refresh_device(s: Session, row: DeviceRow, d: Device, now: datetime) -> None:
        """Decide state/state_reason of a known device from an observation (see upsert_devices)."""
        if row.state == DeviceState.UNAVAILABLE or d.state == DeviceState.UNAVAILABLE:
            if row.state != d.state:
                record_event(
                    s,
                    "device",
                    row.device_id,
                    row.state,
                    d.state,
                    d.state_reason or "seen by inventory refresh",
                    at=now,
                )
            row.state, row.state_reason = str(d.state), d.state_reason
        elif d.state_reason or row.foreign:
            # Discovery's reason (a foreign pid) replaces the old one; clear it once ours again.
            row.state_reason = d.state_reason

    def _device_rows(self, s: Session) -> Sequence[DeviceRow]:
        """This node's devices (another node's devices are its own business)."""
        return s.scalars(
            select(DeviceRow)
            .where(DeviceRow.node_id == self.node_id)
            .order_by(DeviceRow.kind, DeviceRow.device_index)
        ).all()

    def list_devices(self) -> list[Device]:
        """All devices ever seen, by kind then index."""
        with self._tx(write=False) as s:
            return [convert.device_from_row(r) for r in self._device_rows(s)]

    def get_device(self, device_id: str) -> Device:
        with self._tx(write=False) as s:
            return convert.device_from_row(self._device_row(s, device_id))

    def set_device_flags(
        self,
        device_id: str,
        *,
        cordoned: bool | None = None,
        draining: bool | None = None,
        reason: str = "",
    ) -> Device:
        """Set operator flags (None leaves a flag as is); records an event when they change."""
        with self._tx() as s:
            row = self._device_row(s, device_id)
            old = _flags(row)
            if cordoned is not None:
                row.cordoned = cordoned
            if draining is not None:
                row.draining = draining
            if _flags(row) != old:
                row.updated_at = utcnow()
                record_event(s, "device", device_id, old, _flags(row), reason, at=row.updated_at)
            return convert.device_from_row(row)

    def set_device_state(self, device_id: str, new: DeviceState, reason: str) -> Device:
        """Record what a device is doing (idle/rollout/training/unavailable), with an event.
        An UNAVAILABLE device stays so: only an inventory refresh that sees it again
        (`upsert_devices`) makes it usable, not a worker or trainer giving it back (whose
        write may land after the refresh that found it broken)."""
        with self._tx() as s:
            row = self._device_row(s, device_id)
            if row.state == DeviceState.UNAVAILABLE:
                return convert.device_from_row(row)
            if row.state != new:
                now = utcnow()
                record_event(s, "device", device_id, row.state, new, reason, at=now)
                row.state, row.state_reason, row.updated_at = str(new), reason, now
            return convert.device_from_row(row)

    # ---- workers ------------------------------------------------------------------------

    def upsert_worker(self, worker: Worker) -> Worker:
        """Register a worker or update its process facts (pid, device, job, heartbeat).

        A state change goes through the transition map; a stopped/failed worker may come back
        as STARTING (a restart of the same slot). Every state change records an event.
        """
        with self._tx() as s:
            return self._upsert_worker(s, worker)

    def record_worker(self, worker: Worker) -> Worker:
        """The supervisor's record of one of its workers, in one transaction: the same state
        again keeps its started_at; a STARTING over a process not stopped or failed records
        that one FAILED first ("replaced by a new process"); then as `upsert_worker`."""
        with self._tx() as s:
            row = s.get(WorkerRow, (self.node_id, worker.worker_id))
            if row is not None and row.state == worker.state:
                worker = replace(worker, started_at=row.started_at)
            elif (
                row is not None
                and worker.state is WorkerState.STARTING
                and row.state not in _FINAL_WORKER_STATES
            ):
                why = "replaced by a new process"
                switch_status(s, "worker", worker.worker_id, row, WorkerState.FAILED, why)
            return self._upsert_worker(s, worker)

    def _upsert_worker(self, s: Session, worker: Worker) -> Worker:
        now = utcnow()
        row = s.get(WorkerRow, (self.node_id, worker.worker_id))
        if row is None:
            row = WorkerRow(
                node_id=self.node_id, worker_id=worker.worker_id, state=str(worker.state)
            )
            s.add(row)
            record_event(
                s,
                "worker",
                worker.worker_id,
                "",
                worker.state,
                worker.state_reason or "registered",
                at=now,
            )
        elif row.state != worker.state:
            restart = row.state in _FINAL_WORKER_STATES and worker.state == WorkerState.STARTING
            if not restart:
                check_transition("worker", worker.worker_id, row.state, worker.state)
            record_event(
                s,
                "worker",
                worker.worker_id,
                row.state,
                worker.state,
                worker.state_reason or ("restarted" if restart else ""),
                at=now,
            )
            row.state = str(worker.state)
        row.kind, row.device_id, row.job_id = str(worker.kind), worker.device_id, worker.job_id
        row.pid, row.state_reason = worker.pid, worker.state_reason
        row.started_at = worker.started_at or row.started_at or now
        row.last_heartbeat = worker.last_heartbeat or row.last_heartbeat
        row.updated_at = now
        s.flush()
        return convert.worker_from_row(row)

    def get_worker(self, worker_id: str) -> Worker:
        with self._tx(write=False) as s:
            return convert.worker_from_row(self._worker_row(s, worker_id))

    def list_workers(self, device_id: str | None = None) -> list[Worker]:
        with self._tx(write=False) as s:
            q = (
                select(WorkerRow)
                .where(WorkerRow.node_id == self.node_id)
                .order_by(WorkerRow.worker_id)
            )
            if device_id is not None:
                q = q.where(WorkerRow.device_id == device_id)
            return [convert.worker_from_row(r) for r in s.scalars(q).all()]

    def set_worker_state(self, worker_id: str, new: WorkerState, reason: str) -> Worker:
        with self._tx() as s:
            row = self._worker_row(s, worker_id)
            switch_status(s, "worker", worker_id, row, new, reason)
            return convert.worker_from_row(row)

    def heartbeat_worker(self, worker_id: str) -> Worker:
        """Stamp last_heartbeat = now (the supervisor's liveness record)."""
        with self._tx() as s:
            now = utcnow()
            result = s.execute(
                update(WorkerRow)
                .where(WorkerRow.node_id == self.node_id, WorkerRow.worker_id == worker_id)
                .values(last_heartbeat=now, updated_at=now)
            )
            if result.rowcount == 0:  # type: ignore[attr-defined]
                raise NotFound(f"worker {worker_id!r} not found", field="worker_id")
            return convert.worker_from_row(self._worker_row(s, worker_id))

    # ---- events and stats ---------------------------------------------------------------

    def list_events(
        self, entity: str | None = None, entity_id: str | None = None, limit: int = 1000
    ) -> list[Event]:
        """The latest `limit` events matching the filters, in the order they happened."""
        with self._tx(write=False) as s:
            q = select(EventRow).order_by(EventRow.id.desc()).limit(limit)
            if entity is not None:
                q = q.where(EventRow.entity == entity)
            if entity_id is not None:
                q = q.where(EventRow.entity_id == entity_id)
            return [convert.event_from_row(r) for r in reversed(s.scalars(q).all())]

    def prune_history(
        self, before: datetime, batch: int = 500, budget_seconds: float = 10.0
    ) -> tuple[int, int]:
        """Delete the requests that ended before `before`, with their samples, and the events
        recorded before it: the history retention. A few hundred rows per transaction, so
        that the daemon's own writes never wait long behind it, and for `budget_seconds` at
        most (a large backlog is worked off over several runs; a shutdown waits for a run).
        Returns (requests, events) deleted. Open requests are never touched, whatever their
        age."""
        stop_at = time.monotonic() + budget_seconds
        ended = [
            RequestStatus.COMPLETED.value,
            RequestStatus.CANCELLED.value,
            RequestStatus.FAILED.value,
        ]
        rr, ev = RolloutRequestRow, EventRow
        requests = events = 0
        while True:
            with self._tx() as s:
                ids = s.scalars(
                    select(rr.request_id)
                    .where(rr.status.in_(ended), rr.updated_at < before)
                    .limit(batch)
                ).all()
                if not ids or time.monotonic() > stop_at:
                    break
                # Samples first: the cascade is the schema's, but not every SQLite connection
                # that may have written this file enforced foreign keys.
                s.execute(delete(SampleRow).where(SampleRow.request_id.in_(ids)))
                s.execute(delete(rr).where(rr.request_id.in_(ids)))
                requests += len(ids)
        while True:
            with self._tx() as s:
                old = s.scalars(select(ev.id).where(ev.at < before).limit(batch)).all()
                if not old or time.monotonic() > stop_at:
                    break
                s.execute(delete(ev).where(ev.id.in_(old)))
                events += len(old)
        return requests, events

    def stats(self) -> dict[str, Any]:
        """Counters for the Stats RPC and metrics.

        mean_accepted_length is the per-sample mean weighted by each sample's draft steps,
        i.e. accepted tokens per speculative step over all samples that used SD.
        """
        with self._tx(write=False) as s:
            by_status = {str(st): 0 for st in RequestStatus}
            for status, count in s.execute(
                select(RolloutRequestRow.status, func.count()).group_by(RolloutRequestRow.status)
            ).all():
                by_status[status] = int(count)
            n, tokens, weighted, steps = s.execute(
                select(
                    func.count(SampleRow.id),
                    func.coalesce(func.sum(SampleRow.num_tokens), 0),
                    func.coalesce(
                        func.sum(SampleRow.spec_mean_accepted_length * SampleRow.spec_draft_steps),
                        0.0,
                    ),
                    func.coalesce(func.sum(SampleRow.spec_draft_steps), 0),
                )
            ).one()
            jobs_active = s.scalar(
                select(func.count())
                .select_from(JobRow)
                .where(JobRow.status == JobStatus.ACTIVE.value)
            )
            return {
                "requests_by_status": by_status,
                "samples_total": int(n),
                "tokens_generated": int(tokens),
                "mean_accepted_length": float(weighted) / int(steps) if steps else 0.0,
                "jobs_active": int(jobs_active or 0),
            }
