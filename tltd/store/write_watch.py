"""A counter of committed writes to some tables: lets a reader keep what it read until it moves.

The scheduler's tick reads this node's devices and the active jobs several times per request
(every sample wakes it); they change rarely. A reader takes `generation` before it reads and
may reuse its result while `generation` is unchanged. The counter moves *after* the commit of a
transaction that inserted, updated or deleted rows of a watched table, so a read that started
after the move sees the write.

Other nodes: on PostgreSQL such a transaction also sends `channel` (delivered on its commit), and
a node that hears it from another process moves its own counter (`changed_elsewhere`). A
notification can be missed (a listener reconnecting), so readers still re-read now and then.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable

from sqlalchemy import event
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker

from tltd.store.notifications import notify

_TOUCHED = "write_watch.touched"


class WriteWatch:
    """Counts committed transactions that wrote to any of `tables`, over the sessions of the
    sessionmakers given to `watch`."""

    def __init__(self, tables: Iterable[str], channel: str) -> None:
        self.tables = frozenset(tables)
        self.channel = channel
        self.origin = uuid.uuid4().hex  # this process, in its notifications' payload
        self._lock = threading.Lock()
        self._generation = 0

    @property
    def generation(self) -> int:
        return self._generation

    def watch(self, maker: sessionmaker) -> None:
        event.listen(maker, "do_orm_execute", self._on_execute)
        event.listen(maker, "after_flush", self._on_flush)
        event.listen(maker, "before_commit", self._on_before_commit)
        event.listen(maker, "after_commit", self._on_commit)

    def _on_execute(self, state: ORMExecuteState) -> None:
        # Statements such as update(JobRow) or insert(DeviceRow) run through Session.execute.
        if state.is_insert or state.is_update or state.is_delete:
            table = getattr(state.statement, "table", None)
            if getattr(table, "name", None) in self.tables:
                state.session.info[_TOUCHED] = True

    def _on_flush(self, session: Session, _context: object) -> None:
        if self._pending(session):
            session.info[_TOUCHED] = True

    def _pending(self, session: Session) -> bool:
        """Rows of a watched table added, changed or deleted as ORM objects and not yet
        written (in after_flush: just written)."""
        objs = (*session.new, *session.dirty, *session.deleted)
        return any(getattr(obj, "__tablename__", None) in self.tables for obj in objs)

    def _on_before_commit(self, session: Session) -> None:
        # (The commit's own flush comes after this hook: count its rows too.)
        if session.info.get(_TOUCHED) or self._pending(session):
            session.info[_TOUCHED] = True
            notify(session, self.channel, self.origin)

    def _on_commit(self, session: Session) -> None:
        # (A rolled-back session is dropped with its mark: at worst a later commit of the same
        # session counts once too often, which only costs a reader one read.)
        if session.info.pop(_TOUCHED, False):
            with self._lock:
                self._generation += 1

    def changed_elsewhere(self, origin: str) -> None:
        """Another process committed such a write (its notification's payload)."""
        if origin != self.origin:
            with self._lock:
                self._generation += 1
