"""PostgreSQL LISTEN/NOTIFY between nodes: a wake-up, never the only path (NOTIFY is
best-effort: a listener reconnecting misses what was sent meanwhile), so every consumer also
polls the store.

Writers call `notify` inside their transaction: PostgreSQL delivers on commit, so a listener
woken by a sample finds it stored. On SQLite (one node) nothing is sent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

SAMPLE = "tltd_sample"  # payload: request id; a sample of it was stored
REQUEST = "tltd_request"  # payload: request id; it ended (cancelled, failed)
WORK = "tltd_work"  # payload: request id; units to claim
NODE = "tltd_node"  # payload: node id; an operator request for that node (a drain)
STATE = "tltd_state"  # payload: the writer's WriteWatch.origin; jobs, devices or drafters changed
CHANNELS = (SAMPLE, REQUEST, WORK, NODE, STATE)

_RECONNECT_SECONDS = 1.0


def notify(s: Session, channel: str, payload: str) -> None:
    """Send on commit of `s`'s transaction (PostgreSQL only)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_notify(:c, :p)"), {"c": channel, "p": payload})


class Listener:
    """A thread LISTENing on every channel with its own connection; `on_notify(channel,
    payload)` runs in that thread. Reconnects after a lost connection."""

    def __init__(self, url: str, on_notify: Callable[[str, str], None]) -> None:
        u = make_url(url).set(drivername="postgresql")
        self._conninfo = u.render_as_string(hide_password=False)
        self._on_notify = on_notify
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
                                self._on_notify(n.channel, n.payload)
                            except Exception:
                                log.exception("notification handler failed")
            except Exception as exc:  # a lost connection: the pollers cover the gap
                self.connected.clear()
                log.warning("notification listener reconnecting: %s", exc)
                self._stop.wait(_RECONNECT_SECONDS)
