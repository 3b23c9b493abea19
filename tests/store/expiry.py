"""Leases and heartbeats made old by writing their rows: a test of what happens once a lease
has lapsed forces the lapse instead of sleeping past a short lease, so that the "still live"
half of it can use a long one (a loaded machine never makes it lapse early)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import update

from tltd.store import Store
from tltd.store.clock import db_now
from tltd.store.tables import DrafterLeaseRow, NodeRow, WorkUnitRow

LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)


def _write(store: Store, stmt) -> int:
    with store.db.engine.begin() as conn:
        return conn.execute(stmt).rowcount


def expire_unit_leases(store: Store, ending_within: float | None = None) -> int:
    """Every live unit lease lapses now; with `ending_within`, only those that would have
    lapsed within that many seconds. Returns how many lapsed."""
    wu = WorkUnitRow
    live = wu.lease_expires_at.is_not(None)
    if ending_within is not None:
        live = wu.lease_expires_at < db_now(store.dialect, ending_within)
    return _write(store, update(wu).where(live).values(lease_expires_at=LONG_AGO))


def expire_drafter_lease(store: Store, job_id: str) -> int:
    """The job's drafter training lease lapses."""
    stmt = update(DrafterLeaseRow).where(DrafterLeaseRow.job_id == job_id)
    return _write(store, stmt.values(expires_at=LONG_AGO))


def silence_node(store: Store, node_id: str) -> int:
    """The node's last heartbeat is long past (as if it had missed every beat since)."""
    stmt = update(NodeRow).where(NodeRow.node_id == node_id)
    return _write(store, stmt.values(heartbeat_at=LONG_AGO))
