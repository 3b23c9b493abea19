"""Jobs, and the pause every node's admission reads (their policy versions: `policies`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tltd.domain import Device, DrafterStatus, DrafterVersion, Job, JobStatus
from tltd.errors import AlreadyExists
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.lookups import (
    active_versions,
    changed_fields,
    device_rows,
    job_row,
    read_job,
)
from tltd.store.status import record_event, switch_status
from tltd.store.tables import JobPauseRow, JobRow, PolicyVersionRow, utcnow

_JOB_PARAMS = (
    "model_path",
    "name",
    "backend",
    "priority",
    "weight",
    "speculative",
    "policy_switch",
    "max_staleness",
)


class JobRecords:
    """Jobs and the pause every node's admission reads."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, job: Job, initial_drafter: DrafterVersion | None = None) -> tuple[Job, bool]:
        """Create a job (with policy version 0 = its model_path); a retry with the same
        parameters returns the existing job and False, different parameters raise AlreadyExists.

        `initial_drafter` (a checkpoint already in the daemon's storage) is recorded in the same
        transaction as drafter version 1 against policy version 0, PROMOTED, so the job is
        never seen without it; a retry ignores it (the caller removes its copy).
        """
        try:
            with self.db.tx() as s:
                existing = s.get(JobRow, job.job_id)
                if existing is not None:
                    return self._same_job(s, existing, job), False
                now = utcnow()
                row = _add_job(s, job, now)
                s.flush()  # the job row before its drafter row (foreign key)
                if initial_drafter is None:
                    return convert.job_from_row(row, 0), True
                _add_initial_drafter(s, job, initial_drafter, now)
                s.flush()
                return convert.job_from_row(row, 1), True
        except IntegrityError:
            # A concurrent create of the same id committed first: answer as a retry would.
            with self.db.tx(write=False) as s:
                existing = s.get(JobRow, job.job_id)
                if existing is None:
                    raise
                return self._same_job(s, existing, job), False

    def _same_job(self, s: Session, existing: JobRow, job: Job) -> Job:
        current = read_job(s, existing)
        diff = changed_fields(current, job, _JOB_PARAMS)
        if diff:
            raise AlreadyExists(
                f"job {job.job_id!r} already exists with different {', '.join(diff)}",
                field="job_id",
            )
        return current

    def get(self, job_id: str) -> Job:
        with self.db.tx(write=False) as s:
            return read_job(s, job_row(s, job_id))

    def list(self, statuses: Sequence[JobStatus] | None = None, limit: int = 100) -> list[Job]:
        """Jobs, newest first."""
        with self.db.tx(write=False) as s:
            q = select(JobRow).order_by(JobRow.created_at.desc(), JobRow.job_id.desc())
            if statuses:
                q = q.where(JobRow.status.in_([str(x) for x in statuses]))
            rows = s.scalars(q.limit(limit)).all()
            active = active_versions(s, [r.job_id for r in rows])
            return [convert.job_from_row(r, active[r.job_id]) for r in rows]

    def job_and_devices(self, job_id: str) -> tuple[Job, list[Device]]:
        """A job and this node's devices, in one read (what admitting a request checks)."""
        with self.db.tx(write=False) as s:
            job = read_job(s, job_row(s, job_id))
            return job, [convert.device_from_row(r) for r in device_rows(s, self.db.node_id)]

    def devices_and_jobs(self, statuses: Sequence[JobStatus]) -> tuple[list[Device], list[Job]]:
        """This node's devices and the jobs of `statuses` (up to 10,000), in one read (what a
        scheduler tick decides on)."""
        with self.db.tx(write=False) as s:
            devices = [convert.device_from_row(r) for r in device_rows(s, self.db.node_id)]
            q = select(JobRow).where(JobRow.status.in_([str(x) for x in statuses]))
            rows = s.scalars(q.order_by(JobRow.created_at.desc()).limit(10_000)).all()
            active = active_versions(s, [r.job_id for r in rows])
            return devices, [convert.job_from_row(r, active[r.job_id]) for r in rows]

    def set_status(self, job_id: str, new: JobStatus, reason: str) -> Job:
        with self.db.tx() as s:
            row = job_row(s, job_id, lock=True)
            switch_status(s, "job", job_id, row, new, reason)
            return read_job(s, row)

    # ---- paused jobs (every node's admission gate) -------------------------------------

    def set_paused(self, job_id: str, mode: str | None) -> bool:
        """Pause the job for every node (`mode`: how, for the record) or resume it (None);
        returns whether it was paused before."""
        with self.db.tx() as s:
            job_row(s, job_id)  # NotFound names the job
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

    def is_paused(self, job_id: str) -> bool:
        with self.db.tx(write=False) as s:
            return s.get(JobPauseRow, job_id) is not None

    def paused(self, mode: str) -> frozenset[str]:
        """The jobs paused in `mode` (on every node)."""
        with self.db.tx(write=False) as s:
            q = select(JobPauseRow.job_id).where(JobPauseRow.mode == mode)
            return frozenset(s.scalars(q).all())


def _add_job(s: Session, job: Job, now: datetime) -> JobRow:
    """A new job's row, ACTIVE, with policy version 0 (its model_path) and its event."""
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
    return row


def _add_initial_drafter(s: Session, job: Job, initial: DrafterVersion, now: datetime) -> None:
    """The job's drafter version 1 (against policy version 0, PROMOTED), with its event."""
    dv = DrafterVersion(
        job_id=job.job_id,
        version=1,
        policy_version=0,
        path=initial.path,
        train_steps=initial.train_steps,
        loss=initial.loss,
        acceptance_length=initial.acceptance_length,
        status=DrafterStatus.PROMOTED,
        node_id=initial.node_id,
        shared=initial.shared,
    )
    drafter = convert.drafter_to_row(dv, 1)
    drafter.created_at = drafter.updated_at = now
    s.add(drafter)
    why = f"initial drafter from {job.speculative.initial_drafter_path}"
    record_event(s, "drafter", f"{job.job_id}/1", "", DrafterStatus.PROMOTED, why, at=now)
