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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tltd.domain import (
    ENDED_STATUSES,
    OPEN_STATUSES,
    FinishReason,
    Job,
    JobStatus,
    RequestStatus,
    RolloutRequest,
    Sample,
)
from tltd.errors import Fenced, NotFound, TltError
from tltd.metrics import METRICS
from tltd.settings import Settings
from tltd.store.leases import Claim, ClaimedState, UnitEnd
from tltd.store.rollout_requests import running_on
from tltd.supervisor.work_queue import Key, RequestLedger, WorkQueue
from tltd.supervisor.writes import OrderedWrites, WritesClosed, add_samples

# A prompt's most recent stored answers handed to the history drafter when the prompt is
# claimed (two epochs of n = 8).
HISTORY_SAMPLES = 16

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# Backoff of a final status write that failed (seconds, doubling).
_FINAL_RETRY_FIRST, _FINAL_RETRY_MAX = 0.1, 5.0


@dataclass(frozen=True)
class StreamEvent:
    """What a Generate stream receives: a stored sample, or (sample None) a reason to read
    the store again: the request's end here (status set), or a notification from another
    node (status None)."""

    sample: Sample | None = None
    status: RequestStatus | None = None
    reason: str = ""
    # The store recorded the request ended with no unit open (nothing more will be stored).
    final: bool = False
    # Every unit of the request was recorded done by this node: each sample's last stored form
    # reached this node's streams (as an event, or in a read after its unit was claimed).
    here: bool = False


# A request's RUNNING is written once it has run this long here (see `_record_start`).
START_SETTLE_SECONDS = 0.05


class LiveRequests:
    """The live requests of this node: their work queue (changed here only; the others read
    it), their subscribers, and how their samples end."""

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
        self._finalizing: set[tuple[str, int]] = set()  # units whose record is being written

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

    def holds_every_unit(self, request_id: str) -> bool:
        """Every prompt of the request is a unit live here or one this node recorded done."""
        live = self.queue.get(request_id)
        return live is not None and len(live.units | live.recorded) == len(live.req.prompts)

    def wake_streams(self) -> None:
        """Every stream here reads the store and the node's state again."""
        for subs in self._subs.values():
            for q in subs:
                q.put_nowait(StreamEvent())

    # ---- samples handed out and back ----------------------------------------------------------

    def take(
        self, request_id: str, prompt_index: int, count: int, worker_id: str
    ) -> tuple[RequestLedger | None, list[int]]:
        """Hand up to `count` waiting samples of a prompt to `worker_id`: the request and the
        sample indices (none when it is not live or closing). The first samples handed out
        make the request RUNNING, once it has run `START_SETTLE_SECONDS`."""
        live = self.queue.get(request_id)
        taken = self.queue.take(request_id, prompt_index, count, worker_id)
        if live is not None and taken and not live.started:
            live.started = True
            asyncio.get_running_loop().call_later(
                START_SETTLE_SECONDS, self._record_start, request_id, running_on(worker_id)
            )
        return live, taken

    def _record_start(self, request_id: str, reason: str) -> None:
        """A request started here and still live: RUNNING (`mark_running`). One that ended
        meanwhile recorded its start with its samples (`store.sample_batches.store`): a short
        request then takes no transaction of its own for it."""
        if self._start_unwritten(request_id):
            self._writes.write_nowait(self._write_start, request_id, reason, request=request_id)

    def _start_unwritten(self, request_id: str) -> bool:
        live = self.queue.get(request_id)
        return live is not None and not live.start_written

    def _write_start(self, request_id: str, reason: str) -> bool:
        """The writer's thread, maybe a while later under load: a request whose samples have
        recorded its start (or that ended) meanwhile takes no transaction for it."""
        if not self._start_unwritten(request_id):
            return False
        return self.store.requests.mark_running(request_id, reason)

    def stored(self, sample: Sample, end: UnitEnd | None = None) -> RequestLedger | None:
        """A worker's sample is stored: it is finished here and streamed, and a unit it
        completes is recorded (`end`: the sample's transaction recorded it already). None
        when it is not live here or a duplicate."""
        key = (sample.prompt_index, sample.sample_index)
        failed = None
        if sample.finish_reason is FinishReason.FAILED:
            failed = sample.error or "failed"
        live = self.queue.finish(sample.request_id, key, failed, sample.reused_tokens)
        if live is None:
            return None
        self.publish(live.request_id, StreamEvent(sample))
        if live.unit_complete(key[0]):
            if end is not None and (live.request_id, key[0]) not in self._finalizing:
                self._recorded(live, key[0], end)
            if live.complete_units():  # complete and not recorded yet
                self._spawn(self.finalize(live))
        return live

    async def close(
        self,
        request_id: str,
        status: RequestStatus,
        reason: str,
        cancel: Callable[[str, str], None],
    ) -> None:
        """Stop a live request (CANCELLED or FAILED): `cancel(worker, request)` for each
        worker running its samples (they come back with the tokens so far); the waiting ones
        end now."""
        live = self.queue.get(request_id)
        if live is None:
            return
        keys = self.queue.close(request_id, status, reason)
        for wid in set(live.running.values()):
            cancel(wid, request_id)
        cancelled = status is RequestStatus.CANCELLED
        finish = FinishReason.CANCELLED if cancelled else FinishReason.ABORTED
        await self.finish_unstarted(live, keys, finish, reason)

    async def fail_all(self, reason: str) -> None:
        """A drain's end: every live request FAILED, its waiting samples ABORTED (running ones
        come back from the draining workers)."""
        for live in list(self.queue):
            keys = self.queue.close(live.request_id, RequestStatus.FAILED, reason)
            try:  # one request's failure must not keep the others open
                await self.finish_unstarted(live, keys, FinishReason.ABORTED, reason)
            except Exception:
                log.exception(
                    "cannot close a drained request", extra={"request_id": live.request_id}
                )

    # ---- claimed work units -----------------------------------------------------------------

    async def take_claims(
        self,
        claims: list[Claim],
        state: ClaimedState | Exception,
        refuse: Callable[[str, int], tuple[FinishReason, str] | None] = lambda j, v: None,
    ) -> None:
        """Make units this node just claimed live with their missing samples (stored ones are
        not run again: a takeover re-runs only what the lost node did not store, with the
        request's stored seed). A unit claimed more than `max_sample_attempts` times, one of a
        request that ended or whose job is no longer active, or one `refuse` names a reason
        for (a drain, a version that failed to load) ends at once, its missing samples
        stored partial."""
        by_request: dict[str, list[Claim]] = {}
        for c in claims:
            by_request.setdefault(c.request_id, []).append(c)
        if isinstance(state, Exception):  # not live here: their leases lapse, claimed again
            log.error(
                "cannot read claimed units: claimed again once their leases lapse",
                exc_info=state,
            )
            return
        for rid, units in by_request.items():
            try:
                if rid not in state:
                    raise NotFound(f"rollout request {rid!r} not found", field="request_id")
                await self._take(state[rid], units, refuse)
            except Exception:  # not renewed (not live here): its lease lapses, it is claimed again
                log.exception(
                    "cannot take a claimed unit: claimed again once its lease lapses",
                    extra={"request_id": rid, "prompts": [c.prompt_index for c in units]},
                )

    async def _take(
        self,
        state: tuple[RolloutRequest, Job, set[Key], set[Key]],
        claims: list[Claim],
        refuse: Callable[[str, int], tuple[FinishReason, str] | None],
    ) -> None:
        req, job, complete, partial = state
        rid = req.request_id
        done = set(complete)
        if req.status in ENDED_STATUSES:
            # Ended elsewhere (a cancel) while this unit was queued or held by a lost node.
            done |= partial
        units = {c.prompt_index for c in claims}
        history = await self._history(req, job, units)  # read before the units can be assigned
        live, _ = self.queue.add(req, req.policy_version, done, time.monotonic(), units)
        live.history.update(history)
        # Units claimed before by a node that lost them may have checkpoints to go on from;
        # a paused or drained sample's tokens so far are stored partial.
        lost = {c.prompt_index for c in claims if c.attempts > 1}
        if partial - done or lost:
            resume = await self._resumable(rid, units, lost, done)
            live.resume.update(resume)
            if resume:
                log.info(
                    "samples resumed from their stored tokens",
                    extra={"request_id": rid, "samples": len(resume)},
                )
        if done:  # stored before (by a node that lost them): streams here read them
            self.publish(rid, StreamEvent())
        # Debug, not info: a line per request is what agentic traffic (hundreds of short
        # requests a second) cannot afford; the request's events record where it ran.
        log.debug("units claimed", extra={"request_id": rid, "prompts": sorted(units)})
        closing = self._closing(req, job.status, job.status_reason, refuse)
        if closing is not None:
            status, finish, why = closing
            keys = self.queue.close(rid, status, why)
            await self.finish_unstarted(live, keys, finish, why)
            return
        n = self.settings.max_sample_attempts
        for c in claims:
            if c.attempts > n:
                why = f"claimed {c.attempts - 1} times by nodes that lost it (limit {n})"
                keys = [(c.prompt_index, s) for s in live.pending.get(c.prompt_index, [])]
                await self.finish_unstarted(live, keys, FinishReason.FAILED, why)
        if live.complete_units():
            await self.finalize(live)

    async def _resumable(
        self, rid: str, units: set[int], lost: set[int], done: set[Key]
    ) -> dict[Key, Sample]:
        """The unfinished samples of `units` to go on from, not in `done`, per sample the
        longest stored: a paused or drained sample's partial form, or (units of `lost`) a
        running sample's checkpoint. None if the store cannot be read now: they run again
        from their seeds."""

        def read() -> list[tuple[str, Sample]]:
            stored = self.store.samples.resumable(rid, sorted(units))
            saved = self.store.checkpoints.of_units(rid, sorted(lost)) if lost else []
            return [("partial", x) for x in stored] + [("checkpoint", x) for x in saved]

        try:
            found = await asyncio.to_thread(read)
        except Exception:
            log.warning("cannot read stored tokens: run again", exc_info=True)
            return {}
        best: dict[Key, tuple[str, Sample]] = {}
        for source, sample in found:
            k = (sample.prompt_index, sample.sample_index)
            if k not in done and (
                k not in best or len(sample.token_ids) > len(best[k][1].token_ids)
            ):
                best[k] = (source, sample)
        for source, _ in best.values():
            METRICS.samples_resumed.labels(source).inc()
        return {k: sample for k, (_, sample) in best.items()}

    async def _history(
        self, req: RolloutRequest, job: Job, units: set[int]
    ) -> dict[int, tuple[tuple[tuple[str, int, int], tuple[int, ...]], ...]]:
        """The job's earlier answers to each claimed prompt, for the history drafter: none when
        the job does not draft from history, or for a prompt the store cannot read now (drafts
        only: the samples run all the same)."""
        if not job.speculative.drafts_from_history:
            return {}
        out = {}
        for p in sorted(units):
            try:
                out[p] = tuple(
                    await asyncio.to_thread(
                        self.store.samples.prompt_history,
                        req.job_id,
                        req.prompts[p],
                        HISTORY_SAMPLES,
                    )
                )
            except Exception:
                log.warning(
                    "cannot read a prompt's history: it runs without",
                    extra={"request_id": req.request_id, "prompt_index": p},
                    exc_info=True,
                )
        return out

    @staticmethod
    def _closing(
        req: RolloutRequest,
        job_status: JobStatus,
        job_reason: str,
        refuse: Callable[[str, int], tuple[FinishReason, str] | None],
    ) -> tuple[RequestStatus, FinishReason, str] | None:
        """How a claimed unit of a request that cannot run ends, if it cannot."""
        if req.status is RequestStatus.CANCELLED:
            return RequestStatus.CANCELLED, FinishReason.CANCELLED, req.status_reason
        if req.status in ENDED_STATUSES:
            return req.status, FinishReason.ABORTED, req.status_reason
        if job_status is JobStatus.CANCELLED:
            why = f"job cancelled: {job_reason}"
            return RequestStatus.CANCELLED, FinishReason.CANCELLED, why
        if job_status is not JobStatus.ACTIVE:
            why = f"job {req.job_id} is {job_status.value}"
            return RequestStatus.FAILED, FinishReason.FAILED, why
        refused = refuse(req.job_id, req.policy_version)
        if refused is not None:
            return RequestStatus.FAILED, refused[0], refused[1]
        return None

    async def end_requests_of_ended_jobs(self) -> None:
        """Open requests of a job no longer active (a daemon died in the middle of CancelJob)
        end as that job's live requests do: CANCELLED with the job's reason, or FAILED; their
        units no node holds end at once, the others when their node renews or loses them."""
        open_reqs = await asyncio.to_thread(
            self.store.requests.list, list(OPEN_STATUSES), None, 1 << 30
        )
        jobs: dict[str, tuple[JobStatus, str]] = {}
        for req in open_reqs:
            if req.job_id not in jobs:
                job = await asyncio.to_thread(self.store.jobs.get, req.job_id)
                jobs[req.job_id] = (job.status, job.status_reason)
            closing = self._closing(req, *jobs[req.job_id], lambda j, v: None)
            if closing is None:
                continue
            status, finish, why = closing
            try:
                rid = req.request_id
                await self._writes.write(
                    self.store.requests.set_status, rid, status, why, request=rid
                )
                await self._writes.write(
                    self.store.leases.end_queued_units, rid, finish, why, request=rid
                )
            except TltError:
                log.info("request ended meanwhile", extra={"request_id": req.request_id})

    def release(self, units: set[tuple[str, int]]) -> None:
        """Give units held here back to the queue (ordered behind the writes before)."""
        for rid, p in sorted(units):
            self._writes.write_nowait(self.store.leases.release_unit, rid, p, request=rid)

    def lose_units(
        self, lost: set[tuple[str, int]], why: str = "unit lease lost", level: int = logging.WARNING
    ) -> list[tuple[str, str]]:
        """Units whose lease this node lost (expired, taken over, an old epoch): forget them,
        writing nothing (the store would refuse it). Returns (worker, request) pairs whose
        samples must be cancelled on the worker; the caller also releases the request's other
        units here, since a worker cancels by request."""
        cancels = []
        for rid, p in sorted(lost):
            live = self.queue.get(rid)
            if live is None or p not in live.units:
                continue  # recorded done meanwhile (the renewal read the queue before)
            if (rid, p) in self._finalizing:
                continue  # being recorded: that write is fenced or lands, either way it ends
            for wid in self.queue.drop_unit(rid, p):
                cancels.append((wid, rid))
            log.log(level, why, extra={"request_id": rid, "prompt_index": p})
        return cancels

    # ---- samples that end without a worker's report --------------------------------------------

    async def retry_sample(self, live: RequestLedger, key: Key) -> None:
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
        self, live: RequestLedger, keys: list[Key], reason: FinishReason, error: str
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
                await self._writes.write(add_samples, self.store, samples, request=live.request_id)
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
        if live.complete_units():
            await self.finalize(live)

    async def finalize(self, live: RequestLedger) -> None:
        """Record every complete unit of `live` done; the last unit of a request records its
        final status too (`WorkLeases.finish_unit`), and then its streams here end.

        A store error leaves the unit live while the write is retried beside the loop: a
        stream is never told a status the store does not have. At shutdown the retry stops;
        the lease then expires and another claim records it. A unit the store says is no
        longer ours (Fenced) is forgotten: its new owner records it.

        The complete units are read again after each write: while this call waits, another
        call (or a retry) may record a unit, and that unit must not be recorded twice."""
        rid, tried = live.request_id, set[int]()
        while True:
            todo = [
                p
                for p in live.complete_units()
                if p not in tried and (rid, p) not in self._finalizing
            ]
            if not todo:
                return
            p = todo[0]
            unit = (rid, p)
            tried.add(p)
            self._finalizing.add(unit)
            try:
                await self._finish_unit(live, p)
            except Exception:
                log.exception("cannot record a unit, retrying", extra={"request_id": unit[0]})
                self._spawn(self._retry_unit(live, p))

    async def _finish_unit(self, live: RequestLedger, p: int) -> None:
        rid = live.request_id
        try:
            end = await self._writes.write(
                self.store.leases.finish_unit, rid, p, live.outcome, live.reason, request=rid
            )
        except (Fenced, NotFound) as exc:
            log.warning("unit not recorded: %s", exc, extra={"request_id": rid})
            self._drop(rid, p)
            return
        except WritesClosed:
            # Stopping: the unit's lease expires and the node that claims it next records it.
            log.info("unit not recorded: the daemon is stopping", extra={"request_id": rid})
            return
        self._recorded(live, p, end)

    def _recorded(self, live: RequestLedger, p: int, end: UnitEnd) -> None:
        """Unit `p` of `live` is recorded done in the store, `end` what that write said: it
        leaves the queue, and once the request ended its streams here are told."""
        rid = live.request_id
        if end.status is not RequestStatus.QUEUED:
            live.start_written = True
        self._drop(rid, p, recorded=True)
        if end.status in ENDED_STATUSES:
            here = len(live.recorded) == len(live.req.prompts)
            self.publish(rid, StreamEvent(None, end.status, end.reason, end.left == 0, here))

    async def _retry_unit(self, live: RequestLedger, p: int) -> None:
        """Retry a unit's write until it lands, backing off up to `_FINAL_RETRY_MAX` seconds;
        each try is queued behind the other writes, so none of them waits on it."""
        delay = _FINAL_RETRY_FIRST
        while True:
            await asyncio.sleep(delay)
            try:
                await self._finish_unit(live, p)
                return
            except Exception as exc:
                rid = live.request_id
                log.warning("unit still not recorded: %s", exc, extra={"request_id": rid})
                delay = min(2 * delay, _FINAL_RETRY_MAX)

    def _drop(self, request_id: str, p: int, recorded: bool = False) -> None:
        self.queue.drop_unit(request_id, p, recorded)
        self._finalizing.discard((request_id, p))
        if self.queue.waiting():  # else nothing to place now: the periodic tick does the rest
            self._kick()
