"""Node-wide runtime state the services share: start time and the daemon's draining flag."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class NodeState:
    """Mutable on purpose: Drain flips `draining`, shutdown reads it; one instance per daemon."""

    started_monotonic: float = field(default_factory=time.monotonic)
    draining: bool = False
    draining_reason: str = ""
    drain_grace_seconds: float | None = None  # `tltctl drain --node --grace N`; None: default
    _on_draining: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def uptime_seconds(self, now_monotonic: float | None = None) -> float:
        now = time.monotonic() if now_monotonic is None else now_monotonic
        return max(0.0, now - self.started_monotonic)

    def start_draining(self, reason: str, grace_seconds: float | None = None) -> None:
        """Refuse new rollouts from now on; listeners run once, in the caller's thread."""
        if self.draining:
            return
        self.draining = True
        self.draining_reason = reason
        self.drain_grace_seconds = grace_seconds
        for listener in self._on_draining:
            listener()

    def on_draining(self, listener: Callable[[], None]) -> None:
        """Call `listener` when the node starts draining (it must be thread-safe)."""
        self._on_draining.append(listener)
