"""The database's clock: leases and heartbeats are read against one clock every node shares."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Interval, bindparam, func, literal, select
from sqlalchemy.orm import Session

from tltd.store.tables import UTCDateTime, utcnow


def db_now(dialect: str, plus_seconds: float = 0.0) -> Any:
    """`now() + plus_seconds` as an SQL expression. PostgreSQL's now() is the one clock all
    nodes read (a node's own clock may be off); SQLite serves one node, whose clock it is."""
    if dialect == "postgresql":
        now = func.now(type_=UTCDateTime())
        return now + literal(timedelta(seconds=plus_seconds), Interval()) if plus_seconds else now
    return literal(utcnow() + timedelta(seconds=plus_seconds), UTCDateTime())


def read_db_now(s: Session) -> datetime:
    """The database's time now (aware UTC)."""
    if s.get_bind().dialect.name == "postgresql":
        return s.scalar(select(func.now(type_=UTCDateTime())))
    return utcnow()


def db_now_bound(dialect: str) -> Any:
    """`db_now` for a statement built once: `now()` on PostgreSQL; on SQLite a bound value
    named "db_now" that each execution passes (this node's clock, `utcnow()`)."""
    if dialect == "postgresql":
        return func.now(type_=UTCDateTime())
    return bindparam("db_now", type_=UTCDateTime())


def db_now_params(dialect: str) -> dict[str, datetime]:
    """What an execution of a statement built with `db_now_bound` passes for it."""
    return {} if dialect == "postgresql" else {"db_now": utcnow()}


def db_later_bound(dialect: str) -> Any:
    """`db_now(dialect, seconds)` for a statement built once: executions pass
    `db_later_params(dialect, seconds)`."""
    if dialect == "postgresql":
        return func.now(type_=UTCDateTime()) + bindparam("later", type_=Interval())
    return bindparam("db_later", type_=UTCDateTime())


def db_later_params(dialect: str, seconds: float) -> dict[str, Any]:
    """What an execution of a statement built with `db_later_bound` passes for it."""
    if dialect == "postgresql":
        return {"later": timedelta(seconds=seconds)}
    return {"db_later": utcnow() + timedelta(seconds=seconds)}
