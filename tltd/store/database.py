"""The one database the store's repositories share (`Database`: engine, sessions, transactions,
this node's id and epoch), and its engine: SQLite (WAL, foreign keys, busy timeout) or PostgreSQL
via psycopg 3."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Dialect, Engine, create_engine, make_url
from sqlalchemy.engine.interfaces import Compiled
from sqlalchemy.exc import InvalidRequestError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql import Executable

from tltd.store import notifications
from tltd.store.write_watch import WriteWatch

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 10_000
# Execution option that marks a connection as about to write (see _sqlite_begin).
WRITE_OPTION = "tltd_write"
# An execution option: PostgreSQL sends the results in its binary format. Sample payloads
# (bytea) then arrive as they are, not as hex text to decode: a 4,096-token sample's read
# costs ~0.1 ms of CPU less. Set where the columns' binary loaders give the same values.
BINARY_RESULTS = "tltd_binary_results"
# What a scheduler tick reads (`devices_and_jobs`): jobs, their active drafters, devices.
# ("job_pauses": a job paused keep freezes its workers on every node's next tick)
SCHEDULING_TABLES = ("jobs", "drafter_versions", "devices", "job_pauses")


class Database:
    """One engine and its sessions, shared by the store's repositories: each of their calls is
    one short transaction (`tx`). `node_id` names the node whose devices and workers the
    repositories read and write; `epoch` is its fencing token, set when the node joins
    (`NodeRegistry.join`; 0: not joined)."""

    def __init__(self, url: str, node_id: str) -> None:
        self.url = url
        self.node_id = node_id
        self.epoch = 0
        self.engine = make_engine(url)
        self.own_backends = notifications.OwnBackends(self.engine)  # PostgreSQL sessions
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        # Writers announce themselves so that SQLite takes its write lock at BEGIN.
        writer_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._writer = sessionmaker(writer_engine, expire_on_commit=False)
        # PostgreSQL locks rows; SQLite's writers take turns (WriteTurn).
        self._write_turn = WriteTurn() if self.dialect == "sqlite" else nullcontext
        # Moves after each commit that changed what a tick reads (see write_watch).
        self.scheduling_writes = WriteWatch(SCHEDULING_TABLES, notifications.STATE)
        self.scheduling_writes.watch(self._writer)
        self.scheduling_writes.watch(self._reader)
        self._batch = threading.local()  # .session: the open `batch` of this thread
        # PostgreSQL: a transaction of one statement, no BEGIN and COMMIT round trips.
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    @property
    def dialect(self) -> str:
        """ "sqlite" or "postgresql"."""
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make the repository calls of this thread, until the block ends, one transaction (one
        commit, one write turn), each call in a savepoint of its own: a call that raises undoes
        only its own writes. Nothing is committed unless the block ends without an error; then
        nothing of it is, and the caller may run the calls again one by one."""
        with self._write_turn(), self._writer.begin() as session:
            self._batch.session = session
            try:
                yield
            finally:
                self._batch.session = None

    def one_statement(self) -> AbstractContextManager[Connection] | None:
        """On PostgreSQL, a connection for a write done in one statement: outside a `batch`
        each statement on it is a transaction of its own (autocommit: one round trip to the
        server instead of three, BEGIN, it, COMMIT); in one, the batch's, in a savepoint of
        its own (the statement fails alone). None on SQLite."""
        if self.dialect != "postgresql":
            return None
        batch: Session | None = getattr(self._batch, "session", None)
        if batch is None:
            return self._autocommit.connect()
        return _in_savepoint(batch)

    @contextmanager
    def statements_tx(self) -> Iterator[Session]:
        """`tx` for a write done in SQL statements alone (no ORM object added or changed): in
        a `batch`, its savepoint is the driver's (`_in_savepoint`), not the session's."""
        batch: Session | None = getattr(self._batch, "session", None)
        if batch is None:
            with self.tx() as session:
                yield session
            return
        batch.expire_all()  # as `tx`: each call reads afresh
        with _in_savepoint(batch):
            yield batch

    @contextmanager
    def tx(self, write: bool = True) -> Iterator[Session]:
        """A session in a transaction of its own (or a savepoint of this thread's `batch`);
        committed when the block ends without an error."""
        batch: Session | None = getattr(self._batch, "session", None)
        if batch is not None:
            # Each call reads afresh, as it would in a transaction of its own (a row an earlier
            # call loaded may have changed since; a lock taken now must see it as it is).
            batch.expire_all()
            with batch.begin_nested() if write else nullcontext():
                yield batch
            return
        if not write:
            with self._reader.begin() as session:
                yield session
            return
        with self._write_turn(), self._writer.begin() as session:
            yield session


@contextmanager
def _in_savepoint(session: Session) -> Iterator[Connection]:
    """The session's connection in a savepoint the driver sets (for Core statements: no ORM
    object is written or undone), released at the end or rolled back to on an error: a
    fifth of the CPU of the session's own savepoint, whose bookkeeping is for ORM objects."""
    conn = session.connection()
    driver = conn.connection.driver_connection
    driver.execute("SAVEPOINT tltd_statement")
    try:
        yield conn
    except BaseException:
        driver.execute("ROLLBACK TO SAVEPOINT tltd_statement")
        raise
    driver.execute("RELEASE SAVEPOINT tltd_statement")


class DriverStatement:
    """A Core statement compiled once per dialect and run on the driver's own cursor of a
    connection: SQLAlchemy's execution context and result objects are skipped (about as much
    CPU again as psycopg's own work for the statement, several times sqlite3's). For a
    statement built once whose binds are plain values (no expanding lists). Binds go through
    their types' processors as in `Connection.execute` (named on PostgreSQL, in the compiled
    order on SQLite's positional `?`), the engine's cursor events fire, and a driver error
    goes through the connection's own handling (raised as SQLAlchemy's; a lost connection
    invalidates the pool). Rows come back as the driver's tuples, not processed by column
    type: for columns read as numbers, strings and flags (SQLite's flags are 0 and 1)."""

    def __init__(
        self, statement: Executable, binary: bool = False, columns: Sequence[str] | None = None
    ) -> None:
        """`binary`: on PostgreSQL every bind is sent in the binary format (psycopg's `%b`
        placeholders): arrays and bytes are not escaped into text, for an INSERT of many
        rows from arrays about half the driver's CPU. Each value must then have a binary
        form whose type the statement's cast accepts (as its SQLAlchemy type's values do).
        `columns`: an INSERT's (or UPDATE's) columns set from the binds of their names, as
        `Connection.execute` sets those its parameters name."""
        self.statement = statement
        self.binary = binary
        self.columns = None if columns is None else list(columns)
        self._compiled: dict[str, tuple[Binds, str]] = {}

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """Run with `params` on `conn` (in its transaction); the driver's cursor."""
        binds, sql = self._compiled_for(conn.dialect)
        return self._run(conn, sql, binds(params), False)

    def execute_many(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> Any:
        """Run once per row of `rows` (the driver's executemany); the driver's cursor."""
        binds, sql = self._compiled_for(conn.dialect)
        return self._run(conn, sql, [binds(r) for r in rows], True)

    def first(self, conn: Connection, params: Mapping[str, Any]) -> Sequence[Any] | None:
        """The first row (the driver's tuple) or None."""
        cursor = self.execute(conn, params)
        try:
            return cursor.fetchone()
        finally:
            cursor.close()

    def all(self, conn: Connection, params: Mapping[str, Any]) -> list[Sequence[Any]]:
        """Every row, as `first` runs it."""
        cursor = self.execute(conn, params)
        try:
            return cursor.fetchall()
        finally:
            cursor.close()

    def rowcount(self, conn: Connection, params: Mapping[str, Any]) -> int:
        """The rows a write changed."""
        cursor = self.execute(conn, params)
        try:
            return int(cursor.rowcount)
        finally:
            cursor.close()

    @staticmethod
    def _run(conn: Connection, sql: str, values: Any, many: bool) -> Any:
        cursor = conn.connection.driver_connection.cursor()
        events = conn._has_events or conn.engine._has_events
        try:
            if events:
                conn.dispatch.before_cursor_execute(conn, cursor, sql, values, None, many)
            if many:
                cursor.executemany(sql, values)
            else:
                cursor.execute(sql, values)
            if events:
                conn.dispatch.after_cursor_execute(conn, cursor, sql, values, None, many)
        except Exception as exc:
            conn._handle_dbapi_exception(exc, sql, values, cursor, None)
        return cursor

    def _compiled_for(self, dialect: Dialect) -> tuple[Binds, str]:
        got = self._compiled.get(dialect.name)
        if got is None:
            compiled = self.statement.compile(dialect=dialect, column_keys=self.columns)
            if compiled.insert_prefetch or compiled.update_prefetch:  # type: ignore[attr-defined]
                # (Python-side column defaults: only an execution context computes them.)
                raise ValueError("a DriverStatement must bind every column it writes")
            if compiled.literal_execute_params or compiled.post_compile_params:  # type: ignore[attr-defined]
                raise ValueError("a DriverStatement's binds must be plain values")
            # (SQLAlchemy's own map of the binds' type processors: private, stable in 2.x.)
            processors = {k: p for k, p in compiled._bind_processors.items() if p is not None}
            sql = compiled.string
            if self.binary and dialect.name == "postgresql":
                sql = _BINDS.sub(r"%(\1)b", sql)
            got = self._compiled[dialect.name] = (Binds(compiled, processors), sql)
        return got


class Binds:
    """A statement's parameters as the driver takes them: each bind's value (from the params
    by its key or name, else the value built into the statement) through its type's
    processor; a dict of the binds' names, or (a positional dialect: SQLite) a tuple in their
    order. What `Compiled.construct_params` and the processors do, planned once per statement
    instead of looked up per bind and row (for a batch's INSERT, per row)."""

    def __init__(self, compiled: Compiled, processors: dict[str, Any]) -> None:
        self.compiled, self.processors = compiled, processors
        escaped = getattr(compiled, "escaped_bind_names", None) or {}
        plan = {}
        for bind, name in compiled.bind_names.items():  # type: ignore[attr-defined]
            out = escaped.get(name, name)
            plan[out] = (bind.key, name, bind, processors.get(out))
        order = compiled.positiontup  # type: ignore[attr-defined]
        self._names = None if order is not None else list(plan)
        self._plan = [plan[k] for k in (order if order is not None else plan)]

    def __call__(self, params: Mapping[str, Any]) -> Any:
        values = []
        for key, name, bind, process in self._plan:
            if key in params:
                value = params[key]
            elif name in params:
                value = params[name]
            elif bind.required:
                raise InvalidRequestError(f"A value is required for bind parameter {key!r}")
            else:
                value = bind.effective_value if bind.callable else bind.value
            values.append(value if process is None else process(value))
        if self._names is None:
            return tuple(values)
        return dict(zip(self._names, values, strict=True))


# psycopg's named placeholders as SQLAlchemy renders them (a literal % is doubled: %%).
_BINDS = re.compile(r"(?<!%)%\((\w+)\)s")


def normalize_url(url: str | URL) -> URL:
    """Return the URL with PostgreSQL pinned to the psycopg 3 driver."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


# Longer than any transaction the daemon holds open, far shorter than a frozen node's pause.
PG_IDLE_IN_TRANSACTION_MS = 10_000


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """Create an engine; SQLite connections get WAL, foreign keys and a busy timeout."""
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        return _sqlite_engine(u, **kwargs)
    if u.get_backend_name() == "postgresql":
        # A node frozen mid-transaction (SIGSTOP, a paused VM) would hold its row locks, and
        # every other node's writes to those rows, for as long as it stays frozen: the server
        # ends such a session instead (the frozen node's late writes then fail and retry,
        # fenced like any other).
        options = f"-c idle_in_transaction_session_timeout={PG_IDLE_IN_TRANSACTION_MS}"
        args = {"options": options} | kwargs.pop("connect_args", {})
        # No pool_pre_ping: it costs a round trip per transaction. A connection lost (a
        # server restart) fails one transaction instead, which its caller retries as any
        # Unavailable, and the pool then replaces every connection older than the failure.
        engine = create_engine(u, connect_args=args, **kwargs)
        event.listen(engine, "before_cursor_execute", _binary_results)
        return engine
    raise ValueError(f"unsupported database URL {u.render_as_string(hide_password=True)!r}")


def _binary_results(_conn, cursor, _statement, _params, context, _many) -> None:  # noqa: ANN001
    if context is not None and context.execution_options.get(BINARY_RESULTS):
        from psycopg import pq

        cursor.format = pq.Format.BINARY


def _sqlite_engine(u: URL, **kwargs: Any) -> Engine:
    if u.database and u.database != ":memory:" and not u.database.startswith("file:"):
        Path(u.database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(u, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide when transactions begin (see _sqlite_begin).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL, much cheaper than FULL
        cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: Connection) -> None:
        # A deferred transaction that reads and then writes can fail with SQLITE_BUSY at once
        # (busy_timeout does not apply to lock upgrades); writers take the lock up front.
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


class WriteTurn:
    """This process's SQLite writers, one at a time. SQLite lets one writer in; another that
    finds the lock taken sleeps in its busy handler (1, 2, 5, 10 ms ... however soon the lock
    frees), so concurrent writers of one process queue here instead and each starts as soon
    as the one before ends. Other processes on the file still meet the busy handler. A turn
    not had within the busy timeout is skipped: the transaction then waits (or fails) in
    SQLite as it would without the turn, never here for ever."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a nested writer meets SQLite's lock

    @contextmanager
    def __call__(self) -> Iterator[None]:
        held = self._lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        try:
            yield
        finally:
            if held:
                self._lock.release()


@contextmanager
def scratch_postgres(admin_url: str, prefix: str, template: str = "") -> Iterator[str]:
    """A new, uniquely named database on the PostgreSQL server of `admin_url` (for tests and
    benchmarks); yields its SQLAlchemy URL and drops it afterwards (FORCE: a caller that
    failed mid-way may still hold connections). `template`: a copy of that database (no one
    may be connected to it), e.g. one migrated once instead of migrating each copy (~3 s).
    psycopg's errors reach the caller."""
    import psycopg

    admin = make_url(admin_url)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    copy = f' TEMPLATE "{make_url(template).database}"' if template else ""
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"{copy}')
    try:
        yield admin.set(drivername="postgresql+psycopg", database=name).render_as_string(
            hide_password=False
        )
    finally:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
