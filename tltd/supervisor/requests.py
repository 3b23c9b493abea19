"""The live rollout requests: recovery after a crash, streams, and finishing or failing samples.

Every accepted request ends COMPLETED, CANCELLED or FAILED with a reason; a sample no worker
will report (cancelled, drained, its workers lost too often) is stored partial with no tokens,
so the store and the streams always account for all `samples_total`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tltd.domain import (
    ENDED_STATUSES,
    OPEN_STATUSES,
    FinishReason,
    JobStatus,
    RequestStatus,
    RolloutRequest,
    Sample,
)
from tltd.errors import TltError
from tltd.settings import Settings
from tltd.supervisor.writes import OrderedWrites, add_samples, final_status
from tltd.workqueue import Key, LiveRequest, WorkQueue

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# Backoff of a final status write that failed (seconds, doubling).
_FINAL_RETRY_FIRST, _FINAL_RETRY_MAX = 0.1, 5.0


@dataclass(frozen=True)
class StreamEvent:
    """What a Generate stream receives: a stored sample, or (sample None) the request's end."""

    sample: Sample | None = None
    status: RequestStatus | None = None
    reason: str = ""


class RolloutRequests:
    """The work queue of live requests, their subscribers, and how their samples end."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        writes: OrderedWrites,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        kick: Callable[[], None],
    ) -> None:
        self.store = store
        self.settings = settings
        self.queue = WorkQueue()
        self._writes = writes
        self._spawn = spawn
        self._kick = kick
        self._subs: dict[str, list[asyncio.Queue[StreamEvent]]] = {}
        self._finalizing: set[str] = set()

    # ---- streams ----------------------------------------------------------------------------

    def subscribe(self, request_id: str) -> asyncio.Queue[StreamEvent]:
        q: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._subs.setdefault(request_id, []).append(q)
        return q

    def unsubscribe(self, request_id: str, q: asyncio.Queue[StreamEvent]) -> None:
        subs = self._subs.get(request_id, [])
        if q in subs:
            subs.remove(q)
        if not subs:
            self._subs.pop(request_id, None)

    def publish(self, request_id: str, event: StreamEvent) -> None:
        for q in self._subs.get(request_id, []):
            q.put_nowait(event)

    # ---- admission and recovery ---------------------------------------------------------------

    async def submit(
        self,
        req: RolloutRequest,
        policy_version: int,
        refuse: Callable[[str, int], tuple[FinishReason, str] | None] = lambda j, v: None,
        *,
        created: bool = False,
    ) -> bool:
        """Make a stored request live (idempotent: a live request is left as it is). Samples
        already stored complete are not run again; a terminal request just ends its streams.
        `refuse(job_id, policy_version)` names why a new request can never run (a drain, a
        version that failed to load): it then fails at once, its streams end with the reason.
        True when the request was (re)queued, so there may be work to schedule. `created`: the
        caller has just stored `req`, which then has no samples yet (nothing is read again)."""
        if self.queue.get(req.request_id) is not None:
            return False
        cur = req
        if not created:
            cur = await asyncio.to_thread(self.store.get_request, req.request_id)
        if cur.status in ENDED_STATUSES:
            self.publish(cur.request_id, StreamEvent(None, cur.status, cur.status_reason))
            return False
        samples = (
            [] if created else await asyncio.to_thread(self.store.list_samples, cur.request_id)
        )
        done = {(s.prompt_index, s.sample_index) for s in samples if not s.partial}
        live, created = self.queue.add(cur, policy_version, done, time.monotonic())
        # Checked right after `add`, with no await between: a drain that began while the
        # store was read has already looked at the queue and would never see this request.
        refused = refuse(cur.job_id, policy_version) if created and not live.done else None
        if refused is not None:
            finish, why = refused
            keys = self.queue.close(cur.request_id, RequestStatus.FAILED, why)
            await self.finish_unstarted(live, keys, finish, why)
            return False
        if created and live.done:
            self._spawn(self.finalize(live))
        return True

    async def recover(self) -> None:
        """After a crash: every open request is re-queued with its missing samples; one of a
        job no longer active ends as that job's live requests do (CANCELLED with the job's
        reason, or FAILED), its missing samples stored partial."""
        open_reqs = await asyncio.to_thread(
            self.store.list_requests, list(OPEN_STATUSES), None, 1 << 30
        )
        for req in open_reqs:
            await self._recover_request(req)

    async def _recover_request(self, req: RolloutRequest) -> None:
        job = await asyncio.to_thread(self.store.get_job, req.job_id)
        samples = await asyncio.to_thread(self.store.list_samples, req.request_id)
        if job.status is not JobStatus.ACTIVE:
            # Ended as a live request of that job ends (a crash in the middle of CancelJob
            # left it open): its missing samples stored partial, then its status.
            if job.status is JobStatus.CANCELLED:
                status, finish = RequestStatus.CANCELLED, FinishReason.CANCELLED
                why = f"job cancelled: {job.status_reason}"
            else:
                status, finish = RequestStatus.FAILED, FinishReason.FAILED
                why = f"daemon restarted: job {job.job_id} is {job.status.value}"
            have = {(s.prompt_index, s.sample_index) for s in samples}
            missing = [
                Sample(
                    req.request_id,
                    p,
                    s,
                    (),
                    (),
                    finish,
                    policy_version=req.policy_version,
                    partial=True,
                    error=why,
                )
                for p in range(len(req.prompts))
                for s in range(req.sampling.n)
                if (p, s) not in have
            ]
            await self._writes.write(add_samples, self.store, missing)
            await self._writes.write(self.store.set_request_status, req.request_id, status, why)
            return
        complete = [s for s in samples if not s.partial]
        done = {(s.prompt_index, s.sample_index) for s in complete}
        if req.status is RequestStatus.RUNNING:
            missing = req.samples_total - len(done)
            await self._writes.write(
                self.store.set_request_status,
                req.request_id,
                RequestStatus.QUEUED,
                f"daemon restarted: {missing} of {req.samples_total} samples re-queued",
            )
            req = replace(req, status=RequestStatus.QUEUED)
        # On the version it was accepted on (stored with it), whether or not a sample finished
        # before the crash: the job may have a newer one by now.
        live, _ = self.queue.add(req, req.policy_version, done, time.monotonic())
        log.info(
            "request recovered",
            extra={"request_id": req.request_id, "missing": req.samples_total - len(done)},
        )
        if live.done:
            self._spawn(self.finalize(live))

    # ---- samples that end without a worker's report --------------------------------------------

    async def retry_sample(self, live: LiveRequest, key: Key) -> None:
        """A sample that could not be stored runs again (counts as a lost attempt)."""
        if self.queue.requeue(live.request_id, key, self.settings.max_sample_attempts):
            await self.finish_unstarted(live, [key], FinishReason.FAILED, "cannot store sample")
        self._kick()

    async def lose_worker(self, worker_id: str, why: str) -> None:
        """A worker is gone: its samples are re-queued, or end when out of attempts or when
        their request was already closed (cancelled, drained)."""
        n = self.settings.max_sample_attempts
        for live, key in self.queue.lose_worker(worker_id, n):
            if live.outcome is RequestStatus.CANCELLED:
                reason, error = FinishReason.CANCELLED, live.reason
            elif live.outcome is RequestStatus.FAILED:
                reason, error = FinishReason.ABORTED, live.reason
            else:
                reason, error = FinishReason.FAILED, f"{n} workers lost running it: {why}"
            try:  # one request's failure must not leave the worker's other samples nowhere
                await self.finish_unstarted(live, [key], reason, error)
            except Exception:
                log.exception("cannot finish a lost sample", extra={"request_id": live.request_id})

    def fail_version(self, job_id: str, policy_version: int, reason: str) -> None:
        """Fail every live request of a policy version that cannot be loaded."""
        for live in list(self.queue):
            if live.job_id == job_id and live.policy_version == policy_version:
                keys = self.queue.close(live.request_id, RequestStatus.FAILED, reason)
                self._spawn(self.finish_unstarted(live, keys, FinishReason.FAILED, reason))

    async def finish_unstarted(
        self, live: LiveRequest, keys: list[Key], reason: FinishReason, error: str
    ) -> None:
        """Finish samples no worker will report: store them (partial, no tokens), stream them."""
        samples = [
            Sample(
                live.request_id,
                p,
                s,
                (),
                (),
                reason,
                policy_version=live.policy_version,
                partial=True,
                error=error,
            )
            for p, s in keys
        ]
        if samples:
            try:
                await self._writes.write(add_samples, self.store, samples)
            except Exception:
                # Finish them in memory anyway (streamed with their reason), or the request
                # would never complete.
                rid = live.request_id
                log.exception("cannot store unstarted samples", extra={"request_id": rid})
        for sample in samples:
            key = (sample.prompt_index, sample.sample_index)
            failed = error if reason is FinishReason.FAILED else None
            if self.queue.finish(live.request_id, key, failed) is not None:
                self.publish(live.request_id, StreamEvent(sample))
        if live.done:
            await self.finalize(live)

    async def finalize(self, live: LiveRequest) -> None:
        """Every sample is accounted for: record the request's final status, end the streams.

        A store error (a locked SQLite, a lost PostgreSQL connection) leaves the request live
        with its streams open while the write is retried beside the loop: a stream is never
        told a status the store does not have. At shutdown the retry stops; the next start's
        recovery finalizes it."""
        rid = live.request_id
        if rid in self._finalizing:
            return
        self._finalizing.add(rid)
        total = live.req.samples_total
        if live.outcome is not None:
            status, reason = live.outcome, live.reason
        elif live.failed:
            status = RequestStatus.FAILED
            reason = f"{live.failed} of {total} samples failed: {live.first_error}"
        else:
            status, reason = RequestStatus.COMPLETED, f"all {total} samples finished"
        ended = True
        try:
            final = await self._writes.write(final_status, self.store, rid, status, reason)
            status, reason = final.status, final.status_reason
        except TltError:
            raise
        except Exception:
            log.exception("cannot store the final status, retrying", extra={"request_id": rid})
            ended = False
            self._spawn(self._retry_final(live, status, reason))
        finally:
            if ended:
                self._end(rid, status, reason)

    async def _retry_final(self, live: LiveRequest, status: RequestStatus, reason: str) -> None:
        """Retry a final status write until it lands, backing off up to `_FINAL_RETRY_MAX`
        seconds; each try is queued behind the other writes, so none of them waits on it."""
        rid, delay = live.request_id, _FINAL_RETRY_FIRST
        while True:
            await asyncio.sleep(delay)
            try:
                final = await self._writes.write(final_status, self.store, rid, status, reason)
            except TltError:
                self._end(rid, status, reason)
                raise
            except Exception as exc:
                log.warning("final status still not stored: %s", exc, extra={"request_id": rid})
                delay = min(2 * delay, _FINAL_RETRY_MAX)
                continue
            self._end(rid, final.status, final.status_reason)
            return

    def _end(self, request_id: str, status: RequestStatus, reason: str) -> None:
        self.queue.remove(request_id)
        self._finalizing.discard(request_id)
        self.publish(request_id, StreamEvent(None, status, reason))
        self._kick()
