"""The nodes table: a node joins with a new epoch (its fencing token), heartbeats, leaves."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import case, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tltd.domain import Device, Node, NodeStatus
from tltd.errors import ConfigError, Fenced, NotFound
from tltd.store import convert
from tltd.store.clock import db_now, read_db_now
from tltd.store.database import Database
from tltd.store.notifications import NODE, notify
from tltd.store.status import record_event
from tltd.store.tables import DeviceRow, NodeRow, WorkerRow, utcnow

log = logging.getLogger(__name__)


class NodeRegistry:
    """The nodes: a join takes a new epoch (this node's fencing token, kept on the database:
    0 until it joins), heartbeats, drains and cordons."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def join(self, address: str, down_seconds: float) -> int:
        """Register this node and increment its epoch in one statement; returns the epoch.

        SQLite is single-node: a join is refused (ConfigError) while another node's row is up
        with a heartbeat younger than `down_seconds` (SQLite's write lock, taken at BEGIN,
        makes the check and the join one step). Rows written before nodes existed (node id
        "") become this node's."""
        with self.db.tx() as s:
            if self.db.dialect == "sqlite":
                self._refuse_second_node(s, down_seconds)
            insert = (postgresql if self.db.dialect == "postgresql" else sqlite).insert
            now = db_now(self.db.dialect)
            stmt = insert(NodeRow).values(
                node_id=self.db.node_id, address=address, state="up", epoch=1,
                heartbeat_at=now, started_at=now,
            )  # fmt: skip
            stmt = stmt.on_conflict_do_update(
                index_elements=[NodeRow.node_id],
                set_={
                    "epoch": NodeRow.epoch + 1,
                    "address": stmt.excluded.address,
                    "state": "up",
                    "heartbeat_at": stmt.excluded.heartbeat_at,
                    "started_at": stmt.excluded.started_at,
                    # A drain asked of the previous process ends with it (a cordon stays).
                    "drain_requested": False,
                    "drain_reason": "",
                    "drain_grace_seconds": 0.0,
                },
            ).returning(NodeRow.epoch)
            epoch = int(s.execute(stmt).scalar_one())
            for table in (DeviceRow, WorkerRow):
                key = table.device_id if table is DeviceRow else table.worker_id
                taken = select(key).where(table.node_id == self.db.node_id).scalar_subquery()
                s.execute(
                    update(table)
                    .where(table.node_id == "", key.not_in(taken))
                    .values(node_id=self.db.node_id)
                )
            record_event(s, "node", self.db.node_id, "", "up", f"joined with epoch {epoch}")
        self.db.epoch = epoch
        log.info("node joined", extra={"node_id": self.db.node_id, "epoch": epoch})
        return epoch

    def _refuse_second_node(self, s: Session, down_seconds: float) -> None:
        now = read_db_now(s)
        for row in s.scalars(
            select(NodeRow).where(NodeRow.node_id != self.db.node_id, NodeRow.state == "up")
        ):
            age = (now - row.heartbeat_at).total_seconds()
            if age < down_seconds:
                raise ConfigError(
                    f"this SQLite database is in use by node {row.node_id!r} (heartbeat "
                    f"{age:.1f}s ago): SQLite serves one node; several nodes share a "
                    "PostgreSQL database (database_url)"
                )

    def beat(self, down_seconds: float, address: str | None = None) -> int:
        """Stamp this node's heartbeat; returns its epoch. A beat after a silence longer than
        `down_seconds` (the node was DOWN: paused, cut off) takes a new epoch in the same
        statement, so whatever it held under the old one is fenced. Raises Fenced when
        another process has joined under this node id since."""
        with self.db.tx() as s:
            stale = NodeRow.heartbeat_at < db_now(self.db.dialect, -down_seconds)
            values: dict = {
                "heartbeat_at": db_now(self.db.dialect),
                "state": "up",
                "epoch": case((stale, NodeRow.epoch + 1), else_=NodeRow.epoch),
            }
            if address is not None:
                values["address"] = address
            epoch = s.execute(
                update(NodeRow)
                .where(NodeRow.node_id == self.db.node_id, NodeRow.epoch == self.db.epoch)
                .values(**values)
                .returning(NodeRow.epoch)
            ).scalar_one_or_none()
            if epoch is None:
                raise Fenced(
                    f"node {self.db.node_id!r} epoch {self.db.epoch} is no longer current: another "
                    "daemon joined with this node id"
                )
            if epoch != self.db.epoch:
                why = f"back after more than {down_seconds:g}s without a heartbeat"
                record_event(s, "node", self.db.node_id, "down", "up", f"{why}: epoch {epoch}")
        if epoch != self.db.epoch:
            log.warning("node rejoined", extra={"node_id": self.db.node_id, "epoch": epoch})
        self.db.epoch = int(epoch)
        return self.db.epoch

    @contextmanager
    def cluster_lock(self, name: str) -> Iterator[bool]:
        """Hold PostgreSQL's session advisory lock `name` for the block if no other node
        holds it (yields False then, without waiting): a cluster-wide periodic job runs on
        one node at a time. SQLite has one node: always True."""
        if self.db.dialect != "postgresql":
            yield True
            return
        key = _lock_key(name)
        with self.db.engine.connect() as conn:
            held = bool(conn.scalar(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}))
            conn.commit()
            try:
                yield held
            finally:
                if held:
                    conn.scalar(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                    conn.commit()

    def leave(self) -> None:
        """A clean shutdown: the node is LEFT (not DOWN) until it joins again."""
        with self.db.tx() as s:
            s.execute(
                update(NodeRow)
                .where(NodeRow.node_id == self.db.node_id, NodeRow.epoch == self.db.epoch)
                .values(state="left")
            )
            record_event(s, "node", self.db.node_id, "up", "left", "shut down")

    def request_drain(self, node_id: str, reason: str, grace_seconds: float) -> list[Device]:
        """Ask node `node_id` (any node of the database) to drain: recorded on its row with
        its devices marked draining, and announced (NODE notification); the node starts
        draining at the notification or its next heartbeat. Returns its devices."""
        with self.db.tx() as s:
            row = self._node_row(s, node_id)
            if not row.drain_requested:
                record_event(s, "node", node_id, "", "drain requested", reason)
            row.drain_requested = True
            row.drain_reason = reason
            row.drain_grace_seconds = grace_seconds
            devices = self._flag_devices(s, node_id, reason, draining=True)
            notify(s, NODE, node_id)
            return devices

    def set_cordon(self, node_id: str, cordoned: bool, reason: str) -> list[Device]:
        """Cordon (or uncordon) every device of node `node_id`: it is given no new work
        (what runs there keeps running); its scheduler reads the flags at its next tick."""
        with self.db.tx() as s:
            row = self._node_row(s, node_id)
            if row.cordoned != cordoned:
                new = "cordoned" if cordoned else "uncordoned"
                record_event(s, "node", node_id, "", new, reason)
            row.cordoned = cordoned
            return self._flag_devices(s, node_id, reason, cordoned=cordoned)

    def requested_drain(self) -> tuple[str, float] | None:
        """(reason, grace seconds) when a drain of this node was requested through the store."""
        with self.db.tx(write=False) as s:
            row = s.get(NodeRow, self.db.node_id)
            if row is None or not row.drain_requested:
                return None
            return row.drain_reason, row.drain_grace_seconds

    @staticmethod
    def _node_row(s: Session, node_id: str) -> NodeRow:
        row = s.get(NodeRow, node_id, with_for_update=True)
        if row is None:
            raise NotFound(f"node {node_id!r} not found", field="node_id")
        return row

    @staticmethod
    def _flag_devices(s: Session, node_id: str, reason: str, **flags: bool) -> list[Device]:
        rows = s.scalars(
            select(DeviceRow)
            .where(DeviceRow.node_id == node_id)
            .order_by(DeviceRow.kind, DeviceRow.device_index)
        ).all()
        now = utcnow()
        for row in rows:
            old = "+".join(n for n in ("cordoned", "draining") if getattr(row, n)) or "schedulable"
            for name, value in flags.items():
                setattr(row, name, value)
            new = "+".join(n for n in ("cordoned", "draining") if getattr(row, n)) or "schedulable"
            if new != old:
                row.updated_at = now
                record_event(s, "device", f"{node_id}/{row.device_id}", old, new, reason, at=now)
        s.flush()
        return [convert.device_from_row(r) for r in rows]

    def list(self, down_seconds: float) -> list[Node]:
        """Every node ever joined, by id; DOWN when its heartbeat is older than
        `down_seconds` by the database's clock."""
        with self.db.tx(write=False) as s:
            now = read_db_now(s)
            return [
                _node(row, (now - row.heartbeat_at).total_seconds(), down_seconds)
                for row in s.scalars(select(NodeRow).order_by(NodeRow.node_id))
            ]


def _lock_key(name: str) -> int:
    """A stable signed 64-bit key per job name (advisory locks take a bigint)."""
    digest = hashlib.sha256(f"tltd:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _node(row: NodeRow, age: float, down_seconds: float) -> Node:
    if row.state == "left":
        status = NodeStatus.LEFT
    else:
        status = NodeStatus.DOWN if age >= down_seconds else NodeStatus.UP
    return Node(
        node_id=row.node_id,
        address=row.address,
        status=status,
        epoch=row.epoch,
        heartbeat_age_seconds=max(0.0, age),
        heartbeat_at=row.heartbeat_at,
        started_at=row.started_at,
        cordoned=row.cordoned,
        draining=row.drain_requested,
    )
