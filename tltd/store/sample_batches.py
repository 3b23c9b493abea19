"""Group-committed sample writes: every sample a worker reported at once, in one transaction.

The rules are `store.samples.add`'s (`tltd.store.samples`), sample by sample (idempotent on
the sample's key, a partial sample replaced as `samples.replaces` says, nothing replaced once
the request ended, leases fence every write); only the transaction is shared. Each request
row is locked once (in request id order, so two writers never wait on each other crosswise)
and its units (held ones on a joined node) and stored keys are read with one statement each.
A key's prompt index is checked against the request's work units, one per prompt, not
against its prompts: those are read, and their JSON decoded, only to word the error for an
index out of range (a 512-prompt request's prompts took ~10 ms of CPU to decode, in every
transaction).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ARRAY, Integer, Row, any_, bindparam, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tltd.domain import ENDED_STATUSES, RequestStatus, Sample
from tltd.errors import Fenced, NotFound, TltError
from tltd.store import convert
from tltd.store.clock import db_now_params
from tltd.store.database import Database, DriverStatement
from tltd.store.leases import UnitEnd, WorkLeases, held_bound
from tltd.store.notifications import SAMPLE, notify
from tltd.store.rollout_requests import running_on
from tltd.store.samples import SampleRecords, not_finite_error, out_of_range_error, replaces
from tltd.store.status import switch_status_from
from tltd.store.tables import RolloutRequestRow, SampleRow, WorkUnitRow, utcnow

# Prompt indices at or past this are out of range of any request (and of SQL integers).
_MAX_INDEX = 1 << 31

# What `add` says of each sample: stored (True), a duplicate (False), or why not.
Outcome = bool | TltError


@dataclass
class StoredBatch:
    """`store`'s answer: per sample its `Outcome`; per unit a sample of the batch
    completed, the unit's end recorded in the same transaction."""

    outcomes: list[Outcome]
    ends: dict[tuple[str, int], UnitEnd] = field(default_factory=dict)


class _Statements:
    """The batch path's statements, built once per store: constructing and cache-keying an
    SQL expression costs more Python than running it does (the database's clock is a bound
    value on SQLite, `now()` on PostgreSQL)."""

    def __init__(self, dialect: str) -> None:
        rr, wu, sr = RolloutRequestRow.__table__, WorkUnitRow.__table__, SampleRow.__table__
        rid = bindparam("rid")
        self.head = DriverStatement(
            select(rr.c.n, rr.c.status, rr.c.status_reason)
            .where(rr.c.request_id == rid)
            .with_for_update()
        )
        # The units written into and, in the same round trip, their samples stored (a unit
        # without any: one row of NULL sample columns); of the prompts bound (`units_of`).
        self._dialect = dialect
        self._units = (
            select(
                wu.c.prompt_index,
                sr.c.id,
                sr.c.sample_index,
                sr.c.partial,
                sr.c.finish_reason,
                sr.c.num_tokens,
            )
            .select_from(
                wu.outerjoin(
                    sr,
                    (sr.c.request_id == wu.c.request_id) & (sr.c.prompt_index == wu.c.prompt_index),
                )
            )
            .where(wu.c.request_id == rid)
        )
        self._units_of: dict[tuple[bool, int], DriverStatement] = {}
        self.insert = sr.insert()
        # The INSERT of rows of these columns (`SampleBatches._insert`).
        self.inserts: dict[tuple[str, ...], DriverStatement] = {}
        self.bump = DriverStatement(
            update(rr)
            .where(rr.c.request_id == rid)
            .values(samples_done=rr.c.samples_done + bindparam("done"), updated_at=bindparam("now"))
        )

    def units_of(self, held: bool, prompts: list[int]) -> tuple[DriverStatement, dict[str, Any]]:
        """The statement that reads the units of `prompts` (with `held`, those held: binds as
        `held_bound`), and the binds of `prompts`: on PostgreSQL `= ANY` of one array; on
        SQLite an IN list of a bind per prompt (p0, p1, ...: the plan of a list of values,
        the request's key index), built once per power of two of them, the last prompt
        repeated to fill it."""
        if self._dialect == "postgresql":
            size, params = 0, {"prompts": prompts}
        else:
            size = len(prompts) if len(prompts) > 1024 else 1 << (len(prompts) - 1).bit_length()
            filled = prompts + prompts[-1:] * (size - len(prompts))
            params = {f"p{i}": p for i, p in enumerate(filled)}
        statement = self._units_of.get((held, size))
        if statement is None:
            wu = WorkUnitRow.__table__
            if self._dialect == "postgresql":
                given = wu.c.prompt_index == any_(bindparam("prompts", type_=ARRAY(Integer())))
            else:
                given = wu.c.prompt_index.in_(
                    [bindparam(f"p{i}", type_=Integer()) for i in range(size)]
                )
            query = self._units.where(given)
            if held:
                query = query.where(*held_bound(self._dialect))
            statement = self._units_of[(held, size)] = DriverStatement(query)
        return statement, params


class SampleBatches:
    """A worker's samples written in one transaction."""

    def __init__(self, db: Database, samples: SampleRecords, leases: WorkLeases) -> None:
        self.db = db
        self.samples = samples
        self.leases = leases

    @functools.cached_property
    def _batch_statements(self) -> _Statements:
        return _Statements(self.db.dialect)

    def add(self, samples: Sequence[Sample]) -> list[Outcome]:
        """Store `samples` in one transaction; per sample what `SampleRecords.add` would return
        (True stored, False a duplicate), or the error it would raise (InvalidArgument,
        NotFound, Fenced) for that sample alone. A database error raises for all of them:
        none is stored."""
        return self.store(samples).outcomes

    def store(
        self, samples: Sequence[Sample], end_units: bool = False, worker_id: str = ""
    ) -> StoredBatch:
        """`add`; with `end_units`, a held unit whose samples are now all stored and
        complete is also recorded done in the same transaction (with the request's final
        status when it was its last open unit), as `finish_unit` would with no outcome
        decided on the node: one transaction less per unit. A request still QUEUED (its
        start, `mark_running`, not written yet) is started first, as run by `worker_id`;
        without one its units are left to the node."""
        out: list[Outcome | None] = [None] * len(samples)
        ends: dict[tuple[str, int], UnitEnd] = {}
        by_request: dict[str, list[int]] = {}
        for i, sample in enumerate(samples):
            bad = not_finite_error(sample)
            if bad is not None:
                out[i] = bad
            else:
                by_request.setdefault(sample.request_id, []).append(i)
        if not by_request:
            return StoredBatch(out)  # type: ignore[arg-type]
        try:
            with self.db.tx() as s:
                now = utcnow()
                for rid in sorted(by_request):
                    items = [(i, samples[i]) for i in by_request[rid]]
                    self._add_to_request(
                        s, rid, items, out, now, ends if end_units else None, worker_id
                    )
        except IntegrityError:
            # Only a concurrent insert of one of these keys gets here (see `SampleRecords.add`): the
            # batch rolled back; each sample alone then says which were stored elsewhere.
            outcomes = [
                o if o is not None else self._one(x) for x, o in zip(samples, out, strict=True)
            ]
            return StoredBatch(outcomes)
        return StoredBatch(out, ends)  # type: ignore[arg-type]

    def _one(self, sample: Sample) -> Outcome:
        try:
            return self.samples.add(sample)
        except TltError as exc:
            return exc

    def _add_to_request(
        self,
        s: Session,
        rid: str,
        items: list[tuple[int, Sample]],
        out: list[Outcome | None],
        now: datetime,
        ends: dict[tuple[str, int], UnitEnd] | None,
        worker_id: str = "",
    ) -> None:
        st, conn = self._batch_statements, s.connection()
        # The columns needed, not the row: its prompts (JSON, as long as the request's
        # prompts) are decoded only when a sample's prompt index must be checked against them.
        head = st.head.first(conn, {"rid": rid})
        if head is None:
            for i, _ in items:
                out[i] = NotFound(f"rollout request {rid!r} not found", field="request_id")
            return
        n, status = int(head[0]), RequestStatus(head[1])
        ok, units = self._writable(s, rid, n, items, out)
        if not ok:
            return
        stored, complete = _stored_keys(units, [x for _, x in ok])
        ended = RequestStatus(status) in ENDED_STATUSES
        sr = SampleRow
        rows, done = [], 0
        for i, sample in ok:
            key = (sample.prompt_index, sample.sample_index)
            existing = stored.get(key)
            if existing is not None and (
                ended or not replaces(existing[1], existing[2], sample, existing[3])
            ):
                out[i] = False  # a duplicate, or a replacement too late (see `SampleRecords.add`)
                continue
            row = convert.sample_columns(sample)
            row["created_at"] = now
            if existing is not None:
                # The complete sample that replaces a partial one takes a new, larger row id,
                # as `SampleRecords.add` explains.
                conn.execute(sr.__table__.delete().where(sr.id == existing[0]))
                if self.db.dialect == "sqlite":
                    row["id"] = int(conn.scalar(select(func.max(sr.id))) or 0) + 1
                conn.execute(st.insert, [row])
            else:
                rows.append(row)
            stored[key] = (0, sample.partial, sample.finish_reason, len(sample.token_ids))
            done += not sample.partial
            complete[key[0]] += not sample.partial
            out[i] = True
        self._insert(conn, rows)
        ending = [] if ends is None else _completed(ok, out, n, complete)
        bump = self._bump(
            conn, rid, done, bool(rows), now, bool(ending) and _runs(status, worker_id)
        )
        if self._end_units(s, rid, ending, n, status, head[2], ends, done, worker_id, bump):
            return  # the request ended: its notification wakes the other nodes' streams
        if done or rows:
            notify(s, SAMPLE, rid)

    def _insert(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """The batch's new rows on the driver's cursor: on PostgreSQL in one INSERT, from an
        array per column (`_unnest_insert`: one short statement whatever the row count, which
        psycopg parses once; a multi-row VALUES list is parsed again at each execution),
        elsewhere an INSERT per row (the driver's executemany, one compiled statement)."""
        if not rows:
            return
        postgresql = self.db.dialect == "postgresql"
        columns = tuple(rows[0])
        statement = self._batch_statements.inserts.get(columns)
        if statement is None:
            statement = _unnest_insert(columns) if postgresql else _rows_insert(columns)
            self._batch_statements.inserts[columns] = statement
        if postgresql:
            params = {k: [row[k] for row in rows] for k in columns}
            statement.execute(conn, params).close()
        else:
            statement.execute_many(conn, rows).close()

    def _bump(
        self, conn: Connection, rid: str, done: int, wrote: bool, now: datetime, ends_units: bool
    ) -> tuple[int, datetime] | None:
        """The request's samples_done moved by `done` (and its updated_at) when the batch
        wrote: on PostgreSQL, when a unit ends, by that end's statement (one statement less:
        returned for `_end_units`), else here."""
        if ends_units and self.leases.bumps_with_end:
            return done, now
        if done or wrote:
            bumped = {"rid": rid, "done": done, "now": now}
            self._batch_statements.bump.execute(conn, bumped).close()
        return None

    def _end_units(
        self,
        s: Session,
        rid: str,
        ending: list[int],
        n: int,
        status: RequestStatus,
        reason: str,
        ends: dict[tuple[str, int], UnitEnd] | None,
        done: int,
        worker_id: str,
        bump: tuple[int, datetime] | None,
    ) -> bool:
        """With `ends`, the units these samples completed (`ending`) recorded done (see
        `store`), the first with `bump` (`WorkLeases.end_unit_if_complete`); True when that
        ended the request."""
        if ends is None or not done:
            return False
        started = ""
        if status is RequestStatus.QUEUED and worker_id:  # as mark_running would record it
            # Written with the request's end when these samples end it (one statement less),
            # else below. The row is locked: it is QUEUED until this transaction moves it.
            started = reason = running_on(worker_id)
            status = RequestStatus.RUNNING
        if status is not RequestStatus.RUNNING:
            return False
        for p in ending:
            end = self.leases.end_unit_if_complete(s, rid, p, n, status, reason, started, bump)
            bump = None
            if end is not None:
                ends[(rid, p)] = end
                if end.status is not RequestStatus.RUNNING:
                    started = ""  # written with the end
                status, reason = end.status, end.reason
        if started:
            switch_status_from(s, "request", RolloutRequestRow, rid, RequestStatus.QUEUED,
                               RequestStatus.RUNNING, started)  # fmt: skip
        return status in ENDED_STATUSES

    def _writable(
        self,
        s: Session,
        rid: str,
        n: int,
        items: list[tuple[int, Sample]],
        out: list[Outcome | None],
    ) -> tuple[list[tuple[int, Sample]], list[Row]]:
        """Those of `items` this node may write into request `rid` (`n` samples per prompt):
        keys in range and, on a joined node, units it holds; `out` says why of the others.
        Every prompt has a work unit, so a sample's prompt index is in range when its unit
        exists (held, on a joined node): the request's prompts are read only for a sample
        without one, for the error's wording. Also the writable units' rows (`_Statements`)."""
        units: list[Row] = []
        plausible = {x.prompt_index for _, x in items if 0 <= x.prompt_index < _MAX_INDEX}
        if plausible:
            units = self._writable_units(s, rid, plausible)
        writable = {int(r[0]) for r in units}
        prompts: int | None = None
        ok = []
        for i, sample in items:
            if sample.prompt_index in writable:
                bad = out_of_range_error(sample, sample.prompt_index + 1, n)
            else:
                if prompts is None:
                    prompts = _prompt_count(s, rid)
                bad = out_of_range_error(sample, prompts, n)
                if bad is None and self.db.epoch:
                    bad = Fenced(
                        f"unit {rid}/{sample.prompt_index} is not held by node "
                        f"{self.db.node_id!r} epoch {self.db.epoch}"
                    )
            if bad is not None:
                out[i] = bad
            else:
                ok.append((i, sample))
        return ok, units

    def _writable_units(self, s: Session, rid: str, prompts: set[int]) -> list[Row]:
        """Of `prompts`, the units of `rid` this node may write, with their stored samples
        (`_Statements`): those it holds on a joined node (a joined node writes only into
        units it holds), every one that exists on a node alone."""
        statement, params = self._batch_statements.units_of(bool(self.db.epoch), sorted(prompts))
        params["rid"] = rid
        if self.db.epoch:
            owner = {"node": self.db.node_id, "epoch": self.db.epoch}
            params |= owner | db_now_params(self.db.dialect)
        return statement.all(s.connection(), params)


def _unnest_insert(columns: tuple[str, ...]) -> DriverStatement:
    """INSERT INTO samples (<columns>) SELECT * FROM unnest(<an array bind per column, named
    after it>) (PostgreSQL): the arrays' items go through the columns' own type processors,
    and are sent in the binary format (packed token ids and logprobs as they are, not as
    escaped text)."""
    c = SampleRow.__table__.c
    # One dimension: a JSON value that is itself a list (token ids beyond int32) is one item.
    arrays = [bindparam(k, type_=ARRAY(c[k].type, dimensions=1)) for k in columns]
    rows = func.unnest(*arrays).table_valued(*columns).render_derived(name="given")
    insert = SampleRow.__table__.insert().from_select(
        [c[k] for k in columns], select(*(rows.c[k] for k in columns))
    )
    return DriverStatement(insert, binary=True)


def _rows_insert(columns: tuple[str, ...]) -> DriverStatement:
    """INSERT INTO samples (<columns>) VALUES (<a bind per column, named after it>), run
    once per row (SQLite)."""
    return DriverStatement(SampleRow.__table__.insert(), columns=columns)


def _completed(
    ok: list[tuple[int, Sample]], out: list[Outcome | None], n: int, complete: Counter[int]
) -> list[int]:
    """The prompts whose units the stored, complete samples of `ok` completed: `n` complete
    samples stored now."""
    stored = {x.prompt_index for i, x in ok if out[i] is True and not x.partial}
    return [p for p in sorted(stored) if complete[p] == n]


def _runs(status: RequestStatus, worker_id: str) -> bool:
    """Whether `_end_units` records unit ends of a request in `status`: RUNNING, or QUEUED
    with its start not written yet and `worker_id` running it."""
    return status is RequestStatus.RUNNING or (status is RequestStatus.QUEUED and bool(worker_id))


def _prompt_count(s: Session, rid: str) -> int:
    rr = RolloutRequestRow
    return len(s.scalar(select(rr.prompts).where(rr.request_id == rid)) or ())


def _stored_keys(
    units: list[Row], samples: list[Sample]
) -> tuple[dict[tuple[int, int], tuple[int, bool, str, int]], Counter[int]]:
    """(prompt index, sample index) -> (row id, partial, finish reason, tokens) of those of
    `samples` stored, and the complete samples stored per prompt of `samples`, from their
    units' rows (`_Statements`)."""
    keys = {(x.prompt_index, x.sample_index) for x in samples}
    prompts = {p for p, _ in keys}
    stored, complete = {}, Counter[int]()
    for r in units:
        p = int(r[0])
        if r[1] is None or p not in prompts:
            continue
        i, partial = int(r[2]), bool(r[3])
        complete[p] += not partial
        if (p, i) in keys:
            stored[(p, i)] = (int(r[1]), partial, str(r[4]), int(r[5]))
    return stored, complete
