"""PostgreSQL LISTEN/NOTIFY between nodes: a wake-up, never the only path (NOTIFY is
best-effort: a listener reconnecting misses what was sent meanwhile), so every consumer also
polls the store.

Writers call `notify` inside their transaction: PostgreSQL delivers on commit, so a listener
woken by a sample finds it stored. On SQLite (one node) nothing is sent.

PostgreSQL delivers a notification to its sender's own listener too. Each one carries the
sending session's backend pid, and `OwnBackends` knows this process's: a node does not wake
its own streams for what it wrote itself (it told them already, without a store read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

SAMPLE = "tltd_sample"  # payload: request id; a sample of it was stored
REQUEST = "tltd_request"  # payload: request id; it ended (cancelled, failed)
WORK = "tltd_work"  # payload: request id; units to claim
NODE = "tltd_node"  # payload: node id; an operator request for that node (a drain)
STATE = "tltd_state"  # payload: the writer's WriteWatch.origin; jobs, devices or drafters changed
CHANNELS = (SAMPLE, REQUEST, WORK, NODE, STATE)

_RECONNECT_SECONDS = 1.0


# On the session's connection, not through the ORM's execute: a statement less to wrap in it
# for every sample and request.
_NOTIFY = text("SELECT pg_notify(:c, :p)")


def notify(s: Session, channel: str, payload: str) -> None:
    """Send on commit of `s`'s transaction (PostgreSQL only)."""
    if s.get_bind().dialect.name == "postgresql":
        s.connection().execute(_NOTIFY, {"c": channel, "p": payload})


def notify_many(s: Session, channel: str, payloads: Sequence[str]) -> None:
    """`notify` for each of `payloads`, in one statement."""
    if payloads and s.get_bind().dialect.name == "postgresql":
        s.execute(
            text("SELECT pg_notify(:c, p) FROM unnest(CAST(:ps AS text[])) AS p"),
            {"c": channel, "ps": list(payloads)},
        )


class OwnBackends:
    """The backend pids of an engine's open PostgreSQL sessions (a set kept by pool events).
    A pid missed or kept too long costs a wake-up, never a sample: streams also poll."""

    def __init__(self, engine: Engine) -> None:
        self._pids: set[int] = set()
        if engine.dialect.name != "postgresql":
            return
        event.listen(engine, "connect", self._opened)
        event.listen(engine, "close", self._closed)

    def __contains__(self, pid: object) -> bool:
        return pid in self._pids

    def _opened(self, dbapi_conn: Any, record: Any) -> None:
        pid = int(dbapi_conn.info.backend_pid)  # psycopg 3, no round trip
        record.info["backend_pid"] = pid  # for its close: a broken connection is not asked
        self._pids.add(pid)

    def _closed(self, _dbapi_conn: Any, record: Any) -> None:
        self._pids.discard(record.info.get("backend_pid"))


class Listener:
    """A thread LISTENing on every channel with its own connection; `on_notify(channel,
    payload, own)` runs in that thread, `own` when a session of `own` sent it. Reconnects
    after a lost connection."""

    def __init__(
        self,
        url: str,
        on_notify: Callable[[str, str, bool], None],
        own: OwnBackends | None = None,
    ) -> None:
        u = make_url(url).set(drivername="postgresql")
        self._conninfo = u.render_as_string(hide_password=False)
        self._on_notify = on_notify
        self._own = own if own is not None else set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-listener", daemon=True)
        self.connected = threading.Event()

    def start(self) -> Listener:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as conn:
                    for channel in CHANNELS:
                        conn.execute(f"LISTEN {channel}")
                    self.connected.set()
                    while not self._stop.is_set():
                        for n in conn.notifies(timeout=0.5):
                            try:
                                self._on_notify(n.channel, n.payload, n.pid in self._own)
                            except Exception:
                                log.exception("notification handler failed")
            except Exception as exc:  # a lost connection: the pollers cover the gap
                self.connected.clear()
                log.warning("notification listener reconnecting: %s", exc)
                self._stop.wait(_RECONNECT_SECONDS)
