"""Drafter training under a lease: one node trains a job's drafter at a time.

A node claims the lease of a job (one row per job, locked while it is decided), renews it
while its trainer lives, and releases it when the trainer stops. Expiry is read from the
database's clock (`tltd.store.clock`). `lease_epoch` grows with every acquisition: a publish
carries it and lands only while the lease is held by that node, under that epoch, unexpired
(a node whose lease lapsed publishes nothing, even when nobody took the lease since).

Training data is every finished sample of the job, whichever node produced it, read from the
samples table after a cursor (the last sample id consumed) kept in the lease row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import and_, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tltd.domain import DrafterLease, DrafterStatus, DrafterVersion, FinishReason
from tltd.errors import Fenced
from tltd.store import convert
from tltd.store.clock import db_now, read_db_now
from tltd.store.database import Database
from tltd.store.lookups import active_versions
from tltd.store.status import record_event
from tltd.store.tables import (
    DrafterLeaseRow,
    DrafterVersionRow,
    JobRow,
    RolloutRequestRow,
    SampleRow,
    utcnow,
)

_FINISHED = (FinishReason.STOP.value, FinishReason.LENGTH.value)
_NEVER = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class FinishedSample:
    """A finished sample as training reads it: its row id (the cursor), prompt and tokens."""

    sample_id: int
    prompt: tuple[int, ...]
    token_ids: tuple[int, ...]
    policy_version: int


class DrafterLeases:
    """Drafter training's lease per job, and the samples it trains on."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def _held_lease(self, lease_epoch: int) -> object:
        dl = DrafterLeaseRow
        return and_(
            dl.owner_node == self.db.node_id,
            dl.lease_epoch == lease_epoch,
            dl.expires_at > db_now(self.db.dialect),
        )

    def claim(self, job_id: str, lease_seconds: float) -> DrafterLease | None:
        """Take (or extend) the lease on training `job_id`'s drafter; None while another node
        holds it unexpired. A lease held by this node under an older node epoch (a previous
        process) is taken again, with a new lease epoch."""
        if not self.db.epoch:
            return None
        dl = DrafterLeaseRow
        insert = (postgresql if self.db.dialect == "postgresql" else sqlite).insert
        with self.db.tx() as s:
            s.execute(
                insert(dl)
                .values(
                    job_id=job_id,
                    owner_node="",
                    owner_epoch=0,
                    lease_epoch=0,
                    expires_at=_NEVER,
                    cursor=0,
                    published_version=0,
                    updated_at=utcnow(),
                )  # fmt: skip
                .on_conflict_do_nothing(index_elements=[dl.job_id])
            )
            row = s.get(dl, job_id, with_for_update=True, populate_existing=True)
            assert row is not None
            now = read_db_now(s)
            alive = row.expires_at > now
            mine = row.owner_node == self.db.node_id and row.owner_epoch == self.db.epoch
            if alive and not mine and row.owner_node != self.db.node_id:
                return None
            values: dict = {"expires_at": db_now(self.db.dialect, lease_seconds)}
            taken_from = ""
            if not (alive and mine):
                values |= {
                    "owner_node": self.db.node_id,
                    "owner_epoch": self.db.epoch,
                    "lease_epoch": row.lease_epoch + 1,
                }
                if row.owner_node not in ("", self.db.node_id):
                    taken_from = row.owner_node
                why = f"node {self.db.node_id} epoch {self.db.epoch}"
                if taken_from:
                    why += f", taken over from node {taken_from}"
                record_event(
                    s, "drafter_lease", job_id, row.owner_node, self.db.node_id, f"claimed: {why}"
                )
            values["updated_at"] = utcnow()
            out = s.execute(
                update(dl)
                .where(dl.job_id == job_id)
                .values(**values)
                .returning(dl.lease_epoch, dl.cursor, dl.published_version)
            ).one()
        return DrafterLease(job_id, int(out[0]), int(out[1]), int(out[2]), taken_from)

    def renew(self, job_id: str, lease_epoch: int, lease_seconds: float) -> bool:
        """Extend a lease this node still holds; False when it lapsed or was taken."""
        dl = DrafterLeaseRow
        with self.db.tx() as s:
            result = s.execute(
                update(dl)
                .where(dl.job_id == job_id, self._held_lease(lease_epoch))
                .values(expires_at=db_now(self.db.dialect, lease_seconds), updated_at=utcnow())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def release(self, job_id: str, lease_epoch: int) -> bool:
        """Let the lease expire now (its trainer stopped): another node may claim it at once.
        The owner is kept: whoever claims next knows training moved."""
        dl = DrafterLeaseRow
        with self.db.tx() as s:
            result = s.execute(
                update(dl)
                .where(dl.job_id == job_id, self._held_lease(lease_epoch))
                .values(expires_at=db_now(self.db.dialect), updated_at=utcnow())
            )
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def _check_lease(self, s: Session, job_id: str, lease_epoch: int) -> None:
        dl = DrafterLeaseRow
        held = s.scalar(
            select(dl.job_id)
            .where(dl.job_id == job_id, self._held_lease(lease_epoch))
            .with_for_update()
        )
        if held is None:
            raise Fenced(
                f"the drafter lease of job {job_id!r} is not held by node {self.db.node_id!r} "
                f"lease epoch {lease_epoch}: it lapsed or another node took it"
            )

    def publish(
        self,
        dv: DrafterVersion,
        lease_epoch: int,
        status: DrafterStatus,
        reason: str,
        cursor: int = 0,
    ) -> DrafterVersion:
        """Record a measured drafter as the job's next version with its decided status
        (PROMOTED or REJECTED), written by this node, and move the lease's cursor to
        `cursor` (the last sample id the drafter was trained on), in one transaction that
        holds the lease row: Fenced (nothing recorded) unless this node holds the lease under
        `lease_epoch`. Samples a lost holder read but never published are read again by the
        next one."""
        with self.db.tx() as s:
            self._check_lease(s, dv.job_id, lease_epoch)  # locks the lease row
            job = s.get(JobRow, dv.job_id, with_for_update=True)  # serializes numbering
            if job is None:
                raise Fenced(f"job {dv.job_id!r} is gone")
            last = s.scalar(
                select(func.max(DrafterVersionRow.version)).where(
                    DrafterVersionRow.job_id == dv.job_id
                )
            )
            now = utcnow()
            row = convert.drafter_to_row(dv, (last or 0) + 1)
            row.status = str(status)
            row.status_reason = reason
            row.node_id = self.db.node_id
            row.created_at = row.updated_at = now
            s.add(row)
            entity = f"{dv.job_id}/{row.version}"
            record_event(s, "drafter", entity, "", DrafterStatus.CANDIDATE, "created", at=now)
            record_event(s, "drafter", entity, DrafterStatus.CANDIDATE, status, reason, at=now)
            s.execute(
                update(DrafterLeaseRow)
                .where(DrafterLeaseRow.job_id == dv.job_id)
                .values(
                    published_version=row.version,
                    cursor=case(
                        (DrafterLeaseRow.cursor < cursor, cursor), else_=DrafterLeaseRow.cursor
                    ),
                    updated_at=now,
                )
            )
            s.flush()
            active = active_versions(s, [dv.job_id])[dv.job_id]
            return convert.drafter_from_row(row, active)

    def owner(self, job_id: str) -> tuple[str, int, bool] | None:
        """(owner node, lease epoch, alive by the database's clock) of a job's lease."""
        dl = DrafterLeaseRow
        with self.db.tx(write=False) as s:
            row = s.get(dl, job_id)
            if row is None:
                return None
            return row.owner_node, row.lease_epoch, row.expires_at > read_db_now(s)

    def finished_samples(
        self,
        job_id: str,
        after_id: int = 0,
        limit: int = 1024,
        *,
        up_to: int | None = None,
        newest: bool = False,
    ) -> list[FinishedSample]:
        """Finished (stop/length, not partial) samples of the job with a row id above
        `after_id` (and at most `up_to`), by id: the first `limit`, or with `newest` the last
        `limit`; whichever node stored them."""
        sr, rr = SampleRow, RolloutRequestRow
        query = (
            select(
                sr.id,
                sr.request_id,
                sr.prompt_index,
                sr.token_ids_bin,
                sr.token_ids,
                sr.policy_version,
            )  # fmt: skip
            .join(rr, rr.request_id == sr.request_id)
            .where(
                rr.job_id == job_id,
                sr.id > after_id,
                sr.finish_reason.in_(_FINISHED),
                sr.partial.is_(False),
            )
            .order_by(sr.id.desc() if newest else sr.id)
            .limit(limit)
        )
        if up_to is not None:
            query = query.where(sr.id <= up_to)
        with self.db.tx(write=False) as s:
            rows = s.execute(query).all()
            ids = sorted({r[1] for r in rows})
            prompts = dict(
                s.execute(select(rr.request_id, rr.prompts).where(rr.request_id.in_(ids))).all()
            )
        out = [
            FinishedSample(
                int(r[0]),
                tuple(prompts[r[1]][r[2]]),
                convert.token_ids_from_columns(r[3], r[4]),
                int(r[5]),
            )
            for r in rows
        ]
        return sorted(out, key=lambda f: f.sample_id)

    def backlog(
        self, job_ids: Sequence[str], read_to: Mapping[str, int] | None = None
    ) -> dict[str, int]:
        """Finished samples per job that its drafter has not been trained on: above the
        cursor of its lease, or above `read_to[job]` (what this node's trainer has read
        already) when that is higher; whichever node produced them."""
        if not job_ids:
            return {}
        sr, rr, dl = SampleRow, RolloutRequestRow, DrafterLeaseRow
        read_to = read_to or {}
        out: dict[str, int] = {}
        with self.db.tx(write=False) as s:
            cursors = dict(
                s.execute(select(dl.job_id, dl.cursor).where(dl.job_id.in_(list(job_ids)))).all()
            )
            for job_id in job_ids:
                after = max(int(cursors.get(job_id, 0)), read_to.get(job_id, 0))
                n = s.scalar(
                    select(func.count(sr.id))
                    .join(rr, rr.request_id == sr.request_id)
                    .where(
                        rr.job_id == job_id,
                        sr.id > after,
                        sr.finish_reason.in_(_FINISHED),
                        sr.partial.is_(False),
                    )
                )
                if n:
                    out[job_id] = int(n)
        return out
