"""Pausing a job's generation, as trainers pause an inference server around a weight update:
new requests wait at admission until resumed, and the requests already in flight are frozen
in place (keep: their workers stop stepping until the resume, then they continue from the
token they stood at), waited for, or cancelled (their samples end partial with finish reason
`cancelled`, which the HTTP door returns as `abort` so the trainer resubmits).

The pause is the job's, on every node: it is a row of the store, which each node's admission
reads, so a trainer that pauses one node's door holds new requests arriving at any node. A
held request on another node sees a resume within `POLL_SECONDS`; on the node that resumed,
at once."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tltd.domain import RequestStatus
from tltd.errors import FailedPrecondition, InvalidArgument, Unavailable

if TYPE_CHECKING:
    from tltd.store import Store

Cancel = Callable[[str, str], object]  # RolloutService.cancel: (request id, reason)
# Supervisor.apply_pauses: (job id, timeout) -> this node's workers of the job now frozen
ApplyPauses = Callable[[str, float], Awaitable[int]]

_OPEN = (RequestStatus.QUEUED, RequestStatus.RUNNING)
_MAX_WAIT = 3600.0
POLL_SECONDS = 0.2  # how often a held request reads the store for a resume made elsewhere


class PauseMode(enum.StrEnum):
    KEEP = "keep"  # in-flight requests freeze in place until resumed; new ones wait
    WAIT = "wait"  # in-flight requests go on; the call returns once the job has none open
    ABORT = "abort"  # in-flight requests are cancelled; new ones wait


class PauseService:
    """Per-job pause state, kept in the store for every node. `is_paused` and `abort_open`
    read the store (call them off the event loop); `pause`, `resume` and `wait_open` run on
    the daemon's loop. `apply` (the supervisor's; None without workers) freezes and thaws
    this node's workers as the store says."""

    def __init__(self, store: Store, cancel: Cancel, apply: ApplyPauses | None = None) -> None:
        self.store = store
        self.cancel = cancel
        self.apply = apply
        self._resumed: dict[str, asyncio.Event] = {}  # job id -> set by a resume here
        self._held: dict[str, int] = {}  # job id -> requests waiting in `wait_open` here
        self.frozen_workers: dict[str, int] = {}  # job id -> workers its last keep froze here

    def held(self, job_id: str) -> int:
        """New requests of the job waiting at admission on this node now."""
        return self._held.get(job_id, 0)

    def is_paused(self, job_id: str) -> bool:
        return self.store.jobs.is_paused(job_id)

    async def pause(self, job_id: str, mode: PauseMode, timeout: float = 600.0) -> int:
        """Hold new requests of `job_id` on every node; returns how many open requests were
        cancelled (abort), waited for (wait) or are kept frozen (keep). Keep returns once
        this node's workers of the job stopped stepping (other nodes' at their next tick)."""
        if not 0 < timeout <= _MAX_WAIT:
            raise InvalidArgument(f"must be in (0, {_MAX_WAIT:.0f}] seconds", field="timeout")
        await asyncio.to_thread(self.store.jobs.set_paused, job_id, mode.value)
        frozen = await self.apply(job_id, timeout) if self.apply is not None else 0
        self.frozen_workers[job_id] = frozen
        if mode is PauseMode.ABORT:
            return await asyncio.to_thread(self.abort_open, job_id, "aborted by a pause")
        if mode is PauseMode.WAIT:
            return await self._drain(job_id, timeout)
        return len(await asyncio.to_thread(self.store.requests.list, _OPEN, job_id, None))

    async def resume(self, job_id: str) -> bool:
        """Let held requests in and frozen ones go on, on every node; False when the job was
        not paused."""
        was = await asyncio.to_thread(self.store.jobs.set_paused, job_id, None)
        gate = self._resumed.pop(job_id, None)
        if gate is not None:
            gate.set()  # this node's held requests go at once; others' at their next read
        self.frozen_workers.pop(job_id, None)
        if self.apply is not None:
            await self.apply(job_id, _MAX_WAIT)  # thaws: nothing to wait for
        return was

    async def wait_open(self, job_id: str) -> None:
        """Return once `job_id` is not paused (at once when it is not)."""
        self._held[job_id] = self._held.get(job_id, 0) + 1
        try:
            while await asyncio.to_thread(self.store.jobs.is_paused, job_id):
                gate = self._resumed.setdefault(job_id, asyncio.Event())
                try:  # asyncio.timeout: wait_for (3.11) can swallow a cancel of the caller
                    async with asyncio.timeout(POLL_SECONDS):
                        await gate.wait()
                except TimeoutError:
                    pass  # read the store again: a resume may have come through another node
        finally:
            self._held[job_id] -= 1
            if not self._held[job_id]:
                del self._held[job_id]

    def abort_open(self, job_id: str, reason: str, request_id: str | None = None) -> int:
        """Cancel the job's open requests (or the one named); returns how many."""
        if request_id:
            open_ids = [request_id]
        else:
            open_ids = [r.request_id for r in self.store.requests.list(_OPEN, job_id, None)]
        cancelled = 0
        for rid in open_ids:
            try:
                self.cancel(rid, reason)
                cancelled += 1
            except FailedPrecondition:
                pass  # it ended meanwhile: nothing to abort
        return cancelled

    async def _drain(self, job_id: str, timeout: float) -> int:
        """Wait until the job has no open request; the number there were at the start."""
        first = None
        deadline = time.monotonic() + timeout
        while True:
            open_now = await asyncio.to_thread(self.store.requests.list, _OPEN, job_id, None)
            first = len(open_now) if first is None else first
            if not open_now:
                return first
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"job {job_id} still has {len(open_now)} open requests after "
                    f"{timeout:.0f} s (it stays paused)"
                )
            await asyncio.sleep(0.05)
