"""Rollout use cases: validate and submit generation requests, read and cancel stored ones."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

from tltd.domain import (
    DRAINED_REASON,
    ENDED_STATUSES,
    Backend,
    Device,
    DeviceState,
    FinishReason,
    Job,
    JobStatus,
    LogprobMode,
    RequestProgress,
    RequestStatus,
    RolloutRequest,
    Sample,
    SpeculativeMode,
)
from tltd.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TltError,
    Unavailable,
    Unimplemented,
)
from tltd.metrics import METRICS
from tltd.services.bounded import Taken, follow_bounded, wait_for_staleness
from tltd.services.checkpoints import model_limits
from tltd.services.group_commit import GroupCommit
from tltd.services.node import NodeState
from tltd.services.validation import MAX_REASON, check_id, check_text, validate_rollout
from tltd.settings import Settings
from tltd.store import JobPaused
from tltd.store.rollout_requests import Created

if TYPE_CHECKING:
    from tltd.services.pause import PauseService
    from tltd.store import Store
    from tltd.supervisor import Supervisor
    from tltd.supervisor.live_requests import StreamEvent


def derived_seed(request_id: str) -> int:
    """The seed of a request that gave none: fixed by its id, so that a retried or re-queued
    sample reproduces the same tokens."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


class RolloutService:
    def __init__(
        self,
        store: Store,
        settings: Settings,
        node: NodeState,
        supervisor: Supervisor | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.node = node
        self.supervisor = supervisor
        self.pauses: PauseService | None = None  # set by build_services
        self._admissions = GroupCommit(store.batch)

    def prepare(
        self, req: RolloutRequest, speculative: SpeculativeMode | None = None
    ) -> RolloutRequest:
        """`_prepared`'s request."""
        return self._prepared(req, speculative)[0]

    def _prepared(
        self, req: RolloutRequest, speculative: SpeculativeMode | None = None
    ) -> tuple[RolloutRequest, Job]:
        """Validate a request against the daemon's limits and its job; resolve defaults. The
        job is returned as read (a moment old, see `_job_and_devices`).

        Order matters for callers: a draining node refuses a new request before anything else
        (the trainer should go elsewhere), then the request's own fields, then the job's state.
        A retry of a stored request attaches even then: its work goes on through the grace.
        """
        if self.node.draining and not self._is_retry(req):
            raise Unavailable("node is draining: not accepting new rollouts")
        validate_rollout(req, self.settings)
        job, devices = self._job_and_devices(req.job_id)
        if job.status is not JobStatus.ACTIVE:
            raise FailedPrecondition(f"job {job.job_id} is {job.status.value}", field="job_id")
        _check_backend_options(req, job)
        # Token ids beyond the vocabulary and contexts beyond the model's positions are only
        # known once the job's model is.
        validate_rollout(req, self.settings, model_limits(job.model_path))
        if (
            self.supervisor is not None
            and not any(d.schedulable for d in devices)
            and not self._is_retry(req)  # a retry attaches
            and not self.supervisor.others_up()  # another node runs it
        ):
            # Accepted, it would wait with nothing to run it (e.g. devices still flagged by a
            # node drain before a restart): say so, and how to bring a device back.
            raise _no_device(devices)
        prepared = replace(
            req,
            request_id=req.request_id or f"req-{uuid.uuid4().hex}",
            speculative=speculative or job.speculative.mode,
        )
        return prepared, job

    def _job_and_devices(self, job_id: str) -> tuple[Job, list[Device]]:
        """The job and this node's devices: the scheduler's last read while nothing in it can
        have changed (`Supervisor.last_read`), else the store's. Either may be a moment old:
        the request's own transaction checks again that the job is active."""
        read = self.supervisor.last_read() if self.supervisor is not None else None
        if read is not None and job_id in read[1]:
            return read[1][job_id], read[0]
        return self.store.jobs.job_and_devices(job_id)  # NotFound names job_id

    async def generate(
        self,
        req: RolloutRequest,
        speculative: SpeculativeMode | None = None,
        return_partial: bool = False,
    ) -> AsyncIterator[Sample]:
        """`generate_batches`, one sample at a time."""
        batches = self.generate_batches(req, speculative, return_partial)
        try:
            async for samples in batches:
                for sample in samples:
                    yield sample
        finally:
            await batches.aclose()

    async def generate_batches(
        self,
        req: RolloutRequest,
        speculative: SpeculativeMode | None = None,
        return_partial: bool = False,
    ) -> AsyncIterator[list[Sample]]:
        """Stream every sample of the request as it is stored, whichever node runs it, in
        lists of those ready at once (a worker step's samples, a read of the store).

        The request is persisted (QUEUED, one work unit per prompt) before anything runs; any
        node claims its units. A retry with the same request_id, on this node or another,
        attaches to the same work: the samples already stored come first, then the others as
        they are stored, each once, and nothing runs twice. Samples stored on this node
        arrive at once; those stored elsewhere are read from the store every
        `stream_poll_seconds` (not while this node runs every unit of the request). A
        partial sample is sent once the request has ended (until then it may still be run
        again); with `return_partial` it is sent once stored (a drained node's tokens so
        far), and the complete sample that replaces it follows. A request runs on the job's
        policy version current at its acceptance. The stream ends once the request has ended
        and none of its units is open; a request that ends FAILED ends the stream with
        FAILED_PRECONDITION naming the reason, after its partial samples (final: a retry of
        the id gets the same answer). A node that handed its work
        to the other nodes (a drain) ends its streams with UNAVAILABLE after what they had:
        the caller re-attaches on another node. A bounded request (`bound_groups`) streams
        whole groups instead, until its bound (`tltd.services.bounded`).
        """
        started = time.perf_counter()
        sup = self.supervisor
        if sup is None:  # (a request's own faults are named first)
            await asyncio.to_thread(self.prepare, req, speculative)
            raise Unimplemented("this daemon runs no rollout workers")
        if not req.request_id:
            req = replace(req, request_id=f"req-{uuid.uuid4().hex}")
        rid = req.request_id
        # Subscribe before anything is stored: a sample stored here is then either read from
        # the store or received on the subscription (or both).
        events = sup.subscribe(rid)
        try:
            if req.bound_groups and not await asyncio.to_thread(self._stored, rid):
                # Its own faults are named first; then it waits for its job's staleness bound.
                await asyncio.to_thread(self.prepare, req, speculative)
                await wait_for_staleness(self.store, req, self.settings.bound_poll_seconds)
            stored, created = await self._admit_when_open(req, speculative, sup)
            METRICS.observe_admission(time.perf_counter() - started)
            if stored.bound_groups:  # asynchronous RL: whole groups until the bound
                async for samples in self._follow_bounded(sup, stored, created, events):
                    yield samples
                return
            # A request this call created has nothing stored before the subscription: what
            # this node stores arrives on it, what others store wakes it (or the poll does).
            async for samples in self._follow(sup, stored, not created, events, return_partial):
                yield samples
        finally:
            sup.unsubscribe(rid, events)

    async def _follow_bounded(
        self,
        sup: Supervisor,
        stored: RolloutRequest,
        created: bool,
        events: asyncio.Queue[StreamEvent],
    ) -> AsyncIterator[list[Sample]]:
        """A bounded request's groups until its bound; with `bound_park`, then park the rest,
        unless this call only re-sent what an earlier one sent (that one parked: its prompts
        may run again by now, for a later carried request)."""
        taken, poll = Taken(), self.settings.bound_poll_seconds
        async for samples in follow_bounded(self.store, stored, events, poll, taken):
            yield samples
        if stored.bound_park and (created or taken.groups):
            await sup.park(stored.request_id)

    async def _follow(
        self,
        sup: Supervisor,
        stored: RolloutRequest,
        read: bool,
        events: asyncio.Queue[StreamEvent],
        return_partial: bool,
    ) -> AsyncIterator[list[Sample]]:
        """An admitted request's samples until it ends: read from the store (first when
        `read`), and as they are stored on this node in between; never an empty list."""
        rid, sent = stored.request_id, _Sent(return_partial)
        cursor, poll = 0, self.settings.stream_poll_seconds
        while True:
            cur = RequestProgress.of(stored)
            if read:
                cur, samples, cursor, ended = await self._read_stored(rid, cursor)
                if samples := [x for x in samples if sent.admit(x, ended)]:
                    yield samples
                if ended:
                    _end(rid, cur.status, cur.status_reason)
                    return
            self._check_not_handed_over(sup, rid)
            woken = False
            async for queued in _stored_here(events, poll):
                samples, end = _on_events(queued, sent, cur.samples_total)
                if samples:
                    yield samples
                last = queued[-1]
                if end:
                    _end(rid, last.status, last.reason)
                    return
                woken = woken or last.sample is None
            # While this node runs every unit, what is stored arrives on the subscription: a
            # poll that saw nothing need not read the store; a wake-up (an end, another node's
            # notification, units claimed with samples stored before) reads it. Events already
            # queued (the end recorded with the last unit) come first.
            read = woken or (events.empty() and not sup.runs_every_unit(rid))

    async def _read_stored(
        self, rid: str, cursor: int
    ) -> tuple[RequestProgress, list[Sample], int, bool]:
        """The request's progress, its samples stored after `cursor`, the new cursor, and
        whether it has ended with no unit open (then the samples are all of them: every one
        is final now, also partial samples read before)."""
        cur, open_units, samples, cursor = await asyncio.to_thread(
            self.store.leases.stream_state, rid, cursor
        )
        ended = cur.status in ENDED_STATUSES and open_units == 0
        if ended:
            samples = await asyncio.to_thread(self.store.samples.list, rid)
        return cur, samples, cursor, ended

    def _check_not_handed_over(self, sup: Supervisor, rid: str) -> None:
        """This node is going away and its work goes on elsewhere: the caller re-attaches
        there."""
        if sup.handed_over:
            raise Unavailable(
                f"node {self.store.node_id} is drained and handed its work to the "
                f"other nodes: retry request {rid} there (it re-attaches)"
            )

    async def _admit_when_open(
        self, req: RolloutRequest, speculative: SpeculativeMode | None, sup: Supervisor
    ) -> tuple[RolloutRequest, bool]:
        """Store the request once its job is not paused. A new request of a paused job waits
        here, stored nothing, until the job is resumed (the caller may go away meanwhile); a
        retry of a stored one attaches at once (its work is in flight already). Once in the
        store, admission runs to its end even when the caller goes away (a deadline, a
        disconnect): a request once stored is always claimable."""
        while True:
            try:
                admit = asyncio.ensure_future(self._admit(req, speculative, sup))
                return await asyncio.shield(admit)
            except JobPaused:
                assert self.pauses is not None
                await self.pauses.wait_open(req.job_id)

    async def _admit(
        self, req: RolloutRequest, speculative: SpeculativeMode | None, sup: Supervisor
    ) -> tuple[RolloutRequest, bool]:
        """Validate and store the request (idempotent; JobPaused when its job is paused and it
        is new), with the units this node may run now leased to it in the same transaction
        (`Supervisor.admission_claim`), and hand them to the supervisor (the others are
        claimed at a tick, here or elsewhere); True when this call created it."""
        sup.begin_admission(req.request_id)
        try:
            # The store is synchronous: its I/O runs off the event loop, concurrent
            # admissions in one thread hop and one transaction.
            admitted, job = await self._admissions.run(
                partial(self._prepare_and_store, req, speculative, sup)
            )
            stored = admitted.request
            if stored.status not in ENDED_STATUSES:
                await sup.submit(stored, job, admitted.claims)
        finally:
            sup.end_admission(req.request_id)
        return stored, admitted.created

    def _prepare_and_store(
        self, req: RolloutRequest, speculative: SpeculativeMode | None, sup: Supervisor
    ) -> tuple[Created, Job]:
        """`prepare`, the request's seed (fixed by its id when it gave none), then the store's
        `store.requests.admit` with what this node may lease to itself (`admission_claim`), refused
        while its job is paused (JobPaused)."""
        req, job = self._prepared(req, speculative)
        if req.sampling.seed is None:
            req = replace(req, sampling=replace(req.sampling, seed=derived_seed(req.request_id)))
        claim = sup.admission_claim()
        return self.store.requests.admit(req, self.pauses is not None, claim), job

    def _is_retry(self, req: RolloutRequest) -> bool:
        """The request_id is stored already: a retry, which attaches to its work."""
        if not req.request_id:
            return False
        try:
            check_id(req.request_id, "request_id")
        except InvalidArgument:
            return False  # never stored (and refused by validation)
        return self._stored(req.request_id)

    def _stored(self, request_id: str) -> bool:
        try:
            self.store.requests.get(request_id)
        except NotFound:
            return False
        return True

    def get(
        self, request_id: str, include_samples: bool = False
    ) -> tuple[RolloutRequest, list[Sample]]:
        check_id(request_id, "request_id")
        req = self.store.requests.get(request_id)
        samples = self.store.samples.list(request_id) if include_samples else []
        return req, samples

    def cancel(self, request_id: str, reason: str = "") -> RolloutRequest:
        """Cancel an unfinished request; cancelling a cancelled one is a no-op."""
        check_id(request_id, "request_id")
        check_text(reason, "reason", MAX_REASON)
        req = self.store.requests.get(request_id)
        if req.status is RequestStatus.CANCELLED:
            return req
        if req.status in ENDED_STATUSES:
            raise FailedPrecondition(
                f"request {request_id} already {req.status.value}", field="request_id"
            )
        reason = reason or "cancelled by caller"
        req = self.store.requests.set_status(request_id, RequestStatus.CANCELLED, reason)
        # Units no node holds end here; a node running one stops it at its next renewal.
        self.store.leases.end_queued_units(request_id, FinishReason.CANCELLED, reason)
        if self.supervisor is not None:
            self.supervisor.cancel_threadsafe(request_id, reason)
        return req


def _check_backend_options(req: RolloutRequest, job: Job) -> None:
    """Raw logprobs, per-token provenance, top alternatives and prompt logprobs come from the
    torch engine: another backend returns what its engine computes and cannot say where a
    token came from."""
    if job.backend is Backend.TORCH:
        return
    if req.bound_tokens:
        raise FailedPrecondition(
            f"a step token budget pauses samples in the torch engine; job {job.job_id} runs "
            f"on {job.backend.value}",
            field="bound.max_tokens",
        )
    s = req.sampling
    if s.logprob_mode is not LogprobMode.PROCESSED:
        raise FailedPrecondition(
            f"logprob mode {s.logprob_mode.value} needs the torch backend; job {job.job_id} "
            f"runs on {job.backend.value}",
            field="sampling.logprob_mode",
        )
    if s.return_provenance:
        raise FailedPrecondition(
            f"per-token provenance needs the torch backend; job {job.job_id} runs on "
            f"{job.backend.value}",
            field="sampling.return_provenance",
        )
    for name, asked in (
        ("top_logprobs", s.top_logprobs > 0),
        ("prompt_logprobs", s.prompt_logprobs is not None),
    ):
        if asked:
            raise FailedPrecondition(
                f"{name.replace('_', ' ')} come from the torch engine; job {job.job_id} runs "
                f"on {job.backend.value}",
                field=f"sampling.{name}",
            )


def _no_device(devices: list[Device]) -> TltError:
    """Why no device can run a new request. Devices taken by foreign processes or unreadable
    come back by themselves (an inventory refresh): retryable. Cordoned and draining devices
    need an operator: say how."""
    if not devices:
        return FailedPrecondition("no device found on this node: no GPU seen, and cpu_slots is 0")
    listed = ", ".join(f"{d.device_id} {_flags(d)}" for d in devices)
    if any(not (d.cordoned or d.draining) for d in devices):
        return Unavailable(
            f"no schedulable device: the free ones are taken by foreign processes or "
            f"unavailable ({listed})"
        )
    return FailedPrecondition(
        f"no schedulable device: all cordoned or draining ({listed}); "
        "`tltctl uncordon DEVICE_ID` makes a device schedulable again"
    )


def _flags(d: Device) -> str:
    on = (
        ("cordoned", d.cordoned),
        ("draining", d.draining),
        ("foreign", d.foreign),
        ("unavailable", d.state is DeviceState.UNAVAILABLE),
    )
    return "+".join(name for name, flag in on if flag)


class _Sent:
    """What one Generate stream has sent, by (prompt index, sample index): each sample once,
    the final one; with `return_partial`, a partial one before it as well (once)."""

    def __init__(self, return_partial: bool) -> None:
        self.return_partial = return_partial
        self._partial: set[tuple[int, int]] = set()
        self._final: set[tuple[int, int]] = set()
        self._held: dict[tuple[int, int], Sample] = {}  # the last partial form, not yet final
        self._complete = 0

    @property
    def complete(self) -> int:
        """How many samples were sent final and complete (not partial)."""
        return self._complete

    @property
    def seen(self) -> int:
        """How many samples this stream has seen in some form (final, or partial held)."""
        return len(self._final) + len(self._held)

    def release_held(self) -> list[Sample]:
        """The request ended: the partial samples held back are final; those to send now."""
        held, self._held = list(self._held.values()), {}
        return [sample for sample in held if self.admit(sample, True)]

    def admit(self, sample: Sample, ended: bool) -> bool:
        """True when `sample` is to be sent now (and records it). Before the request ends a
        stored partial sample may still be replaced by its complete one: it is final only
        once the request has ended."""
        key = (sample.prompt_index, sample.sample_index)
        if key in self._final:
            return False
        if not sample.partial or ended:
            self._held.pop(key, None)
            self._final.add(key)
            if sample.partial and key in self._partial:
                return False  # the partial one sent before turned out final
            self._complete += not sample.partial
            return True
        self._held[key] = sample
        if self.return_partial and key not in self._partial:
            self._partial.add(key)
            return True
        return False


def _on_events(events: list[StreamEvent], sent: _Sent, total: int) -> tuple[list[Sample], bool]:
    """`_on_event` for events queued together (only the last may be a wake-up)."""
    out: list[Sample] = []
    for event in events:
        samples, end = _on_event(event, sent, total)
        out += samples
    return out, end


def _on_event(event: StreamEvent, sent: _Sent, total: int) -> tuple[list[Sample], bool]:
    """A sample stored on this node, or a wake-up: the samples to send now, and whether the
    stream ends. It ends when the request ended here with every sample's last form seen on
    this node: the partial ones held back are final then, and nothing is left to read."""
    if event.sample is not None:
        return ([event.sample] if sent.admit(event.sample, False) else []), False
    if event.final and (sent.complete == total or (event.here and sent.seen == total)):
        return sent.release_held(), True
    return [], False


async def _stored_here(
    events: asyncio.Queue[StreamEvent], seconds: float
) -> AsyncIterator[list[StreamEvent]]:
    """The samples stored on this node within `seconds`, as they arrive, all those queued
    at once together (a sample batch's are published together); an event without a sample
    (a request's end, a wake-up) ends the last list yielded. What other nodes store is polled
    instead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        left = deadline - loop.time()
        if left <= 0:
            return
        if events.empty():  # a timer costs: only when there is a wait
            try:  # asyncio.timeout: wait_for (3.11) can swallow the stream's cancel
                async with asyncio.timeout(left):
                    event = await events.get()
            except TimeoutError:
                return
        else:
            event = events.get_nowait()
        queued = [event]
        while event.sample is not None and not events.empty():
            event = events.get_nowait()
            queued.append(event)
        yield queued
        if event.sample is None:
            return


def _end(request_id: str, status: RequestStatus | None, reason: str) -> None:
    """How a Generate stream ends: normally, unless the request failed. FAILED is final here
    (a retry of the id gets the same answer), so it is not a code a trainer retries, except
    when its node drained: a client with other daemons re-sends it there."""
    if status is RequestStatus.FAILED and reason.startswith(DRAINED_REASON):
        raise Unavailable(f"request {request_id} failed: {reason}")
    if status is RequestStatus.FAILED:
        raise FailedPrecondition(
            f"request {request_id} failed: {reason} (final: send its prompts again under a "
            "new request_id)"
        )
