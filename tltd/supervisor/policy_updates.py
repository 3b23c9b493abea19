"""Policy updates in flight: lets a tick drop a training start that a stale read of jobs allowed.

The race: a tick reads the jobs (their policy versions) from the store, then an UpdatePolicy
writes a new version. The tick's snapshot shows no policy load for the job, so the scheduler
may start drafter training for it while its workers are about to load the new weights.

The mechanism: two counters per job, `begun` (bumped before UpdatePolicy's store write) and
`ended` (bumped after it). A tick takes `mark()` (the `ended` counts) before it reads the jobs,
and right before it starts training for a job asks `changed_since(mark, job)`: did an update of
the job begin that had not ended at the mark? That covers every update whose write the read may
have missed: its write, and so its `end`, came after the mark, and its `begin` came before the
check, unless it began after the tick committed to the start, which orders the start before
the update (training that is already running when an update arrives is not stopped either).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class PolicyUpdates:
    """Per-job counts of UpdatePolicy store writes begun and ended (thread-safe: the policy
    service runs in gRPC worker threads, the tick on the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._begun: Counter[str] = Counter()
        self._ended: Counter[str] = Counter()

    @contextmanager
    def updating(self, job_id: str) -> Iterator[None]:
        """Wrap the store write of a new policy version of `job_id`."""
        with self._lock:
            self._begun[job_id] += 1
        try:
            yield
        finally:  # a failed write ends too: it only made a tick drop a start for nothing
            with self._lock:
                self._ended[job_id] += 1

    def mark(self) -> Mapping[str, int]:
        """Taken before a tick reads the jobs."""
        with self._lock:
            return dict(self._ended)

    def changed_since(self, mark: Mapping[str, int], job_id: str) -> bool:
        """True when an update of `job_id` began that had not ended at `mark`."""
        with self._lock:
            return self._begun[job_id] > mark.get(job_id, 0)
