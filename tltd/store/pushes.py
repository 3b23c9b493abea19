"""This node's unfinished policy pushes: what each staging file holds, so that a restarted
daemon can resume or discard it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from tltd.store.tables import PushRow, utcnow


class PushRecords:
    """Mixed into the Store (uses its `node_id` and `_tx`)."""

    node_id: str
    _tx: Callable[..., AbstractContextManager[Session]]

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
