"""The one place statuses change: an allowed-transitions map per entity plus an event per change."""

from __future__ import annotations

import functools
from datetime import datetime

from sqlalchemy import Insert, Update, bindparam, func, literal, select, union_all, update
from sqlalchemy.orm import Session

from tltd.domain import DrafterStatus, JobStatus, RequestStatus, WorkerState
from tltd.errors import FailedPrecondition
from tltd.store.database import DriverStatement
from tltd.store.notifications import notify
from tltd.store.tables import EventRow, utcnow

_J, _R, _D, _W = JobStatus, RequestStatus, DrafterStatus, WorkerState

TRANSITIONS: dict[str, dict[str, frozenset[str]]] = {
    "job": {
        _J.ACTIVE: frozenset({_J.CANCELLED, _J.FAILED}),
    },
    "request": {
        _R.QUEUED: frozenset({_R.RUNNING, _R.CANCELLED, _R.FAILED}),
        # running -> queued is a requeue (worker lost, lease expired, preempted).
        _R.RUNNING: frozenset({_R.COMPLETED, _R.CANCELLED, _R.FAILED, _R.QUEUED}),
    },
    "drafter": {
        _D.CANDIDATE: frozenset({_D.PROMOTED, _D.REJECTED}),
        _D.PROMOTED: frozenset({_D.RETIRED}),
        _D.REJECTED: frozenset({_D.RETIRED}),
    },
    "worker": {
        _W.STARTING: frozenset({_W.READY, _W.STOPPING, _W.FAILED}),
        _W.READY: frozenset({_W.BUSY, _W.STOPPING, _W.FAILED}),
        _W.BUSY: frozenset({_W.READY, _W.STOPPING, _W.FAILED}),
        _W.STOPPING: frozenset({_W.STOPPED, _W.FAILED}),
    },
}

# Rows carry their status in different columns ("status" for most, "state" for workers).
_COLUMN = {"job": "status", "request": "status", "drafter": "status", "worker": "state"}


def check_transition(entity: str, entity_id: str, old: str, new: str) -> None:
    """Raise FailedPrecondition unless `old -> new` is allowed for this entity."""
    allowed = TRANSITIONS[entity].get(old, frozenset())
    if new not in allowed:
        raise FailedPrecondition(
            f"{entity} {entity_id!r} cannot go from {old} to {new}"
            + (f" (allowed: {', '.join(sorted(allowed))})" if allowed else f" ({old} is final)")
        )


def switch_status(
    session: Session, entity: str, entity_id: str, row: object, new: str, reason: str
) -> bool:
    """Move `row` to status `new` if allowed and append an event, in the caller's transaction.

    Setting the status a row already has is a no-op (returns False, records nothing), so that
    retried calls (a second cancel) are harmless; any other disallowed move raises
    FailedPrecondition naming the entity and both states.
    """
    column = _COLUMN[entity]
    old = str(getattr(row, column))
    new = str(new)
    if old == new:
        return False
    check_transition(entity, entity_id, old, new)
    now = utcnow()
    setattr(row, column, new)
    setattr(row, f"{column}_reason", reason)
    if hasattr(row, "updated_at"):
        row.updated_at = now  # type: ignore[attr-defined]
    record_event(session, entity, entity_id, old, new, reason, at=now)
    return True


def switch_status_from(
    session: Session, entity: str, row_type: type, entity_id: str, old: str, new: str,
    reason: str, channel: str = "",
) -> bool:  # fmt: skip
    """`switch_status` for a row not loaded: one UPDATE that moves it only from status `old`
    (then records the event; returns True), else changes nothing (False). Core statements,
    built once: not for the tables a scheduler tick reads (`Database.scheduling_writes` watches
    the ORM's writes). `channel`: also `notify` it of `entity_id`, moved or not (PostgreSQL:
    in the same statement when it moved)."""
    check_transition(entity, entity_id, str(old), str(new))
    now = utcnow()
    params = {"key": entity_id, "old": str(old), "new": str(new), "reason": reason, "now": now}
    conn = session.connection()
    if conn.dialect.name == "postgresql":  # one round trip: the event inserted from the UPDATE
        params |= {"entity": entity, "channel": channel}
        statement = _moved_with_event(entity, row_type, bool(channel))
        return _notified(session, statement.first(conn, params), channel, entity_id)
    moved = _guarded(entity, row_type).rowcount(conn, params)
    if moved:
        EVENT_ROW.execute(
            conn,
            {"entity": entity, "entity_id": entity_id, "old_status": str(old),
             "new_status": str(new), "reason": reason, "at": now},
        ).close()  # fmt: skip
    return _notified(session, moved or None, channel, entity_id)


def _notified(session: Session, moved: object, channel: str, key: str) -> bool:
    """Whether the row `moved` (a row or count, None when not); `notify` of `key` on
    `channel` when its statement did not send it (the row did not move, or SQLite)."""
    if channel and (moved is None or session.get_bind().dialect.name != "postgresql"):
        notify(session, channel, key)
    return moved is not None


def switch_status_through(
    session: Session, entity: str, row_type: type, entity_id: str, old: str,
    steps: list[tuple[str, str]], channel: str = "",
) -> bool:  # fmt: skip
    """`switch_status_from` through one or more statuses in a row (`steps`: status, reason;
    each move allowed from the one before): one UPDATE from `old` to the last, an event per
    step (in order); on PostgreSQL one statement for all of it. True when the row moved.
    `channel`: as `switch_status_from`'s."""
    before = [str(old), *(str(x) for x, _ in steps[:-1])]
    for prev, (new, _) in zip(before, steps, strict=True):
        check_transition(entity, entity_id, prev, str(new))
    now = utcnow()
    last, reason = steps[-1]
    params: dict[str, object] = {
        "key": entity_id, "old": str(old), "new": str(last), "reason": reason, "now": now,
    }  # fmt: skip
    events = [
        {"entity": entity, "entity_id": entity_id, "old_status": prev, "new_status": str(new),
         "reason": why, "at": now}
        for prev, (new, why) in zip(before, steps, strict=True)
    ]  # fmt: skip
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        params |= {"entity": entity, "channel": channel}
        for i, e in enumerate(events):
            params |= {f"o{i}": e["old_status"], f"n{i}": e["new_status"], f"r{i}": e["reason"]}
        statement = _moved_through_with_events(entity, row_type, len(steps), bool(channel))
        return _notified(session, statement.first(conn, params), channel, entity_id)
    moved = _guarded(entity, row_type).rowcount(conn, params)
    if moved:
        EVENT_ROW.execute_many(conn, events).close()
    return _notified(session, moved or None, channel, entity_id)


def switch_statuses_from(
    session: Session, entity: str, row_type: type, moves: list[tuple[str, str]], new: str,
    reason: str,
) -> int:  # fmt: skip
    """`switch_status_from` for many rows, each from its own old status (`moves`: key, old),
    read under their row locks in this transaction: one UPDATE and one event INSERT, both
    executemany. Returns the rows moved."""
    if not moves:
        return 0
    for key, old in moves:
        check_transition(entity, key, str(old), str(new))
    now = utcnow()
    conn = session.connection()
    params = [
        {"key": key, "old": str(old), "new": str(new), "reason": reason, "now": now}
        for key, old in moves
    ]
    moved = conn.execute(_guarded_update(entity, row_type), params).rowcount
    conn.execute(
        _EVENT_INSERT,
        [{"entity": entity, "entity_id": key, "old_status": str(old), "new_status": str(new),
          "reason": reason, "at": now} for key, old in moves],
    )  # fmt: skip
    return moved


@functools.cache
def _guarded_update(entity: str, row_type: type) -> Update:
    """UPDATE <row> SET status = :new ... WHERE key = :key AND status = :old (built once)."""
    column = _COLUMN[entity]
    table = row_type.__table__  # type: ignore[attr-defined]
    key = next(iter(table.primary_key.columns))
    values = {column: bindparam("new"), f"{column}_reason": bindparam("reason")}
    if "updated_at" in table.c:
        values["updated_at"] = bindparam("now")
    return (
        update(table)
        .where(key == bindparam("key"), table.c[column] == bindparam("old"))
        .values(**values)
    )


@functools.cache
def _guarded(entity: str, row_type: type) -> DriverStatement:
    """`_guarded_update` run on the driver's cursor."""
    return DriverStatement(_guarded_update(entity, row_type))


def _returning(insert: Insert, notifies: bool) -> DriverStatement:
    """RETURNING the event's id (the driver's row count of an INSERT fed by a data-modifying
    CTE is -1) and, when `notifies`, pg_notify("channel", key) per event: one per transaction
    arrives (PostgreSQL sends a channel's same payload once). Run on the driver's cursor."""
    ev = EventRow.__table__
    if notifies:
        insert = insert.returning(ev.c.id, func.pg_notify(bindparam("channel"), ev.c.entity_id))
    else:
        insert = insert.returning(ev.c.id)
    return DriverStatement(insert)


@functools.cache
def _moved_with_event(entity: str, row_type: type, notifies: bool = False) -> DriverStatement:
    """WITH moved AS (<the guarded UPDATE> RETURNING key) INSERT INTO events ... SELECT FROM
    moved: the event exactly when the row moved (PostgreSQL; built once); `_returning`."""
    table = row_type.__table__  # type: ignore[attr-defined]
    key = next(iter(table.primary_key.columns))
    moved = _guarded_update(entity, row_type).returning(key).cte("moved")
    ev = EventRow.__table__
    row = select(
        bindparam("entity", type_=ev.c.entity.type),
        moved.c[key.name],
        bindparam("old", type_=ev.c.old_status.type),
        bindparam("new", type_=ev.c.new_status.type),
        bindparam("reason", type_=ev.c.reason.type),
        bindparam("now", type_=ev.c.at.type),
    ).select_from(moved)
    cols = [ev.c.entity, ev.c.entity_id, ev.c.old_status, ev.c.new_status, ev.c.reason, ev.c.at]
    return _returning(ev.insert().from_select(cols, row), notifies)


@functools.cache
def _moved_through_with_events(
    entity: str, row_type: type, steps: int, notifies: bool = False
) -> DriverStatement:
    """`_moved_with_event` with an event per step of `switch_status_through` (binds o<i>,
    n<i>, r<i>), inserted in step order (PostgreSQL; built once)."""
    table = row_type.__table__  # type: ignore[attr-defined]
    key = next(iter(table.primary_key.columns))
    moved = _guarded_update(entity, row_type).returning(key).cte("moved")
    ev = EventRow.__table__
    rows = union_all(
        *(
            select(
                bindparam("entity", type_=ev.c.entity.type).label("entity"),
                moved.c[key.name].label("entity_id"),
                bindparam(f"o{i}", type_=ev.c.old_status.type).label("old_status"),
                bindparam(f"n{i}", type_=ev.c.new_status.type).label("new_status"),
                bindparam(f"r{i}", type_=ev.c.reason.type).label("reason"),
                bindparam("now", type_=ev.c.at.type).label("at"),
                literal(i).label("step"),
            ).select_from(moved)
            for i in range(steps)
        )
    ).subquery("steps")
    cols = [ev.c.entity, ev.c.entity_id, ev.c.old_status, ev.c.new_status, ev.c.reason, ev.c.at]
    ordered = select(*(rows.c[c.name] for c in cols)).order_by(rows.c.step)
    return _returning(ev.insert().from_select(cols, ordered), notifies)


_EVENT_INSERT = EventRow.__table__.insert()
# An event row's INSERT on the driver's cursor (status moves, admission).
EVENT_ROW = DriverStatement(
    _EVENT_INSERT, columns=("entity", "entity_id", "old_status", "new_status", "reason", "at")
)


def record_event(
    session: Session,
    entity: str,
    entity_id: str,
    old: str,
    new: str,
    reason: str,
    *,
    at: datetime | None = None,
) -> None:
    """Append an event row (also used for changes outside the transition maps: device flags)."""
    session.add(
        EventRow(
            entity=entity,
            entity_id=entity_id,
            old_status=old,
            new_status=new,
            reason=reason,
            at=at or utcnow(),
        )
    )
