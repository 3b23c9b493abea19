"""A job's drafter versions: recorded, judged (promoted, rejected), retired, pinned."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select

from tltd.domain import DrafterStatus, DrafterVersion
from tltd.errors import FailedPrecondition
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.lookups import active_versions, drafter_row, job_row
from tltd.store.status import record_event, switch_status
from tltd.store.tables import DrafterVersionRow, utcnow


class DrafterVersions:
    """Drafter versions and their statuses."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, dv: DrafterVersion) -> DrafterVersion:
        """Record a drafter checkpoint; its version is max + 1 per job (dv.version is ignored)."""
        with self.db.tx() as s:
            job_row(s, dv.job_id, lock=True)  # serializes version numbering per job
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
            active = active_versions(s, [dv.job_id])[dv.job_id]
            return convert.drafter_from_row(row, active)

    def get(self, job_id: str, version: int) -> DrafterVersion:
        with self.db.tx(write=False) as s:
            row = drafter_row(s, job_id, version)
            return convert.drafter_from_row(row, active_versions(s, [job_id])[job_id])

    def list(self, job_id: str) -> list[DrafterVersion]:
        """Drafter versions of a job, oldest first, with `active` set on the active one."""
        with self.db.tx(write=False) as s:
            job_row(s, job_id)
            rows = s.scalars(
                select(DrafterVersionRow)
                .where(DrafterVersionRow.job_id == job_id)
                .order_by(DrafterVersionRow.version)
            ).all()
            active = active_versions(s, [job_id])[job_id]
            return [convert.drafter_from_row(r, active) for r in rows]

    def active_version(self, job_id: str) -> int:
        """The pinned version if any, else the newest PROMOTED one, else 0 (no learned drafter)."""
        with self.db.tx(write=False) as s:
            job_row(s, job_id)
            return active_versions(s, [job_id])[job_id]

    def set_status(
        self, job_id: str, version: int, new: DrafterStatus, reason: str
    ) -> DrafterVersion:
        """Move a drafter version through candidate -> promoted|rejected -> retired. A
        rejected or retired version loses its pin (the active version falls back)."""
        with self.db.tx() as s:
            row = drafter_row(s, job_id, version)
            entity_id = f"{job_id}/{version}"
            now = utcnow()
            changed = switch_status(s, "drafter", entity_id, row, new, reason)
            if changed and row.pinned and new in (DrafterStatus.REJECTED, DrafterStatus.RETIRED):
                row.pinned = False
                record_event(
                    s, "drafter", entity_id, "pinned", "unpinned", f"{new}: {reason}", at=now
                )
            s.flush()
            return convert.drafter_from_row(row, active_versions(s, [job_id])[job_id])

    def reject_candidates(self, reason: str) -> list[DrafterVersion]:
        """Reject every drafter version this node wrote that is still a candidate: at
        start-up one is a leftover of an evaluation a crash interrupted (recorded, never
        judged). Rejected, GC collects it. On PostgreSQL only this node's (and those with no
        node): another node's candidate may be under evaluation there now. Returns the
        versions rejected."""
        dv = DrafterVersionRow
        query = select(dv.job_id, dv.version).where(dv.status == DrafterStatus.CANDIDATE.value)
        if self.db.dialect == "postgresql":
            query = query.where(dv.node_id.in_((self.db.node_id, "")))
        with self.db.tx(write=False) as s:
            keys = s.execute(query).all()
        rejected = []
        for job_id, version in keys:
            try:
                rejected.append(self.set_status(job_id, version, DrafterStatus.REJECTED, reason))
            except FailedPrecondition:
                pass  # judged meanwhile
        return rejected

    def retire(self, job_id: str, versions: Sequence[int], reason: str) -> list[DrafterVersion]:
        """Retire those of `versions` that are, at the moment of the write, evaluated
        (promoted or rejected), unpinned and not the active one; returns the retired ones
        (only their checkpoints may be deleted). The job row is locked as `pin` locks
        it, so a pin lands either before (its version is kept) or after (refused: a retired
        version cannot be pinned), never in between a read of the pins and the retire."""
        if not versions:
            return []
        with self.db.tx() as s:
            job_row(s, job_id, lock=True)
            active = active_versions(s, [job_id])[job_id]
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

    def pin(self, job_id: str, version: int) -> int:
        """Pin `version` (a promoted one) as the job's active drafter (0 unpins); returns the
        active version."""
        with self.db.tx() as s:
            job_row(s, job_id, lock=True)
            target = None
            if version:
                target = drafter_row(s, job_id, version)
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
            return active_versions(s, [job_id])[job_id]
