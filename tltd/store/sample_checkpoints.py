"""Checkpoints of running samples: their tokens so far, stored while they run.

A worker sends the samples that have run a while (`Settings.sample_checkpoint_seconds`); a
node that takes a unit over after a loss (kill -9, a lost node) goes on from the newest
checkpoint instead of running the sample again from its seed. A checkpoint is not a result:
streams never read this table, and a complete sample in `samples` makes it moot. Each sample
keeps its longest checkpoint, and only a node that holds the unit writes one (a lost node's
late write would mix another run's tokens in). Rows go with their request.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tltd.domain import Sample
from tltd.store import convert
from tltd.store.database import BINARY_RESULTS, Database
from tltd.store.leases import WorkLeases
from tltd.store.tables import SampleCheckpointRow, WorkUnitRow, utcnow


class SampleCheckpoints:
    """Running samples' tokens so far, per sample the longest."""

    def __init__(self, db: Database, leases: WorkLeases) -> None:
        self.db = db
        self.leases = leases

    def save(self, samples: Sequence[Sample]) -> int:
        """Store these unfinished samples as their units' checkpoints, in one transaction:
        a sample's row is replaced only by one with more tokens, and a joined node writes
        only into units it holds. Returns how many were written."""
        if not samples:
            return 0
        now = utcnow()
        with self.db.tx() as s:
            held = self._held(s, samples)
            rows = [
                convert.checkpoint_columns(x) | {"updated_at": now}
                for x in samples
                if (x.request_id, x.prompt_index) in held and x.token_ids
            ]
            if not rows:
                return 0
            insert = (postgresql if self.db.dialect == "postgresql" else sqlite).insert
            t = SampleCheckpointRow.__table__
            stmt = insert(t)
            stmt = stmt.on_conflict_do_update(
                index_elements=[t.c.request_id, t.c.prompt_index, t.c.sample_index],
                set_={c: stmt.excluded[c] for c in rows[0] if c not in _KEY},
                where=t.c.num_tokens < stmt.excluded.num_tokens,
            )
            s.connection().execute(stmt, rows)
            return len(rows)

    def of_units(self, request_id: str, prompt_indices: Sequence[int]) -> list[Sample]:
        """The checkpoints stored of these prompts' samples (ABORTED, partial)."""
        cp = SampleCheckpointRow
        with self.db.tx(write=False) as s:
            rows = s.execute(
                select(cp.__table__)
                .where(cp.request_id == request_id,
                       cp.prompt_index.in_(sorted(set(prompt_indices))))
                .order_by(cp.prompt_index, cp.sample_index),
                execution_options={BINARY_RESULTS: True},
            ).all()  # fmt: skip
            return [convert.sample_from_checkpoint(r) for r in rows]

    def _held(self, s: Session, samples: Sequence[Sample]) -> set[tuple[str, int]]:
        """The (request id, prompt index) units of `samples` this node may write: those it
        holds on a joined node, every one on a node alone."""
        units = {(x.request_id, x.prompt_index) for x in samples}
        if not self.db.epoch:
            return units
        wu = WorkUnitRow
        found = s.execute(
            select(wu.request_id, wu.prompt_index).where(
                wu.request_id.in_(sorted({r for r, _ in units})), self.leases.held(s)
            )
        ).all()
        return {(str(r), int(p)) for r, p in found} & units


_KEY = ("request_id", "prompt_index", "sample_index")
