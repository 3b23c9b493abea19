"""This node's devices: the inventory refresh, operator flags, what each device is doing."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from tltd.domain import Device, DeviceState
from tltd.errors import NotFound
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.lookups import device_rows
from tltd.store.status import record_event
from tltd.store.tables import DeviceRow, utcnow


class DeviceInventory:
    """This node's devices (and every node's, read)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def upsert(self, devices: Sequence[Device]) -> list[Device]:
        """Apply an inventory refresh.

        Observed fields (memory, utilization, processes, foreign, ...) are overwritten;
        operator flags (cordoned, draining) and the scheduler's state are kept. A device that
        was UNAVAILABLE and is seen again takes the observed state; a device missing from
        `devices` becomes UNAVAILABLE. Returns the whole inventory.
        """
        # One transaction: the inserts, updates and vanishings see one snapshot.
        with self.db.tx() as s:
            now = utcnow()
            mine = select(DeviceRow).where(DeviceRow.node_id == self.db.node_id)
            rows = {r.device_id: r for r in s.scalars(mine).all()}
            seen = set()
            for d in devices:
                seen.add(d.device_id)
                row = rows.get(d.device_id)
                if row is None:
                    row = self._add_device(s, d, now)
                else:
                    _refresh_device(s, row, d, now)
                _observe(s, row, d, d.device_id in rows, now)
            for device_id, row in rows.items():
                if device_id not in seen:
                    _vanish(s, row, now)
            s.flush()
            return [convert.device_from_row(r) for r in device_rows(s, self.db.node_id)]

    def _add_device(self, s: Session, d: Device, now: datetime) -> DeviceRow:
        """A device seen for the first time: its flags and state as observed, an event."""
        row = DeviceRow(
            node_id=self.db.node_id,
            device_id=d.device_id,
            cordoned=d.cordoned,
            draining=d.draining,
            state=str(d.state),
            state_reason=d.state_reason,
        )
        s.add(row)
        record_event(s, "device", d.device_id, "", d.state, "discovered", at=now)
        return row

    def _device_row(self, s: Session, device_id: str) -> DeviceRow:
        """This node's device, or another node's as "NODE/DEVICE" (device ids have no "/")."""
        node, _, device = device_id.rpartition("/")
        row = s.get(DeviceRow, (node or self.db.node_id, device))
        if row is None:
            raise NotFound(f"device {device_id!r} not found", field="device_id")
        return row

    def list(self) -> list[Device]:
        """All devices ever seen, by kind then index."""
        with self.db.tx(write=False) as s:
            return [convert.device_from_row(r) for r in device_rows(s, self.db.node_id)]

    def get(self, device_id: str) -> Device:
        with self.db.tx(write=False) as s:
            return convert.device_from_row(self._device_row(s, device_id))

    def set_flags(
        self,
        device_id: str,
        *,
        cordoned: bool | None = None,
        draining: bool | None = None,
        reason: str = "",
    ) -> Device:
        """Set operator flags (None leaves a flag as is); records an event when they change."""
        with self.db.tx() as s:
            row = self._device_row(s, device_id)
            old = _flags(row)
            if cordoned is not None:
                row.cordoned = cordoned
            if draining is not None:
                row.draining = draining
            if _flags(row) != old:
                row.updated_at = utcnow()
                record_event(s, "device", device_id, old, _flags(row), reason, at=row.updated_at)
            return convert.device_from_row(row)

    def set_state(self, device_id: str, new: DeviceState, reason: str) -> Device:
        """Record what a device is doing (idle/rollout/training/unavailable), with an event.
        An UNAVAILABLE device stays so: only an inventory refresh that sees it again
        (`upsert`) makes it usable, not a worker or trainer giving it back (whose
        write may land after the refresh that found it broken)."""
        with self.db.tx() as s:
            row = self._device_row(s, device_id)
            if row.state == DeviceState.UNAVAILABLE:
                return convert.device_from_row(row)
            if row.state != new:
                now = utcnow()
                record_event(s, "device", device_id, row.state, new, reason, at=now)
                row.state, row.state_reason, row.updated_at = str(new), reason, now
            return convert.device_from_row(row)


def _refresh_device(s: Session, row: DeviceRow, d: Device, now: datetime) -> None:
    """Decide state/state_reason of a known device from an observation (see `upsert`)."""
    if row.state == DeviceState.UNAVAILABLE or d.state == DeviceState.UNAVAILABLE:
        if row.state != d.state:
            record_event(
                s,
                "device",
                row.device_id,
                row.state,
                d.state,
                d.state_reason or "seen by inventory refresh",
                at=now,
            )
        row.state, row.state_reason = str(d.state), d.state_reason
    elif d.state_reason or row.foreign:
        # Discovery's reason (a foreign pid) replaces the old one; clear it once ours again.
        row.state_reason = d.state_reason


def _observe(s: Session, row: DeviceRow, d: Device, known: bool, now: datetime) -> None:
    """Overwrite the observed fields of `row` with `d`'s; a known device that became foreign
    (or ours again) records an event."""
    row.kind, row.device_index, row.uuid, row.name = (
        str(d.kind),
        d.index,
        d.uuid,
        d.name,
    )
    row.memory_total_bytes, row.memory_used_bytes = (
        d.memory_total_bytes,
        d.memory_used_bytes,
    )
    row.utilization = d.utilization
    row.processes = convert.processes_to_json(d.processes)
    if row.foreign != d.foreign and known:
        record_event(
            s,
            "device",
            d.device_id,
            "foreign" if row.foreign else "ours",
            "foreign" if d.foreign else "ours",
            d.state_reason,
            at=now,
        )
    row.foreign = d.foreign
    row.updated_at = now


def _vanish(s: Session, row: DeviceRow, now: datetime) -> None:
    """A device the refresh did not find becomes UNAVAILABLE (once, with an event)."""
    if row.state != DeviceState.UNAVAILABLE:
        reason = "not found by the last inventory refresh"
        record_event(s, "device", row.device_id, row.state, DeviceState.UNAVAILABLE, reason, at=now)
        row.state, row.state_reason, row.updated_at = (
            DeviceState.UNAVAILABLE.value,
            reason,
            now,
        )


def _flags(row: DeviceRow) -> str:
    names = [n for n in ("cordoned", "draining") if getattr(row, n)]
    return "+".join(names) or "schedulable"
