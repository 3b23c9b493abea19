"""The record of what happened: events, the retention that prunes old history, counters."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select

from tltd.domain import Event, JobStatus, RequestStatus
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.tables import (
    EventRow,
    JobRow,
    RolloutRequestRow,
    SampleCheckpointRow,
    SampleRow,
)


class History:
    """Events, the retention that prunes old history, counters."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def list_events(
        self, entity: str | None = None, entity_id: str | None = None, limit: int = 1000
    ) -> list[Event]:
        """The latest `limit` events matching the filters, in the order they happened."""
        with self.db.tx(write=False) as s:
            q = select(EventRow).order_by(EventRow.id.desc()).limit(limit)
            if entity is not None:
                q = q.where(EventRow.entity == entity)
            if entity_id is not None:
                q = q.where(EventRow.entity_id == entity_id)
            return [convert.event_from_row(r) for r in reversed(s.scalars(q).all())]

    def prune(
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
            with self.db.tx() as s:
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
                cp = SampleCheckpointRow
                s.execute(delete(cp).where(cp.request_id.in_(ids)))
                s.execute(delete(rr).where(rr.request_id.in_(ids)))
                requests += len(ids)
        while True:
            with self.db.tx() as s:
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
        with self.db.tx(write=False) as s:
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
