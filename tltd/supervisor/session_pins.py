"""Sessions pinned to workers: which worker holds a session's KV (its next turn goes there), what
the session's turns reused there, and where each group's first prompt went.

A node's own memory, as the KV it describes is: a restarted daemon starts with no pins (its
workers kept nothing), and another node knows nothing of this node's pins. The supervisor's event
loop records; the session service releases a closed session and reads pins for ListSessions from
its threads, hence the lock. Bounded: the least recently used entries are dropped.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace

# Sessions (and first prompts) remembered, least recent dropped.
MAX_PINS = 1 << 16


@dataclass(frozen=True)
class Pin:
    """A session's place: `worker_id` holds its KV while `pinned`. A session unpinned keeps
    its counters: closed (released), or its worker lost with the KV (`lost`: its next turn is
    re-pinned, reason "gone")."""

    worker_id: str
    pinned: bool = True
    lost: bool = False
    turns: int = 0  # turns finished here
    hits: int = 0  # ... that reused kept KV
    reused_tokens: int = 0  # prompt positions those turns restored instead of computing


class SessionPins:
    """Session key -> its `Pin`; a first prompt's key -> the worker its first turn went to;
    per worker, the sessions pinned there (what `tltd_session_pins` shows)."""

    def __init__(self, limit: int = MAX_PINS) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._pins: OrderedDict[str, Pin] = OrderedDict()
        self._shares: OrderedDict[str, str] = OrderedDict()  # first prompt's key -> worker
        self._count: Counter[str] = Counter()  # worker -> sessions pinned there

    def held_by(self, key: str, worker_id: str, reused_tokens: int = 0) -> None:
        """A turn of session `key` finished on `worker_id`, which keeps its KV now (a closed
        session's, cancelled by the close, stays unpinned)."""
        with self._lock:
            old = self._pins.pop(key, None)
            closed = old is not None and not old.pinned and not old.lost
            old = old or Pin(worker_id, pinned=False)
            self._unpin(old)
            self._pins[key] = Pin(
                worker_id,
                pinned=not closed,
                turns=old.turns + 1,
                hits=old.hits + (reused_tokens > 0),
                reused_tokens=old.reused_tokens + reused_tokens,
            )
            if not closed:
                self._count[worker_id] += 1
            self._trim()

    def shared(self, share_key: str, worker_id: str) -> None:
        """A first turn with this prompt key was handed to `worker_id`: the other sessions of
        the prompt follow it there."""
        with self._lock:
            self._shares.pop(share_key, None)
            self._shares[share_key] = worker_id
            while len(self._shares) > self._limit:
                self._shares.popitem(last=False)

    def holder(self, key: str) -> str | None:
        """The worker holding a session's KV, or a first prompt's; "" when its worker was lost
        with it; None when none is known (new, closed, forgotten)."""
        with self._lock:
            if key in self._shares:
                return self._shares[key]
            pin = self._pins.get(key)
        if pin is None or not (pin.pinned or pin.lost):
            return None
        return pin.worker_id if pin.pinned else ""

    def lose_worker(self, worker_id: str) -> None:
        """The worker died: the KV it kept is gone."""
        with self._lock:
            for key, pin in self._pins.items():
                if pin.pinned and pin.worker_id == worker_id:
                    self._pins[key] = replace(pin, pinned=False, lost=True)
            self._count.pop(worker_id, None)
            for key in [k for k, w in self._shares.items() if w == worker_id]:
                del self._shares[key]

    def release(self, key: str) -> None:
        """The session was closed: no next turn will come for its KV."""
        with self._lock:
            pin = self._pins.get(key) or Pin("", pinned=False)  # a turn still ending stays out
            self._unpin(pin)
            self._pins[key] = replace(pin, pinned=False, lost=False)
            self._trim()

    def get(self, key: str) -> Pin | None:
        with self._lock:
            return self._pins.get(key)

    def pinned_on(self, worker_id: str) -> int:
        """Sessions pinned to the worker (open ones whose last turn ran there)."""
        with self._lock:
            return self._count.get(worker_id, 0)

    def holders(self) -> dict[str, str]:
        """Session -> the worker holding its KV, for every session pinned now."""
        with self._lock:
            return {k: p.worker_id for k, p in self._pins.items() if p.pinned}

    def _trim(self) -> None:
        while len(self._pins) > self._limit:
            self._unpin(self._pins.popitem(last=False)[1])

    def _unpin(self, pin: Pin) -> None:
        if pin.pinned:
            self._count[pin.worker_id] -= 1
            if self._count[pin.worker_id] <= 0:
                del self._count[pin.worker_id]
