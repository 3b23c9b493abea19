"""A watchdog's own stalls. A reaper that kills children silent for N seconds must not count
the seconds in which its own process did not run (SIGSTOP, a suspended VM, a loop blocked by
a long call): the children were stopped with it, or their messages sat unread. Each look
says how long the process was stalled since the last one; the reaper adds that to each
child's window instead of killing children that did nothing wrong."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class StallWatch:
    """Looks taken every `every` seconds (a periodic job); a gap well past that is a stall."""

    def __init__(self, every: float, what: str) -> None:
        self.every = every
        self.what = what
        self._last: float | None = None

    def look(self, now: float) -> float:
        """Seconds this process was stalled since the last look (0.0: none). A gap up to
        twice the interval plus a second is ordinary scheduling jitter."""
        last, self._last = self._last, now
        if last is None:
            return 0.0
        late = now - last - self.every
        if late <= self.every + 1.0:
            return 0.0
        log.warning(
            "daemon was stalled: silence over the stall not held against workers",
            extra={"seconds": round(late, 1), "reaper": self.what},
        )
        return late


def forgiven(last_heartbeat: float, stalled: float, now: float) -> float:
    """A child's last sign of life moved on by the stall (never past now)."""
    return min(last_heartbeat + stalled, now)
