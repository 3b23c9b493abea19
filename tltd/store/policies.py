"""A job's policy versions: version 0 is its model_path; each update adds current + 1."""

from __future__ import annotations

from sqlalchemy import select

from tltd.domain import JobStatus, PolicyVersion
from tltd.errors import FailedPrecondition, NotFound
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.lookups import MAX_VERSION, job_row
from tltd.store.tables import PolicyVersionRow, utcnow


class PolicyVersions:
    """A job's policy versions (version 0 is its model_path)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, job_id: str, source: str, path: str, note: str = "") -> PolicyVersion:
        """Record a new policy version (current + 1) and make it the job's current one."""
        with self.db.tx() as s:
            job = job_row(s, job_id, lock=True)  # the lock serializes version numbering
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

    def get(self, job_id: str, version: int | None = None) -> PolicyVersion:
        """A policy version of the job; None = the current one."""
        with self.db.tx(write=False) as s:
            job = job_row(s, job_id)
            v = job.policy_version if version is None else version
            # A larger number names no version (and may not fit the driver's integers).
            row = s.get(PolicyVersionRow, (job_id, v)) if v <= MAX_VERSION else None
            if row is None:
                raise NotFound(f"policy version {v} of job {job_id!r} not found", field="version")
            return convert.policy_version_from_row(row)

    def list(self, job_id: str) -> list[PolicyVersion]:
        with self.db.tx(write=False) as s:
            job_row(s, job_id)
            rows = s.scalars(
                select(PolicyVersionRow)
                .where(PolicyVersionRow.job_id == job_id)
                .order_by(PolicyVersionRow.version)
            ).all()
            return [convert.policy_version_from_row(r) for r in rows]
