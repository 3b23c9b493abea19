"""Row look-ups the store's repositories share: a job, request or drafter version by key (NotFound
when there is none), a job's active drafter version, this node's devices."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from tltd.domain import DrafterStatus, Job
from tltd.errors import NotFound
from tltd.store import convert
from tltd.store.tables import DeviceRow, DrafterVersionRow, JobRow, RolloutRequestRow

# Version columns are SQL INTEGER (signed 32-bit): no version is numbered above this.
MAX_VERSION = 2**31 - 1


def job_row(s: Session, job_id: str, *, lock: bool = False, share: bool = False) -> JobRow:
    """lock: FOR UPDATE; share: FOR SHARE (PostgreSQL; SQLite serializes writers anyway)."""
    row = s.get(JobRow, job_id, with_for_update={"read": True} if share else lock)
    if row is None:
        raise NotFound(f"job {job_id!r} not found", field="job_id")
    return row


def request_row(s: Session, request_id: str, *, lock: bool = False) -> RolloutRequestRow:
    row = s.get(RolloutRequestRow, request_id, with_for_update=lock)
    if row is None:
        raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
    return row


def drafter_row(s: Session, job_id: str, version: int) -> DrafterVersionRow:
    job_row(s, job_id)
    row = None
    if version <= MAX_VERSION:  # a larger number names no version (and no SQL integer)
        row = s.scalar(
            select(DrafterVersionRow).where(
                DrafterVersionRow.job_id == job_id, DrafterVersionRow.version == version
            )
        )
    if row is None:
        raise NotFound(f"drafter version {version} of job {job_id!r} not found", field="version")
    return row


def active_versions(s: Session, job_ids: Sequence[str]) -> dict[str, int]:
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


def read_job(s: Session, row: JobRow) -> Job:
    """The job of `row`, with its active drafter version."""
    return convert.job_from_row(row, active_versions(s, [row.job_id])[row.job_id])


def device_rows(s: Session, node_id: str) -> Sequence[DeviceRow]:
    """The devices of `node_id`, by kind then index (another node's devices are its own
    business)."""
    return s.scalars(
        select(DeviceRow)
        .where(DeviceRow.node_id == node_id)
        .order_by(DeviceRow.kind, DeviceRow.device_index)
    ).all()


def changed_fields(a: object, b: object, fields: Sequence[str]) -> list[str]:
    """Those of `fields` that differ between `a` and `b` (what an idempotent retry compares)."""
    return [f for f in fields if getattr(a, f) != getattr(b, f)]
