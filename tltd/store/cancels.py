"""A cancelled job's open requests cancelled together: one transaction, a fixed set of statements.

What `RolloutRequests.set_status` (CANCELLED) and `WorkLeases.end_queued_units` do for one
request, for all of a job's open requests at once: each request moves from the status read
under its row lock (an event per request), the units no node holds end with their missing
samples stored partial, and each request's notification wakes its streams and the nodes
running it. Units a node holds are ended by that node (it stops the work at its next lease
renewal), as for a single cancel.
"""

from __future__ import annotations

from sqlalchemy import and_, bindparam, or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session

from tltd.domain import OPEN_STATUSES, FinishReason, RequestStatus, Sample
from tltd.store import convert
from tltd.store.clock import db_now
from tltd.store.database import Database
from tltd.store.leases import DONE, LEASED, PARKED, QUEUED
from tltd.store.notifications import REQUEST, notify_many
from tltd.store.status import switch_statuses_from
from tltd.store.tables import RolloutRequestRow, SampleRow, WorkUnitRow, utcnow


class RequestCancels:
    """Cancel every open request of a job at once."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def cancel_job_requests(self, job_id: str, why: str) -> list[str]:
        """CANCELLED with reason `why`, every request of job `job_id` still QUEUED or RUNNING,
        in one transaction; returns their ids. A request that ended meanwhile keeps its end."""
        rr, wu = RolloutRequestRow, WorkUnitRow
        with self.db.tx() as s:
            conn = s.connection()
            rows = conn.execute(
                select(rr.request_id, rr.status, rr.n, rr.policy_version)
                .where(rr.job_id == job_id, rr.status.in_([x.value for x in OPEN_STATUSES]))
                .order_by(rr.request_id)  # the lock order of every other writer
                .with_for_update()
            ).all()
            if not rows:
                return []
            ids = [r.request_id for r in rows]
            moves = [(r.request_id, RequestStatus(r.status)) for r in rows]
            switch_statuses_from(s, "request", rr, moves, RequestStatus.CANCELLED, why)
            now = db_now(self.db.dialect)
            free = or_(
                wu.state.in_((QUEUED, PARKED)), and_(wu.state == LEASED, wu.lease_expires_at < now)
            )
            units = conn.execute(
                select(wu.request_id, wu.prompt_index)
                .where(wu.request_id.in_(ids), free)
                .with_for_update(skip_locked=True)
            ).all()
            if units:
                self._end_units(s, list(rows), list(units), why)
            notify_many(s, REQUEST, ids)  # streams and the nodes running them look now
            return ids

    @staticmethod
    def _end_units(s: Session, requests: list[Row], units: list[Row], why: str) -> None:
        """The `units` (request id, prompt index) done, their missing samples stored partial."""
        wu, sr = WorkUnitRow, SampleRow
        conn = s.connection()
        head = {r.request_id: (int(r.n), int(r.policy_version)) for r in requests}
        rids = sorted({u[0] for u in units})
        have = set(
            conn.execute(
                select(sr.request_id, sr.prompt_index, sr.sample_index).where(
                    sr.request_id.in_(rids)
                )
            ).all()
        )
        stamp = utcnow()
        rows = []
        for rid, p in units:
            n, version = head[rid]
            for i in range(n):
                if (rid, p, i) not in have:
                    sample = Sample(
                        rid, p, i, (), (), FinishReason.CANCELLED,
                        policy_version=version, partial=True, error=why,
                    )  # fmt: skip
                    rows.append(convert.sample_columns(sample) | {"created_at": stamp})
        if rows:
            conn.execute(sr.__table__.insert(), rows)
        conn.execute(
            update(wu.__table__)
            .where(
                wu.__table__.c.request_id == bindparam("rid"),
                wu.__table__.c.prompt_index == bindparam("p"),
            )
            .values(state=DONE, owner_node=None, lease_expires_at=None, updated_at=stamp),
            [{"rid": rid, "p": p} for rid, p in units],
        )
