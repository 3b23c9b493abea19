"""Engine setup: SQLite pragmas really applied, URL handling, UTC datetimes, concurrent writers."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, StatementError

from tltd.domain import FinishReason, Job, RolloutRequest, Sample, SamplingParams
from tltd.errors import AlreadyExists
from tltd.store import Store, database
from tltd.store.database import WriteTurn, make_engine, normalize_url
from tltd.store.tables import JobRow, utcnow


def test_sqlite_pragmas_applied_on_every_connection(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'a' / 'b' / 'x.db'}"  # parent dirs are created
    engine = make_engine(url)
    try:
        conns = [engine.connect() for _ in range(2)]  # two pooled connections, both set up
        for conn in conns:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10_000
        for conn in conns:
            conn.close()
    finally:
        engine.dispose()
    assert (tmp_path / "a" / "b" / "x.db").exists()


def test_sqlite_foreign_keys_enforced(migrated_sqlite_url: str) -> None:
    sqlite_url = migrated_sqlite_url
    engine = make_engine(sqlite_url)
    try:
        with pytest.raises(IntegrityError, match="FOREIGN KEY"), engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO policy_versions (job_id, version, source, path, note, created_at)"
                    " VALUES ('missing', 0, 'initial', '/m', '', '2026-01-01 00:00:00')"
                )
            )
    finally:
        engine.dispose()


def test_url_normalization() -> None:
    assert normalize_url("postgresql://u@h:5432/d").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/d").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"
    with pytest.raises(ValueError, match="unsupported database URL"):
        make_engine("mysql://u@h/d")


def test_datetimes_are_aware_utc(store: Store) -> None:
    from sqlalchemy.orm import Session

    plus2 = timezone(timedelta(hours=2))
    at = datetime(2026, 1, 1, 12, 0, tzinfo=plus2)
    job, _ = store.jobs.create(Job(job_id="j", model_path="/m"))
    with Session(store.db.engine) as s, s.begin():
        s.get(JobRow, "j").updated_at = at
    with Session(store.db.engine) as s:
        got = s.get(JobRow, "j").updated_at
    assert got == at and got.tzinfo == UTC and got.hour == 10
    with pytest.raises(StatementError, match="naive datetime"):
        with Session(store.db.engine) as s, s.begin():
            s.get(JobRow, "j").updated_at = datetime(2026, 1, 1)
    assert abs(utcnow() - job.created_at) < timedelta(minutes=1)


def test_concurrent_writers_on_sqlite_do_not_fail(migrated_sqlite_url: str) -> None:
    """Two Store instances (two pools) writing at once: BEGIN IMMEDIATE + busy_timeout serialize
    them instead of failing with "database is locked"."""
    sqlite_url = migrated_sqlite_url
    a, b = Store(sqlite_url), Store(sqlite_url)
    try:
        a.jobs.create(Job(job_id="j", model_path="/m"))
        a.requests.create(
            RolloutRequest(
                request_id="r", job_id="j", prompts=((1,),) * 40, sampling=SamplingParams(n=2)
            )
        )
        errors: list[BaseException] = []

        def write(store: Store, prompt_indices: range) -> None:
            try:
                for p in prompt_indices:
                    for s in range(2):
                        store.samples.add(
                            Sample("r", p, s, (1, 2), (-0.1, -0.2), FinishReason.STOP)
                        )
                        store.requests.get("r")
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [
            threading.Thread(target=write, args=(a, range(0, 40))),
            threading.Thread(target=write, args=(b, range(0, 40))),  # same keys: duplicates
            threading.Thread(target=write, args=(b, range(20, 40))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert a.requests.get("r").samples_done == 80
        assert len(b.samples.list("r")) == 80
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_a_frozen_transaction_does_not_hold_its_row_locks_for_ever(pg_url: str) -> None:
    """A node frozen mid-transaction (SIGSTOP) holds row locks that block every other node's
    writes to those rows: the server ends its session once it has been idle in the
    transaction for PG_IDLE_IN_TRANSACTION_MS, and the other writer goes on."""
    import time

    from tltd.store.database import PG_IDLE_IN_TRANSACTION_MS

    engine = make_engine(pg_url)
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (id int PRIMARY KEY, v int)"))
        c.execute(text("INSERT INTO t VALUES (1, 0)"))
    frozen = engine.connect()
    frozen.begin()
    frozen.execute(text("SELECT v FROM t WHERE id = 1 FOR UPDATE"))  # then it stops
    start = time.monotonic()
    with engine.begin() as other:
        other.execute(text("UPDATE t SET v = 1 WHERE id = 1"))
    waited = time.monotonic() - start
    assert PG_IDLE_IN_TRANSACTION_MS / 1000 - 1 < waited < PG_IDLE_IN_TRANSACTION_MS / 1000 + 10
    with pytest.raises(Exception, match="idle-in-transaction|terminat|closed"):
        frozen.execute(text("SELECT 1"))  # its session is gone: a late write fails
    frozen.close()
    engine.dispose()


def test_writers_of_one_store_take_turns_and_give_them_up(migrated_sqlite_url: str) -> None:
    """Concurrent writers of one SQLite store all land; one that raises gives its turn up."""
    sqlite_url = migrated_sqlite_url
    store = Store(sqlite_url)
    try:
        store.jobs.create(Job(job_id="j", model_path="/m"))
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:
                for k in range(10):
                    store.requests.create(
                        RolloutRequest(f"r-{i}-{k}", "j", ((1,),), SamplingParams())
                    )
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(store.requests.list(None, "j", None)) == 40
        with pytest.raises(AlreadyExists):  # a refused write ...
            store.requests.create(RolloutRequest("r-0-0", "j", ((2,),), SamplingParams()))
        done = threading.Event()
        threading.Thread(target=lambda: (store.jobs.create(Job("k", "/m")), done.set())).start()
        assert done.wait(5)  # ... left the turn free for the next one
    finally:
        store.close()


def test_a_write_turn_queues_other_threads_and_re_enters_its_own(monkeypatch) -> None:
    turn, order, leave = WriteTurn(), [], threading.Event()

    def other() -> None:
        with turn():
            order.append("other")
            leave.wait(5)

    with turn():
        with turn():  # the same thread again (a nested writer meets SQLite's own lock)
            t = threading.Thread(target=other)
            t.start()
            t.join(0.2)
            assert order == []  # the other thread waits for the turn
            order.append("first")
    deadline = time.monotonic() + 5
    while order != ["first", "other"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["first", "other"]
    # Never waits for ever: past the busy timeout a writer goes on (and meets SQLite's lock).
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 50)
    with turn():
        order.append("after the timeout")
    leave.set()
    t.join(5)
    assert order[-1] == "after the timeout"


def test_a_driver_statement_on_sqlite_binds_through_types_and_raises_as_sqlalchemy(
    migrated_sqlite_url: str,
) -> None:
    """SQLite's positional binds in the compiled order, each through its type's processor (an
    aware datetime stored as naive UTC text); the cursor events fire; the driver's rows come
    back as they are; a duplicate key stays SQLAlchemy's IntegrityError."""
    from sqlalchemy import bindparam, event, select

    from tltd.store.database import DriverStatement
    from tltd.store.tables import EventRow

    ev = EventRow.__table__
    columns = ("id", "entity", "entity_id", "old_status", "new_status", "reason", "at")
    insert = DriverStatement(ev.insert(), columns=columns)
    read = DriverStatement(
        select(ev.c.id, ev.c.entity_id, ev.c.at).where(ev.c.at == bindparam("at"))
    )
    at = datetime(2026, 3, 1, 14, 30, 5, 123456, tzinfo=timezone(timedelta(hours=2)))
    row = {"id": 7, "entity": "request", "entity_id": "r", "old_status": "",
           "new_status": "queued", "reason": "submitted", "at": at}  # fmt: skip
    seen: list[object] = []
    store = Store(migrated_sqlite_url)
    event.listen(store.db.engine, "before_cursor_execute", lambda *a: seen.append(a[3]))
    try:
        with store.db.tx() as s:
            conn = s.connection()
            insert.execute(conn, row).close()
            got = read.first(conn, {"at": at})
            assert read.all(conn, {"at": at}) == [got]
        assert got == (7, "r", "2026-03-01 12:30:05.123456")
        assert (7, "request", "r", "", "queued", "submitted", got[2]) in seen
        with pytest.raises(IntegrityError), store.db.tx() as s:
            insert.execute(s.connection(), row | {"at": utcnow()})
        with store.db.tx() as s:
            assert read.all(s.connection(), {"at": at}) == [got]  # the first row, alone
    finally:
        store.close()
