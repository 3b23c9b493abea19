"""Multi-turn sessions: a session's prompt and counters, its turns (begun, done, given up), and
closing it. Each call is one transaction on the session's row, locked."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from tltd.domain import (
    AgentSession,
    Sample,
    SamplingParams,
    SessionStatus,
    SessionSummary,
    SessionTurn,
    TurnStatus,
    turn_request_id,
)
from tltd.errors import AlreadyExists, FailedPrecondition, NotFound
from tltd.store import convert
from tltd.store.database import Database
from tltd.store.lookups import job_row
from tltd.store.tables import SessionRow, SessionTurnRow, WorkUnitRow, utcnow


class SessionRecords:
    """Multi-turn sessions and their turns."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def open(self, session: AgentSession) -> tuple[AgentSession, bool]:
        """Store a new session (True), or return the stored one of that id when it has the
        same job and prompt (False); another job or prompt is ALREADY_EXISTS."""
        try:
            with self.db.tx() as s:
                return _open(s, session)
        except IntegrityError:  # opened by a concurrent call meanwhile: compare with it
            return _same_session(self.get(session.session_id), session), False

    def open_all(self, sessions: Sequence[AgentSession]) -> list[AgentSession]:
        """`open` each of them, in one transaction (one by one if a concurrent call opened
        one of them meanwhile)."""
        try:
            with self.db.tx() as s:
                return [_open(s, session)[0] for session in sessions]
        except IntegrityError:
            return [self.open(session)[0] for session in sessions]

    def get(self, session_id: str) -> AgentSession:
        with self.db.tx(write=False) as s:
            return _read(s, session_id)

    def list(
        self, job_id: str = "", statuses: Sequence[SessionStatus] = (), limit: int = 100
    ) -> list[SessionSummary]:
        """Sessions, newest first, with the index of each one's running turn (-1: none)."""
        q = select(SessionRow).order_by(SessionRow.created_at.desc(), SessionRow.session_id)
        if job_id:
            q = q.where(SessionRow.job_id == job_id)
        if statuses:
            q = q.where(SessionRow.status.in_([st.value for st in statuses]))
        with self.db.tx(write=False) as s:
            rows = s.scalars(q.limit(limit) if limit else q).all()
            running = dict(
                s.execute(
                    select(SessionTurnRow.session_id, SessionTurnRow.turn_index).where(
                        SessionTurnRow.session_id.in_([r.session_id for r in rows]),
                        SessionTurnRow.status == TurnStatus.RUNNING.value,
                    )
                ).all()
            )
            return [convert.session_summary(r, running.get(r.session_id, -1)) for r in rows]

    def set_prompt(self, session_id: str, prompt: tuple[int, ...]) -> AgentSession:
        """Give a session opened without a prompt its prompt (its first request's tokens);
        the same prompt again is a no-op, another one ALREADY_EXISTS."""
        with self.db.tx() as s:
            row = _session_row(s, session_id, lock=True)
            if row.status != SessionStatus.OPEN.value:
                raise FailedPrecondition(f"session {session_id} is closed", field="session_id")
            stored = convert.unpacked_ids(row.prompt_bin)
            if not stored:
                row.prompt_bin = convert.packed_ids(prompt)
                row.num_tokens = len(prompt)
                row.updated_at = utcnow()
                s.flush()
            elif stored != prompt:
                raise AlreadyExists(
                    f"session {session_id} has another prompt", field="prompt_token_ids"
                )
            return _read(s, session_id)

    def begin_turn(
        self, session_id: str, turn_index: int, inputs: tuple[int, ...], sampling: SamplingParams
    ) -> tuple[AgentSession, SessionTurn]:
        """The turn `turn_index` of an open session, stored RUNNING when it is the next one
        (the session as it was before it, and the turn). A retry (same index, inputs and
        sampling) gets the stored turn, running or done; any other call while a turn runs, a
        turn out of order or other inputs for a stored turn are refused, naming the field."""
        with self.db.tx() as s:
            row = _session_row(s, session_id, lock=True)
            if row.status != SessionStatus.OPEN.value:
                raise FailedPrecondition(f"session {session_id} is closed", field="session_id")
            session = _read(s, session_id)
            running = session.running_turn
            stored = next((t for t in session.turns if t.turn_index == turn_index), None)
            if stored is not None:
                return session, _same_turn(stored, inputs, sampling)
            if running is not None:
                raise FailedPrecondition(
                    f"turn {running.turn_index} of session {session_id} is still running: "
                    "retry it, or wait for it to return",
                    field="turn_index",
                )
            if turn_index != row.num_turns:
                raise FailedPrecondition(
                    f"session {session_id} has {row.num_turns} turns done: the next is "
                    f"turn_index {row.num_turns}, got {turn_index}",
                    field="turn_index",
                )
            now = utcnow()
            request_id = turn_request_id(session_id, turn_index, row.attempts)
            s.add(
                SessionTurnRow(
                    session_id=session_id,
                    turn_index=turn_index,
                    request_id=request_id,
                    status=TurnStatus.RUNNING.value,
                    input_bin=convert.packed_ids(inputs),
                    sampling=convert.sampling_to_json(sampling),
                    policy_version=0,
                    created_at=now,
                    updated_at=now,
                )
            )
            row.updated_at = now
            s.flush()
            return session, _read(s, session_id).turns[-1]

    def prune_closed(self, before: datetime, batch: int = 500) -> int:
        """Delete the sessions closed before `before`, with their turns, a batch per
        transaction (the history retention); returns how many."""
        sr, st = SessionRow, SessionTurnRow
        deleted = 0
        while True:
            with self.db.tx() as s:
                ids = s.scalars(
                    select(sr.session_id)
                    .where(sr.status == SessionStatus.CLOSED.value, sr.updated_at < before)
                    .limit(batch)
                ).all()
                if not ids:
                    return deleted
                # Turns first: not every SQLite connection that wrote the file enforced keys.
                s.execute(delete(st).where(st.session_id.in_(ids)))
                s.execute(delete(sr).where(sr.session_id.in_(ids)))
                deleted += len(ids)

    def turn_node(self, session_id: str, turn_index: int) -> str:
        """The node that ran turn `turn_index`'s request ("" when none did, or it is gone
        from the store): the one holding the session's KV after it."""
        st, wu = SessionTurnRow, WorkUnitRow
        with self.db.tx(write=False) as s:
            node = s.scalar(
                select(wu.owner_node)
                .join(st, st.request_id == wu.request_id)
                .where(st.session_id == session_id, st.turn_index == turn_index)
            )  # fmt: skip
        return node or ""

    def complete_turn(self, turn: SessionTurn, sample: Sample) -> tuple[AgentSession, SessionTurn]:
        """Record what the turn's request sampled and count the turn done; a turn done
        already is returned as it is (two calls attached to one turn both end here)."""
        with self.db.tx() as s:
            row = _session_row(s, turn.session_id, lock=True)
            t = _turn_row(s, turn)
            if t.status == TurnStatus.RUNNING.value:
                convert.fill_turn_row(t, sample)
                t.updated_at = row.updated_at = utcnow()
                row.num_turns += 1
                row.num_tokens += len(turn.input_token_ids) + len(sample.token_ids)
                s.flush()
            session = _read(s, turn.session_id)
            return session, session.turns[turn.turn_index]

    def give_up_turn(self, turn: SessionTurn) -> None:
        """Drop a running turn whose request ended without a sample (failed, cancelled):
        the session is as before it, and the turn's next attempt runs a new request."""
        with self.db.tx() as s:
            row = _session_row(s, turn.session_id, lock=True)
            t = s.get(SessionTurnRow, (turn.session_id, turn.turn_index))
            if t is None or t.status != TurnStatus.RUNNING.value:
                return
            if t.request_id == turn.request_id:
                s.delete(t)
                row.attempts += 1
                row.updated_at = utcnow()

    def close(self, session_id: str) -> AgentSession:
        """No more turns; a running turn is dropped (the caller settles it first)."""
        with self.db.tx() as s:
            row = _session_row(s, session_id, lock=True)
            if row.status != SessionStatus.CLOSED.value:
                for t in s.scalars(
                    select(SessionTurnRow).where(
                        SessionTurnRow.session_id == session_id,
                        SessionTurnRow.status == TurnStatus.RUNNING.value,
                    )
                ):
                    s.delete(t)
                row.status = SessionStatus.CLOSED.value
                row.updated_at = utcnow()
                s.flush()
            return _read(s, session_id)


def _open(s: Session, session: AgentSession) -> tuple[AgentSession, bool]:
    """`SessionRecords.open` within a transaction."""
    if s.get(SessionRow, session.session_id) is not None:
        return _same_session(_read(s, session.session_id), session), False
    job_row(s, session.job_id)  # NotFound names job_id
    now = utcnow()
    s.add(
        SessionRow(
            session_id=session.session_id,
            job_id=session.job_id,
            prompt_bin=convert.packed_ids(session.prompt_token_ids),
            status=SessionStatus.OPEN.value,
            num_turns=0,
            num_tokens=len(session.prompt_token_ids),
            attempts=0,
            streaming=session.streaming,
            created_at=now,
            updated_at=now,
        )
    )
    s.flush()
    return _read(s, session.session_id), True


def _session_row(s: Session, session_id: str, *, lock: bool = False) -> SessionRow:
    row = s.get(SessionRow, session_id, with_for_update=lock)
    if row is None:
        raise NotFound(f"session {session_id!r} not found", field="session_id")
    return row


def _turn_row(s: Session, turn: SessionTurn) -> SessionTurnRow:
    t = s.get(SessionTurnRow, (turn.session_id, turn.turn_index))
    if t is None or t.request_id != turn.request_id:
        raise FailedPrecondition(
            f"turn {turn.turn_index} of session {turn.session_id} was given up or the "
            "session closed while it ran",
            field="turn_index",
        )
    return t


def _read(s: Session, session_id: str) -> AgentSession:
    row = _session_row(s, session_id)
    turns = s.scalars(
        select(SessionTurnRow)
        .where(SessionTurnRow.session_id == session_id)
        .order_by(SessionTurnRow.turn_index)
    ).all()
    return convert.session_from_rows(row, turns)


def _same_session(stored: AgentSession, asked: AgentSession) -> AgentSession:
    for name in ("job_id", "prompt_token_ids", "streaming"):
        if getattr(stored, name) != getattr(asked, name):
            raise AlreadyExists(
                f"session {stored.session_id} exists with another {name}", field=name
            )
    return stored


def _same_turn(
    stored: SessionTurn, inputs: tuple[int, ...], sampling: SamplingParams
) -> SessionTurn:
    """A retry must send what the stored turn was begun with."""
    if stored.input_token_ids != inputs:
        raise AlreadyExists(
            f"turn {stored.turn_index} of session {stored.session_id} was sent other input tokens",
            field="input_token_ids",
        )
    if stored.sampling != sampling:
        differ = [
            f"sampling.{name}"
            for name in SamplingParams.__dataclass_fields__
            if getattr(stored.sampling, name) != getattr(sampling, name)
        ]
        raise AlreadyExists(
            f"turn {stored.turn_index} of session {stored.session_id} was sent other "
            f"sampling ({', '.join(differ)})",
            field=differ[0],
        )
    return stored
