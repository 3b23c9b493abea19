"""Work units under leases: one per prompt of a request, claimed by a node with one
`FOR UPDATE SKIP LOCKED` statement, renewed while it runs, fenced by owner and epoch.

Expiry is read from the database's clock (`tltd.store.clock`). On SQLite (one node) the same
statements run: SKIP LOCKED is not rendered there, and SQLite serializes writers anyway.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Integer,
    Update,
    and_,
    bindparam,
    case,
    func,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session

from tltd.domain import (
    ENDED_STATUSES,
    FinishReason,
    Job,
    RequestProgress,
    RequestStatus,
    RolloutRequest,
    Sample,
)
from tltd.errors import Fenced, NotFound
from tltd.store import convert
from tltd.store.clock import db_now, db_now_bound, db_now_params
from tltd.store.database import BINARY_RESULTS, Database, DriverStatement
from tltd.store.lookups import active_versions
from tltd.store.notifications import REQUEST, WORK, notify
from tltd.store.status import switch_status, switch_status_from, switch_status_through
from tltd.store.tables import (
    JobRow,
    RolloutRequestRow,
    SampleRow,
    WorkUnitRow,
    utcnow,
)

UnitKey = tuple[str, int]  # (request_id, prompt_index)
# WorkLeases.claimed_state: request id -> (request, job, complete sample keys, partial sample keys).
ClaimedState = dict[str, tuple[RolloutRequest, Job, set[tuple[int, int]], set[tuple[int, int]]]]

QUEUED, LEASED, DONE, FAILED = "queued", "leased", "done", "failed"
# A bounded request's prompt parked at its bound: held by no node, claimed by none, until the
# job's next carried request queues it again (`RolloutRequests.admit`).
PARKED = "parked"
OPEN_STATES = (QUEUED, LEASED, PARKED)  # a unit not ended: its request has not ended

_RENEW_CHUNK = 500  # units per renewal statement (bound parameters stay well under limits)


@dataclass(frozen=True)
class UnitEnd:
    """A unit recorded done: its request's status and reason after it, and the request's
    units still open (0: the request ended with it)."""

    status: RequestStatus
    reason: str
    left: int


@dataclass(frozen=True, order=True)
class Claim:
    request_id: str
    prompt_index: int
    attempts: int  # this claim included


def held_bound(dialect: str) -> tuple[Any, ...]:
    """`WorkLeases._held` for a statement built once: executions pass "node", "epoch" (and
    "db_now" on SQLite, see `db_now_bound`)."""
    return _held_by(bindparam("node"), bindparam("epoch"), db_now_bound(dialect))


def _held_by(node: Any, epoch: Any, now: Any) -> tuple[Any, ...]:
    """A unit leased by `node` under `epoch` whose lease outlives `now` (values or binds)."""
    wu = WorkUnitRow.__table__
    return (
        wu.c.state == LEASED,
        wu.c.owner_node == node,
        wu.c.owner_epoch == epoch,
        wu.c.lease_expires_at > now,
    )


class _UnitStatements:
    """finish_unit's statements, built once per store (see sample_batches._Statements)."""

    def __init__(self, dialect: str) -> None:
        rr, wu, sr = RolloutRequestRow.__table__, WorkUnitRow.__table__, SampleRow.__table__
        # The request's row locked, and of it only what a unit's end needs (not its prompts).
        self.request = (
            select(rr.c.n, rr.c.status, rr.c.status_reason)
            .where(rr.c.request_id == bindparam("rid"))
            .with_for_update()
        )
        unit = (wu.c.request_id == bindparam("rid"), wu.c.prompt_index == bindparam("p"))
        self.stored = (
            select(func.count())
            .select_from(sr)
            .where(sr.c.request_id == bindparam("rid"), sr.c.prompt_index == bindparam("p"))
        )
        self.done = DriverStatement(self._done(dialect, unit, "n"))
        open_units = (
            select(func.count())
            .select_from(wu)
            # A bind per state, not one expanding list: that is rendered at every execution.
            .where(wu.c.request_id == bindparam("rid"), wu.c.state.in_(map(literal, OPEN_STATES)))
            .scalar_subquery()
        )
        all_units = (
            select(func.count())
            .select_from(wu)
            .where(wu.c.request_id == bindparam("rid"))
            .scalar_subquery()
        )
        # The request's open units, its failed samples, the first failure's error and all its
        # units, in one round trip.
        failed = (
            sr.c.request_id == bindparam("rid"),
            sr.c.finish_reason == FinishReason.FAILED.value,
        )
        self.open_and_failed = DriverStatement(
            select(open_units, func.count(), func.min(sr.c.error), all_units).where(*failed)
        )
        # (Its binds name no column of the tables it updates: an execution's parameter
        # named after a column would join their SET clauses. "need" stands for "n".)
        self.done_and_counts = None if dialect != "postgresql" else _done_and_counts(
            self._done(dialect, unit, "need"), open_units, all_units, failed
        )  # fmt: skip

    def _done(self, dialect: str, unit: tuple[Any, ...], need: str) -> Update:
        """The unit, held and with its `need` samples stored, recorded done."""
        wu = WorkUnitRow.__table__
        return (
            update(wu)
            .where(*unit, *held_bound(dialect), self.stored.scalar_subquery() >= bindparam(need))
            .values(state=DONE, lease_expires_at=None, updated_at=bindparam("now"))
            .returning(wu.c.prompt_index)
        )


def _done_and_counts(
    done_stmt: Any, open_units: Any, all_units: Any, failed: Any
) -> DriverStatement:
    """PostgreSQL: `done` and `open_and_failed` in one statement, (units ended, open units
    left, failed samples, first error, units). The UPDATE runs in a CTE, whose change the outer
    query does not see: the unit it ended (open before) is taken off the open count. A sample
    batch's bump of the request's samples_done ("bump" > 0, else nothing) rides along."""
    rr, sr = RolloutRequestRow.__table__, SampleRow.__table__
    done = done_stmt.cte("done")
    ended = select(func.count()).select_from(done).scalar_subquery()
    bump = bindparam("bump", type_=Integer())
    bumped = (
        update(rr)
        .where(rr.c.request_id == bindparam("rid"), bump > 0)
        .values(samples_done=rr.c.samples_done + bump, updated_at=bindparam("bumped_at"))
        .cte("bumped")
    )
    return DriverStatement(
        select(ended, open_units - ended, func.count(), func.min(sr.c.error), all_units)
        .where(*failed)
        .add_cte(bumped)
    )


class WorkLeases:
    """Work units under leases, and the state of the requests they belong to: the rows every
    node claims from, fenced by owner and epoch (one node's side of them:
    `tltd.supervisor.lease_keeper.LeaseKeeper`)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    @functools.cached_property
    def _unit_statements(self) -> _UnitStatements:
        return _UnitStatements(self.db.dialect)

    @property
    def bumps_with_end(self) -> bool:
        """Whether `end_unit_if_complete` takes a sample batch's bump (PostgreSQL)."""
        return self._unit_statements.done_and_counts is not None

    def held(self, s: Session) -> object:
        """The condition of a unit this node holds now: its owner and epoch, lease alive."""
        return and_(*_held_by(self.db.node_id, self.db.epoch, db_now(self.db.dialect)))

    def claim_units(
        self, capacity: int, lease_seconds: float, affinity_seconds: float = 0.0
    ) -> list[Claim]:
        """Claim queued units, and units whose lease expired, oldest first, while the samples
        of those claimed before each one stay under `capacity`: one statement. Rows another
        node is claiming at the same moment are skipped, not waited for. A unit that prefers
        another node (a session's turn, whose KV that node holds) is left to it for
        `affinity_seconds` after its creation (by the creating node's clock)."""
        if capacity <= 0 or not self.db.epoch:
            return []
        wu = WorkUnitRow
        claimable = self._claimable(affinity_seconds)
        order = (wu.priority.desc(), wu.created_at, wu.request_id, wu.prompt_index)
        # Each unit holds at least one sample: `capacity` rows bound what can fit.
        cand = (
            select(wu.request_id, wu.prompt_index, wu.samples, wu.priority, wu.created_at)
            .where(claimable)
            .order_by(*order)
            .limit(capacity)
            .with_for_update(skip_locked=True)
            .cte("cand")
        )
        before = (
            func.sum(cand.c.samples).over(
                order_by=(
                    cand.c.priority.desc(),
                    cand.c.created_at,
                    cand.c.request_id,
                    cand.c.prompt_index,
                )
            )
            - cand.c.samples
        )
        ranked = select(cand.c.request_id, cand.c.prompt_index, before.label("before")).subquery(
            "ranked"
        )
        picked = (
            select(ranked.c.request_id, ranked.c.prompt_index)
            .where(ranked.c.before < capacity)
            .subquery("picked")
        )
        stmt = (
            update(wu)
            .where(wu.request_id == picked.c.request_id, wu.prompt_index == picked.c.prompt_index)
            .values(
                state=LEASED,
                owner_node=self.db.node_id,
                owner_epoch=self.db.epoch,
                lease_expires_at=db_now(self.db.dialect, lease_seconds),
                attempts=wu.attempts + 1,
                updated_at=utcnow(),
            )
            .returning(wu.request_id, wu.prompt_index, wu.attempts)
        )
        with self.db.tx() as s:
            rows = s.execute(stmt).all()
        return sorted(Claim(r[0], int(r[1]), int(r[2])) for r in rows)

    def _claimable(self, affinity_seconds: float) -> Any:
        """A unit this node may claim now: queued, or its lease expired; one preferring
        another node only once `affinity_seconds` have passed since its creation."""
        wu, now = WorkUnitRow, db_now(self.db.dialect)
        claimable = or_(wu.state == QUEUED, and_(wu.state == LEASED, wu.lease_expires_at < now))
        if affinity_seconds <= 0:
            return claimable
        return and_(claimable, or_(
            wu.preferred_node.is_(None),
            wu.preferred_node == self.db.node_id,
            wu.created_at < db_now(self.db.dialect, -affinity_seconds),
        ))  # fmt: skip

    def renew(self, units: Collection[UnitKey], lease_seconds: float) -> set[UnitKey]:
        """Extend the leases of `units` (those this node runs) that it still holds; returns
        the units renewed (one of `units` not among them is lost: stop running it).

        Only the units named are renewed: a unit leased to this node that it does not run (a
        claim whose answer was lost, or whose request could not be read, while the database
        was unreachable) must not be kept alive forever; its lease lapses and it is claimed
        again."""
        wu = WorkUnitRow
        keys = sorted(set(units))
        renewed: set[UnitKey] = set()
        if not keys:
            return renewed
        with self.db.tx() as s:
            for i in range(0, len(keys), _RENEW_CHUNK):
                chunk = tuple_(wu.request_id, wu.prompt_index).in_(keys[i : i + _RENEW_CHUNK])
                if self.db.dialect == "postgresql":
                    # Lock in key order first, the order a sample batch ends units in: an
                    # UPDATE locks in scan order, and two orders deadlock.
                    s.execute(
                        select(wu.request_id)
                        .where(chunk)
                        .order_by(wu.request_id, wu.prompt_index)
                        .with_for_update()
                    ).all()
                rows = s.execute(
                    update(wu)
                    .where(chunk)
                    .where(self.held(s))
                    .values(lease_expires_at=db_now(self.db.dialect, lease_seconds))
                    .returning(wu.request_id, wu.prompt_index)
                ).all()
                renewed |= {(r[0], int(r[1])) for r in rows}
        return renewed

    def release_stale(self) -> int:
        """Units this node holds under an older epoch (a previous process, or this one before
        it was taken for DOWN) go back to the queue; returns how many. A request of theirs
        that then runs nowhere goes back to QUEUED, with the reason."""
        wu = WorkUnitRow
        with self.db.tx() as s:
            rows = s.execute(
                update(wu)
                .where(
                    wu.state == LEASED,
                    wu.owner_node == self.db.node_id,
                    wu.owner_epoch < self.db.epoch,
                )
                .values(state=QUEUED, owner_node=None, lease_expires_at=None, updated_at=utcnow())
                .returning(wu.request_id)
            ).all()
            released = Counter(r[0] for r in rows)
            for rid, units in sorted(released.items()):
                req = s.get(RolloutRequestRow, rid, with_for_update=True)
                running = s.scalar(
                    select(func.count())
                    .select_from(wu)
                    .where(wu.request_id == rid, wu.state == LEASED)
                )
                notify(s, WORK, rid)
                if req is not None and req.status == RequestStatus.RUNNING and not running:
                    why = f"daemon restarted: {units} units of node {self.db.node_id} re-queued"
                    switch_status(s, "request", rid, req, RequestStatus.QUEUED, why)
            return len(rows)

    def release_unit(self, request_id: str, prompt_index: int) -> bool:
        """Give a unit this node holds back to the queue (its samples stored so far stay).
        Given back, not lost: its claim does not count toward `max_sample_attempts`."""
        return self._give_up(request_id, prompt_index, QUEUED)

    def park_unit(self, request_id: str, prompt_index: int) -> bool:
        """Park a unit this node holds (a bounded request's bound was reached): its samples
        stored so far stay, paused ones among them; no node claims it until the job's next
        carried request queues it again. Not a lost claim (as `release_unit`)."""
        return self._give_up(request_id, prompt_index, PARKED)

    def _give_up(self, request_id: str, prompt_index: int, state: str) -> bool:
        """A held unit to `state`, no node's, its claim not counted; False if not held."""
        wu = WorkUnitRow
        with self.db.tx() as s:
            result = s.execute(
                update(wu)
                .where(wu.request_id == request_id, wu.prompt_index == prompt_index)
                .where(self.held(s))
                .values(
                    state=state,
                    owner_node=None,
                    lease_expires_at=None,
                    attempts=wu.attempts - 1,
                    updated_at=utcnow(),
                )
            )
            if result.rowcount and state == QUEUED:  # type: ignore[attr-defined]
                notify(s, WORK, request_id)
            return bool(result.rowcount)  # type: ignore[attr-defined]

    def check_held(self, s: Session, request_id: str, prompt_index: int) -> None:
        """Raise Fenced unless this node holds the unit (called with the request row locked:
        a sample write then lands only while the lease is alive)."""
        wu = WorkUnitRow
        held = s.scalar(
            select(wu.prompt_index).where(
                wu.request_id == request_id, wu.prompt_index == prompt_index, self.held(s)
            )
        )
        if held is None:
            raise Fenced(
                f"unit {request_id}/{prompt_index} is not held by node {self.db.node_id!r} "
                f"epoch {self.db.epoch}"
            )

    def finish_unit(
        self, request_id: str, prompt_index: int, outcome: RequestStatus | None, reason: str
    ) -> UnitEnd:
        """Mark a held unit done once every one of its samples is stored; when it was the
        request's last open unit, record the request's final status: `outcome` (a cancel or a
        drain decided here) if given, else FAILED when a sample failed, else COMPLETED; a
        status already final stands. Returns the request's status and reason after it and its
        open units left. Raises Fenced when the unit is not held or a sample is missing."""
        st = self._unit_statements
        with self.db.tx() as s:
            conn = s.connection()
            row = conn.execute(st.request, {"rid": request_id}).first()
            if row is None:
                raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
            params = self._unit_params(request_id, prompt_index, row.n)
            # Held, every sample stored, and done: one statement (the usual case); only a
            # refusal reads again, to say why.
            if st.done.first(conn, params) is None:
                self.check_held(s, request_id, prompt_index)
                count = conn.execute(st.stored, params).scalar()
                raise Fenced(f"unit {request_id}/{prompt_index}: {count} of {row.n} stored")
            status = RequestStatus(row.status)
            return self._close_unit(s, params, status, row.status_reason, outcome, reason)

    def _unit_params(self, request_id: str, prompt_index: int, n: int) -> dict[str, Any]:
        """The bound values of `_UnitStatements` for one unit of a request of `n` samples."""
        return {"rid": request_id, "p": prompt_index, "node": self.db.node_id,
                "epoch": self.db.epoch, "n": n, "now": utcnow(),
                **db_now_params(self.db.dialect)}  # fmt: skip

    def end_unit_if_complete(
        self, s: Session, request_id: str, prompt_index: int, n: int, status: RequestStatus,
        reason: str, started: str = "", bump: tuple[int, datetime] | None = None,
    ) -> UnitEnd | None:  # fmt: skip
        """In a sample batch's transaction: the unit is done when it is held and every sample
        of it is stored (`finish_unit` with no outcome decided here); None when not.
        `started`: the request, QUEUED in the store, is RUNNING for that reason (passed as
        `status`), its start not written yet: written with its end when this ends it.
        `bump` (PostgreSQL, `bumps_with_end`): the batch's completed samples added to the
        request's samples_done, and its updated_at, in the same statement, ended or not."""
        st, params = self._unit_statements, self._unit_params(request_id, prompt_index, n)
        if st.done_and_counts is not None:  # PostgreSQL: its end and the counts, one statement
            bumped = dict(zip(("bump", "bumped_at"), bump or (0, None), strict=True))
            unit = {k: v for k, v in params.items() if k != "n"} | {"need": n}
            row = st.done_and_counts.first(s.connection(), unit | bumped)
            assert row is not None  # (an aggregate: one row)
            if not row[0]:
                return None
            return self._close_unit(s, params, status, reason, None, "", started, row[1:])
        assert not bump, "a bump rides along on PostgreSQL only"
        if st.done.first(s.connection(), params) is None:
            return None
        return self._close_unit(s, params, status, reason, None, "", started)

    def _close_unit(
        self,
        s: Session,
        params: dict[str, Any],
        status: RequestStatus,
        reason: str,
        outcome: RequestStatus | None,
        why: str,
        started: str = "",
        counts: Sequence[Any] | None = None,
    ) -> UnitEnd:
        """A unit was just recorded done: the request's open units left and, when none is,
        its final status (see `finish_unit`) recorded. `status` and `reason` are the
        request's as read in this transaction (`started`: see `end_unit_if_complete`);
        `counts`: `open_and_failed`'s row when read already."""
        st, conn, rid = self._unit_statements, s.connection(), params["rid"]
        if counts is None:
            counts = st.open_and_failed.first(conn, params)
            assert counts is not None  # (an aggregate: one row)
        left, failed, first_error, units = counts
        if left == 0 and status not in ENDED_STATUSES:
            new = outcome
            if new is None:
                total = int(units or 0) * int(params["n"])
                new, why = _final_status(total, failed, first_error)
            old = status
            if started:  # its start and its end: one statement (with the notification)
                steps = [(RequestStatus.RUNNING, started), (new, why)]
                switch_status_through(s, "request", RolloutRequestRow, rid, RequestStatus.QUEUED,
                                      steps, REQUEST)  # fmt: skip
                return UnitEnd(new, why, int(left))
            if old is RequestStatus.QUEUED and new is RequestStatus.COMPLETED:
                switch_status_from(s, "request", RolloutRequestRow, rid, old,
                                   RequestStatus.RUNNING, "resumed")  # fmt: skip
                old = RequestStatus.RUNNING
            switch_status_from(s, "request", RolloutRequestRow, rid, old, new, why, REQUEST)
            status, reason = new, why
        return UnitEnd(status, reason, int(left))

    def end_queued_units(self, request_id: str, finish: FinishReason, why: str) -> int:
        """End the units of an ended request that no node holds (a cancel): their missing
        samples stored partial with `why`, the units done. Units held by a node are ended by
        it (or, if it is lost, by whichever node claims them next). Returns units ended."""
        wu, sr = WorkUnitRow, SampleRow
        with self.db.tx() as s:
            req = s.get(RolloutRequestRow, request_id, with_for_update=True)
            if req is None:
                raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
            now = db_now(self.db.dialect)
            free = or_(
                wu.state.in_((QUEUED, PARKED)), and_(wu.state == LEASED, wu.lease_expires_at < now)
            )
            prompts = s.scalars(
                select(wu.prompt_index)
                .where(wu.request_id == request_id, free)
                .with_for_update(skip_locked=True)
            ).all()
            if not prompts:
                return 0
            have = set(
                s.execute(
                    select(sr.prompt_index, sr.sample_index).where(
                        sr.request_id == request_id, sr.prompt_index.in_(prompts)
                    )
                ).all()
            )
            stamp = utcnow()
            for p in prompts:
                for i in range(req.n):
                    if (p, i) not in have:
                        row = convert.sample_to_row(
                            Sample(
                                request_id, p, i, (), (), finish,
                                policy_version=req.policy_version, partial=True, error=why,
                            )
                        )  # fmt: skip
                        row.created_at = stamp
                        s.add(row)
            s.execute(
                update(wu)
                .where(wu.request_id == request_id, wu.prompt_index.in_(prompts))
                .values(state=DONE, owner_node=None, lease_expires_at=None, updated_at=stamp)
            )
            return len(prompts)

    def stream_state(
        self, request_id: str, after_id: int
    ) -> tuple[RequestProgress, int, list[Sample], int]:
        """What a Generate stream on any node reads: the request's progress, its open units,
        the samples stored after row `after_id` and the largest row id seen. Every prompt has
        a work unit, so the units give the sample total: the prompts are not read."""
        rr, wu = RolloutRequestRow, WorkUnitRow
        with self.db.tx(write=False) as s:
            head = s.execute(
                select(rr.status, rr.status_reason, rr.n).where(rr.request_id == request_id)
            ).first()
            if head is None:
                raise NotFound(f"rollout request {request_id!r} not found", field="request_id")
            is_open = case((wu.state.in_(OPEN_STATES), 1), else_=0)
            units, open_units = s.execute(
                select(func.count(), func.coalesce(func.sum(is_open), 0)).where(
                    wu.request_id == request_id
                )
            ).one()
            rows = s.execute(
                select(SampleRow.__table__)  # rows, not ORM objects: read once, never changed
                .where(SampleRow.request_id == request_id, SampleRow.id > after_id)
                .order_by(SampleRow.id),
                execution_options={BINARY_RESULTS: True},
            ).all()
            last = max((r.id for r in rows), default=after_id)
            progress = RequestProgress(
                RequestStatus(head.status), head.status_reason, int(units) * int(head.n)
            )
            return progress, int(open_units), [convert.sample_from_row(r) for r in rows], last

    def claimed_state(self, request_ids: Sequence[str]) -> ClaimedState:
        """What a node needs to run units it just claimed, for every request named, in one
        read: the request, its job, and the keys (prompt index, sample index) of its stored
        samples, complete ones and partial ones (the payloads are not read). A request not
        found is left out."""
        rr, sr = RolloutRequestRow, SampleRow
        ids = sorted(set(request_ids))
        if not ids:
            return {}
        with self.db.tx(write=False) as s:
            reqs = {r.request_id: r for r in s.scalars(select(rr).where(rr.request_id.in_(ids)))}
            keys: dict[str, tuple[set, set]] = {rid: (set(), set()) for rid in reqs}
            for rid, p, i, partial in s.execute(
                select(sr.request_id, sr.prompt_index, sr.sample_index, sr.partial).where(
                    sr.request_id.in_(list(reqs))
                )
            ).all():
                keys[rid][1 if partial else 0].add((int(p), int(i)))
            job_ids = sorted({r.job_id for r in reqs.values()})
            jobs = {
                j.job_id: j for j in s.scalars(select(JobRow).where(JobRow.job_id.in_(job_ids)))
            }
            active = active_versions(s, job_ids)
            return {
                rid: (
                    convert.request_from_row(row),
                    convert.job_from_row(jobs[row.job_id], active[row.job_id]),
                    *keys[rid],
                )
                for rid, row in reqs.items()
            }

    def request_statuses(self, request_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
        """status and reason of each request (the renew loop's view of cancels elsewhere)."""
        if not request_ids:
            return {}
        rr = RolloutRequestRow
        with self.db.tx(write=False) as s:
            rows = s.execute(
                select(rr.request_id, rr.status, rr.status_reason).where(
                    rr.request_id.in_(list(request_ids))
                )
            ).all()
        return {r[0]: (r[1], r[2]) for r in rows}


def _final_status(total: int, failed: int, first_error: str | None) -> tuple[RequestStatus, str]:
    if failed:
        return RequestStatus.FAILED, f"{failed} of {total} samples failed: {first_error}"
    return RequestStatus.COMPLETED, f"all {total} samples finished"
