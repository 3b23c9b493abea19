"""Rollout requests: queued with one work unit per prompt, idempotent on request id, moved
through their statuses."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ARRAY,
    CTE,
    BigInteger,
    BindParameter,
    Boolean,
    Integer,
    Select,
    String,
    Table,
    bindparam,
    case,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tltd.domain import JobStatus, RequestStatus, RolloutRequest
from tltd.errors import AlreadyExists, FailedPrecondition, NotFound
from tltd.store import convert
from tltd.store.clock import db_later_bound, db_later_params
from tltd.store.database import Database, DriverStatement
from tltd.store.leases import LEASED, PARKED, QUEUED, Claim
from tltd.store.lookups import changed_fields, request_row
from tltd.store.notifications import REQUEST, WORK, notify
from tltd.store.status import EVENT_ROW, switch_status, switch_status_from
from tltd.store.tables import (
    EventRow,
    JobPauseRow,
    JobRow,
    RolloutRequestRow,
    UTCDateTime,
    WorkUnitRow,
    utcnow,
)

_REQUEST_PARAMS = (
    "job_id", "prompts", "sampling", "speculative", "bound_groups", "carried", "bound_park",
    "bound_deadline_ms", "bound_tokens",
)  # fmt: skip


def prompt_key(prompt: Sequence[int]) -> str:
    """A prompt's token ids as a fixed-width key (sha256 hex): the history drafter's look-up
    of a prompt's earlier answers across requests."""
    return hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()


def running_on(worker_id: str) -> str:
    """The reason a request's start (QUEUED -> RUNNING) records."""
    return f"running on {worker_id}"


class JobPaused(Exception):
    """`create(unless_paused=True)` stored nothing: the request's job is paused."""


@dataclass(frozen=True)
class AdmissionClaim:
    """What a node admitting a request may lease to itself in the request's own transaction:
    its first units while the samples before each stay under `capacity`, for
    `lease_seconds`."""

    capacity: int
    lease_seconds: float


@dataclass(frozen=True)
class Created:
    """`create`'s answer: the stored request, whether this call created it, and the
    units it leased to this node (`AdmissionClaim`; none for a retry)."""

    request: RolloutRequest
    created: bool
    claims: tuple[Claim, ...] = ()


class _AdmissionStatements:
    """`admit`'s statements, built once per store (see sample_batches._Statements)."""

    def __init__(self, dialect: str) -> None:
        jobs, pauses = JobRow.__table__, JobPauseRow.__table__
        wu = WorkUnitRow.__table__
        paused = select(pauses.c.job_id).where(pauses.c.job_id == jobs.c.job_id).exists()
        # (status, policy_version, priority, paused)
        self.job = DriverStatement(
            select(jobs.c.status, jobs.c.policy_version, jobs.c.priority, paused.label("paused"))
            .where(jobs.c.job_id == bindparam("job"))
            .with_for_update(read=True, of=jobs)
        )
        # The request's INSERT per set of columns given (`request`).
        self.requests: dict[tuple[str, ...], DriverStatement] = {}
        units = (*_UNIT_COLUMNS, "request_id", "prompt_index")
        self.queued_units = DriverStatement(
            insert(wu).values(state=QUEUED, owner_epoch=0, attempts=0), columns=units
        )
        self.leased_units = DriverStatement(
            insert(wu).values(
                state=LEASED, owner_node=bindparam("node"), owner_epoch=bindparam("epoch"),
                attempts=1, lease_expires_at=db_later_bound(dialect),
            ),
            columns=units,
        )  # fmt: skip
        self.at_once = DriverStatement(_admission_at_once()) if dialect == "postgresql" else None

    def request(self, columns: tuple[str, ...]) -> DriverStatement:
        """The INSERT of a request row of `columns` (built once per set of them)."""
        got = self.requests.get(columns)
        if got is None:
            got = self.requests[columns] = DriverStatement(
                RolloutRequestRow.__table__.insert(), columns=columns
            )
        return got


# The columns of `_insert_units`'s rows besides the unit's key.
_UNIT_COLUMNS = ("samples", "prompt_key", "priority", "reason", "preferred_node", "created_at",
                 "updated_at")  # fmt: skip


def _admission_at_once() -> Select:
    """`admit` as one PostgreSQL statement: the job read and locked (FOR SHARE) and, when it
    accepts the request, the request, its units (unnest of their prompt indices, prompt keys
    and whether each is leased to the admitting node) and its event inserted, and WORK sent
    when asked (binds as `RolloutRequests._at_once_params`). Its row: the job's status,
    policy version and paused flag, and how many requests it inserted (0: refused); no row
    when the job does not exist."""
    jobs, pauses, rr = JobRow.__table__, JobPauseRow.__table__, RolloutRequestRow.__table__
    wu, ev, now = WorkUnitRow.__table__, EventRow.__table__, bindparam("now", UTCDateTime())
    paused = select(pauses.c.job_id).where(pauses.c.job_id == jobs.c.job_id).exists()
    job = (
        select(jobs.c.status, jobs.c.policy_version, jobs.c.priority, paused.label("paused"))
        .where(jobs.c.job_id == bindparam("job"))
        .with_for_update(read=True, of=jobs)
        .cte("job")
    )
    accepts = (job.c.status == JobStatus.ACTIVE.value) & or_(
        ~job.c.paused, ~bindparam("unless_paused", type_=Boolean)
    )
    given = {"policy_version": job.c.policy_version, "created_at": now, "updated_at": now}
    row = [given.get(c.name, bindparam(f"r_{c.name}", type_=c.type)) for c in rr.c]
    request = (
        rr.insert().from_select(list(rr.c), select(*row).where(accepts))
        .returning(rr.c.request_id).cte("request")
    )  # fmt: skip
    units = _units_inserted(wu, request, job, now)
    event = ev.insert().from_select(
        [ev.c.entity, ev.c.entity_id, ev.c.old_status, ev.c.new_status, ev.c.reason, ev.c.at],
        select(literal("request"), request.c.request_id, literal(""),
               literal(RequestStatus.QUEUED.value), literal("submitted"), now),
    ).cte("event")  # fmt: skip
    work = (
        select(func.pg_notify(bindparam("channel", type_=String()), request.c.request_id))
        .where(bindparam("notify", type_=Boolean()))
        .cte("work")
    )
    inserted = select(func.count()).select_from(request).scalar_subquery()
    sent = select(func.count()).select_from(work).scalar_subquery()
    return select(
        job.c.status, job.c.policy_version, job.c.paused, inserted.label("inserted"),
        sent.label("sent"),
    ).add_cte(units, event)  # fmt: skip


def _units_inserted(wu: Table, request: CTE, job: CTE, now: BindParameter) -> CTE:
    """`_admission_at_once`'s units: one per row of the unnested prompt indices (`u_index`),
    prompt keys (`u_key`) and leased flags (`u_leased`): leased as `claim_units` leases, to
    "node" under "epoch" until now() + "later", else queued."""
    u = (
        func.unnest(
            bindparam("u_index", type_=ARRAY(Integer())),
            bindparam("u_key", type_=ARRAY(String())),
            bindparam("u_leased", type_=ARRAY(Boolean())),
        )
        .table_valued("i", "k", "leased")
        .render_derived(name="u")
    )
    leased = u.c.leased
    values = {
        "request_id": request.c.request_id, "prompt_index": u.c.i,
        "samples": bindparam("n", type_=Integer()), "prompt_key": u.c.k,
        "priority": job.c.priority, "state": case((leased, LEASED), else_=QUEUED),
        "owner_node": case((leased, bindparam("node", type_=String())), else_=null()),
        "owner_epoch": case((leased, bindparam("epoch", type_=BigInteger())), else_=0),
        "preferred_node": bindparam("preferred", type_=String()),
        "lease_expires_at": case((leased, db_later_bound("postgresql")), else_=null()),
        "attempts": case((leased, 1), else_=0), "reason": literal(""),
        "created_at": now, "updated_at": now,
    }  # fmt: skip
    rows = select(*values.values()).select_from(request.join(job, true()).join(u, true()))
    return wu.insert().from_select([wu.c[k] for k in values], rows).cte("units")


class RolloutRequests:
    """Rollout requests: admitted with their work units, read, and moved through their statuses."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def create(
        self, req: RolloutRequest, unless_paused: bool = False
    ) -> tuple[RolloutRequest, bool]:
        """Queue a rollout request; idempotent on request_id (see `JobRecords.create`): a retry gets
        the stored request (False), whatever its job's state. Otherwise the job must exist
        (NotFound) and be active (FailedPrecondition), and with `unless_paused` not be paused
        (JobPaused: nothing stored)."""
        created = self.admit(req, unless_paused)
        return created.request, created.created

    def admit(
        self,
        req: RolloutRequest,
        unless_paused: bool = False,
        claim: AdmissionClaim | None = None,
    ) -> Created:
        """`create`; with `claim` (on a joined node) the new request's first units
        whose samples fit its capacity are leased to this node in the same transaction, as
        `claim_units` would lease them: the node that admitted the request runs them without
        claiming them and reading back what it just wrote. The other units are queued for
        any node."""
        try:
            at_once = self._admit_at_once(req, unless_paused, claim)
            if at_once is not None:
                return at_once
            return self._admit_in_tx(req, unless_paused, claim)
        except IntegrityError:  # the request_id is stored: a retry (or a concurrent one)
            with self.db.tx(write=False) as s:
                existing = s.get(RolloutRequestRow, req.request_id)
                if existing is None:
                    raise
                return Created(self._same_request(existing, req), False)

    def _admit_at_once(
        self, req: RolloutRequest, unless_paused: bool, claim: AdmissionClaim | None
    ) -> Created | None:
        """`admit` in one statement, a transaction of its own or a savepoint of a batch
        (PostgreSQL, see `_admission_at_once`); None when that does not apply (SQLite, a
        carried request) or the job is missing or refuses the request: nothing is written
        then, and `_admit_in_tx` says why (or finds the request a retry attaches to)."""
        st = self._admission_statements
        if st.at_once is None or req.carried:
            return None
        one_statement = self.db.one_statement()
        if one_statement is None:
            return None
        now = utcnow()
        fit = self._fit(req, claim)
        params = self._at_once_params(req, unless_paused, claim, fit, now)
        with one_statement as conn:
            row = st.at_once.first(conn, params)  # status, policy_version, paused, inserted
        if row is None or not row[3]:
            return None
        stored = replace(
            req, status=RequestStatus.QUEUED, status_reason="", samples_done=0,
            policy_version=int(row[1]), created_at=now, updated_at=now,
        )  # fmt: skip
        return Created(stored, True, tuple(Claim(req.request_id, p, 1) for p in range(fit)))

    def _at_once_params(
        self, req: RolloutRequest, unless_paused: bool, claim: AdmissionClaim | None, fit: int,
        now: datetime,
    ) -> dict[str, Any]:  # fmt: skip
        """The binds of `_admission_at_once` for `req`, its first `fit` units leased."""
        queued = replace(req, status=RequestStatus.QUEUED, status_reason="", samples_done=0)
        params: dict[str, Any] = {f"r_{k}": v for k, v in convert.request_columns(queued).items()}
        prompts = range(len(req.prompts))
        lease = timedelta(seconds=claim.lease_seconds if claim is not None and fit else 0)
        return params | {
            "job": req.job_id, "unless_paused": unless_paused, "now": now, "n": req.sampling.n,
            "u_index": list(prompts), "u_key": [prompt_key(p) for p in req.prompts],
            "u_leased": [p < fit for p in prompts], "node": self.db.node_id,
            "epoch": self.db.epoch, "later": lease, "preferred": req.preferred_node or None,
            "channel": WORK, "notify": fit < len(req.prompts),
        }  # fmt: skip

    def _admit_in_tx(
        self, req: RolloutRequest, unless_paused: bool, claim: AdmissionClaim | None
    ) -> Created:
        """`admit` as a transaction of several statements (raises IntegrityError for a
        request id stored already)."""
        st = self._admission_statements
        with self.db.statements_tx() as s:
            conn = s.connection()
            # FOR SHARE until commit: a concurrent cancel of the job (FOR UPDATE) waits for
            # this request and then sees it, and a new policy version waits too, so the
            # version recorded is the job's current one at acceptance.
            job = st.job.first(conn, {"job": req.job_id})
            if job is None:
                raise NotFound(f"job {req.job_id!r} not found", field="job_id")
            status, policy_version, priority, paused = job
            refused: Exception | None = None
            if status != JobStatus.ACTIVE:
                refused = FailedPrecondition(f"job {req.job_id!r} is {status}", field="job_id")
            elif unless_paused and paused:
                refused = JobPaused(req.job_id)
            if refused is not None:  # a retry attaches all the same
                existing = s.get(RolloutRequestRow, req.request_id)
                if existing is not None:
                    return Created(self._same_request(existing, req), False)
                raise refused
            # A retry of a stored request fails the insert below (its primary key): it
            # is read then, so a new request needs no read first.
            now = utcnow()
            stored = replace(
                req, status=RequestStatus.QUEUED, status_reason="", samples_done=0,
                policy_version=int(policy_version), created_at=now, updated_at=now,
            )  # fmt: skip
            row = {**convert.request_columns(stored), "created_at": now, "updated_at": now}
            st.request(tuple(row)).execute(conn, row).close()
            claims = self._insert_units(s, req, int(priority), now, claim)
            if req.carried:
                self._unpark(s, req.job_id, now)
            EVENT_ROW.execute(
                conn,
                {"entity": "request", "entity_id": req.request_id, "old_status": "",
                 "new_status": RequestStatus.QUEUED.value, "reason": "submitted", "at": now},
            ).close()  # fmt: skip
            if len(claims) < len(req.prompts):  # units any node may claim
                notify(s, WORK, req.request_id)
            return Created(stored, True, claims)

    @staticmethod
    def _unpark(s: Session, job_id: str, now: object) -> None:
        """Queue the job's parked prompts again (a carried request takes their groups): any
        node claims them and goes on from their stored tokens."""
        wu, rr = WorkUnitRow, RolloutRequestRow
        rows = s.execute(
            update(wu)
            .where(
                wu.state == PARKED,
                wu.request_id.in_(select(rr.request_id).where(rr.job_id == job_id)),
            )
            .values(state=QUEUED, updated_at=now)
            .returning(wu.request_id)
            .execution_options(synchronize_session=False)
        ).all()
        for rid in sorted({r[0] for r in rows}):
            notify(s, WORK, rid)

    @functools.cached_property
    def _admission_statements(self) -> _AdmissionStatements:
        return _AdmissionStatements(self.db.dialect)

    def _insert_units(
        self,
        s: Session,
        req: RolloutRequest,
        priority: int,
        now: object,
        claim: AdmissionClaim | None,
    ) -> tuple[Claim, ...]:
        """One work unit per prompt (what nodes claim, `tltd.store.leases`); with `claim`, the
        first ones whose samples fit its capacity leased to this node. Returns those."""
        n, rid = req.sampling.n, req.request_id
        fit = self._fit(req, claim)
        rows = [
            {"request_id": rid, "prompt_index": p, "samples": n,
             "prompt_key": prompt_key(req.prompts[p]), "priority": priority, "reason": "",
             "preferred_node": req.preferred_node or None, "created_at": now, "updated_at": now}
            for p in range(len(req.prompts))
        ]  # fmt: skip
        st, conn = self._admission_statements, s.connection()
        if fit:
            assert claim is not None
            lease = db_later_params(self.db.dialect, claim.lease_seconds)
            owner = {"node": self.db.node_id, "epoch": self.db.epoch}
            leased = [{**r, **owner, **lease} for r in rows[:fit]]
            st.leased_units.execute_many(conn, leased).close()
        if fit < len(rows):
            st.queued_units.execute_many(conn, rows[fit:]).close()
        return tuple(Claim(rid, p, 1) for p in range(fit))

    def _fit(self, req: RolloutRequest, claim: AdmissionClaim | None) -> int:
        """How many of `req`'s first units `claim` leases to this node (0 when not joined)."""
        if claim is None or claim.capacity <= 0 or not self.db.epoch:
            return 0
        # As claim_units: a unit is taken while the samples before it stay under capacity.
        return min(len(req.prompts), -(-claim.capacity // max(1, req.sampling.n)))

    @staticmethod
    def _same_request(existing: RolloutRequestRow, req: RolloutRequest) -> RolloutRequest:
        current = convert.request_from_row(existing)
        diff = changed_fields(current, req, _REQUEST_PARAMS)
        if diff:
            raise AlreadyExists(
                f"rollout request {req.request_id!r} already exists with different "
                f"{', '.join(diff)}",
                field="request_id",
            )
        return current

    def get(self, request_id: str) -> RolloutRequest:
        with self.db.tx(write=False) as s:
            return convert.request_from_row(request_row(s, request_id))

    def list(
        self,
        statuses: Sequence[RequestStatus] | None = None,
        job_id: str | None = None,
        limit: int | None = 1000,
    ) -> list[RolloutRequest]:
        """Requests, oldest first (queue order); limit None = all of them."""
        with self.db.tx(write=False) as s:
            q = select(RolloutRequestRow)
            if statuses:
                q = q.where(RolloutRequestRow.status.in_([str(x) for x in statuses]))
            if job_id is not None:
                q = q.where(RolloutRequestRow.job_id == job_id)
            q = q.order_by(RolloutRequestRow.created_at, RolloutRequestRow.request_id)
            return [convert.request_from_row(r) for r in s.scalars(q.limit(limit)).all()]

    def mark_running(self, request_id: str, reason: str) -> bool:
        """QUEUED -> RUNNING with its event, as `set_status` records it; True when it
        moved. Any other status stands (RUNNING already, or ended meanwhile). Two statements,
        nothing read back: a node calls it once per request it starts. Other nodes are not
        notified: a request starting changes nothing their streams send or their units do."""
        with self.db.tx() as s:
            return switch_status_from(
                s, "request", RolloutRequestRow, request_id,
                RequestStatus.QUEUED, RequestStatus.RUNNING, reason,
            )  # fmt: skip

    def set_status(self, request_id: str, new: RequestStatus, reason: str) -> RolloutRequest:
        with self.db.tx() as s:
            row = request_row(s, request_id, lock=True)
            if switch_status(s, "request", request_id, row, new, reason):
                notify(s, REQUEST, request_id)  # streams and the nodes running it look now
            return convert.request_from_row(row)
