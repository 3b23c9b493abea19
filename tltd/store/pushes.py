"""This node's unfinished policy pushes: what each staging file holds, so that a restarted
daemon can resume or discard it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select

from tltd.store.database import Database
from tltd.store.tables import PushRow, utcnow


class PushRecords:
    """This node's unfinished policy pushes."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def save(
        self, job_id: str, update_id: str, header: dict[str, Any], received: dict[str, int]
    ) -> None:
        """Record (or update) what this node's staging file of a push holds."""
        with self.db.tx() as s:
            row = s.get(PushRow, (self.db.node_id, job_id, update_id))
            if row is None:
                row = PushRow(node_id=self.db.node_id, job_id=job_id, update_id=update_id)
                s.add(row)
            row.header, row.received, row.updated_at = header, dict(received), utcnow()

    def list(self) -> list[tuple[str, str, dict[str, Any], dict[str, int]]]:
        """This node's unfinished pushes: (job id, update id, header, received)."""
        with self.db.tx(write=False) as s:
            rows = s.scalars(select(PushRow).where(PushRow.node_id == self.db.node_id)).all()
            return [(r.job_id, r.update_id, r.header, dict(r.received)) for r in rows]

    def delete(self, job_id: str, update_id: str) -> None:
        with self.db.tx() as s:
            s.execute(
                delete(PushRow).where(
                    PushRow.node_id == self.db.node_id,
                    PushRow.job_id == job_id,
                    PushRow.update_id == update_id,
                )
            )
