"""The supervisor: one rollout worker process per device, their health, and the scheduling tick.

The tick is schedule -> apply -> record: build a `Snapshot` (`snapshot`), call the pure
`tltd.scheduler.schedule`, send the assignments and training decisions, record device and worker
states. It is driven
by the supervisor's own loop, not by APScheduler: it must react within milliseconds of an event
(a new request, a finished sample, a worker ready), so every such event kicks it, with
`scheduler_tick_seconds` as a fallback period. The health reaper (dead or silent workers) is a
periodic job in `tltd.periodic`.

The parts live next to this module: `rollout_workers` (start, health and messages of the
workers), `worker_process` (a worker's process, its phases and pipe threads),
`requests` (live requests, streams, finishing samples), `model_planner` (which job, policy
and drafter each worker holds; the policy-version semantics are stated there), `writes` (ordered
store writes), `policy_updates` (UpdatePolicy writes in flight, which gate training starts),
`fair_share` (the tokens-served accounts, a job waking from idle placed level).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tltd.contract import rollout_messages as msg
from tltd.contract.broadcast import assign_ranks
from tltd.domain import (
    DRAINED_REASON,
    Backend,
    Device,
    DeviceKind,
    FinishReason,
    Job,
    RequestStatus,
    RolloutRequest,
    Sample,
)
from tltd.metrics import METRICS
from tltd.scheduler import Assignment, Decision, SchedulerConfig, schedule
from tltd.settings import Settings
from tltd.store import notifications
from tltd.store.leases import Claim, UnitEnd
from tltd.store.rollout_requests import AdmissionClaim
from tltd.supervisor.drain import DRAIN_ANSWER_SECONDS, NodeDrain
from tltd.supervisor.fair_share import FairShare, active_jobs
from tltd.supervisor.freezes import Freezes
from tltd.supervisor.lease_keeper import LeaseKeeper
from tltd.supervisor.live_requests import LiveRequests, StreamEvent
from tltd.supervisor.model_planner import ModelPlanner
from tltd.supervisor.parking import Parking
from tltd.supervisor.policy_updates import PolicyUpdates
from tltd.supervisor.rollout_workers import RolloutWorkers
from tltd.supervisor.snapshot import build_snapshot
from tltd.supervisor.tick_state import TickState
from tltd.supervisor.training_hook import TrainingHook
from tltd.supervisor.worker_process import WorkerHandle, broadcast_ranks
from tltd.supervisor.writes import OrderedWrites

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# (first rank, world size, ranks) -> the JoinBroadcast a worker is sent
JoinFactory = Callable[[int, int, int], msg.JoinBroadcast]


class Supervisor:
    """Owns the rollout workers and the live requests; the RolloutService talks to it."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        *,
        training: TrainingHook | None = None,
        scheduler_config: SchedulerConfig | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.training = training
        self.sched_cfg = scheduler_config or SchedulerConfig(
            max_samples_per_worker=settings.worker_max_batch
        )
        self.writes = OrderedWrites(store.batch)
        self.requests = LiveRequests(store, settings, self.writes, self._spawn, self.kick)
        self.queue = self.requests.queue
        self.models = ModelPlanner(store, settings)
        self.policy_updates = PolicyUpdates()  # the PolicyService wraps its store write in it
        self.workers = RolloutWorkers(
            store,
            settings,
            self.writes,
            self.requests,
            self.models,
            kick=self.kick,
            run_task=self._spawn,
            on_finished=self._on_finished,
        )
        self.handles = self.workers.handles
        self.models.switch_backend = self.workers.switch_backend
        self.state = TickState(store, self.settings.scheduler_tick_seconds)
        self.freezes = Freezes(self.handles)  # workers of jobs paused keep: not stepping
        self.fair_share = FairShare()  # tokens served per job; a job waking from idle lifted
        self.assigned_samples = 0  # samples handed to workers, ever (no work is duplicated)
        self.leases = LeaseKeeper(store, settings, self.requests, self.handles, self._close)
        self._drain = NodeDrain(self.queue, self.requests, self.workers, self.leases)
        self.parking = Parking(store, self.requests, self.handles, self.writes, self._spawn)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._writer: asyncio.Task | None = None  # runs `writes`; stopped last
        self._tick_lock: asyncio.Lock | None = None
        # Requests between `begin_admission` and `end_admission`: a close that found one not
        # live yet (status, reason).
        self._admitting: dict[str, tuple[RequestStatus, str] | None] = {}

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Recover what a previous daemon left open, start workers, start ticking."""
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._tick_lock = asyncio.Lock()
        self.writes.bind()
        self.workers.bind()
        self._writer = asyncio.create_task(self.writes.run(), name="supervisor-writer")
        self._writer.add_done_callback(self._writer_ended)
        self._tasks.append(self._writer)
        await self.recover()
        await self.tick()
        self._tasks.append(asyncio.create_task(self._ticker(), name="supervisor-tick"))

    async def recover(self) -> None:
        """After a crash: this node's workers of the old process are gone, and the work units
        it held under its old epoch go back to the queue (claimed again, here or elsewhere,
        with their missing samples). Other nodes' rows are not touched."""
        await self.workers.recover()
        await self.requests.end_requests_of_ended_jobs()
        released = await asyncio.to_thread(self.store.leases.release_stale)
        if released:
            log.info("units of the previous process re-queued", extra={"units": released})

    async def on_new_epoch(self) -> None:
        """The node came back after being DOWN (paused, cut off): everything it ran under the
        old epoch may run elsewhere now. Stop it all, writing nothing, and re-queue what is
        still held under the old epoch."""
        lost = {(live.request_id, p) for live in self.queue for p in live.units}
        if lost:
            self.leases.stop(lost)
        await self.recover_leases()

    async def recover_leases(self) -> None:
        await asyncio.to_thread(self.store.leases.release_stale)
        self.kick()

    async def renew_leases(self) -> set[tuple[str, int]]:
        """The periodic lease renewal (see `LeaseKeeper.renew`)."""
        if self._closed:
            return set()
        lost = await self.leases.renew()
        if lost:
            self.kick()
        return lost

    async def drain(self, seconds: float, why: str = "the daemon is shutting down") -> None:
        """Finish what fits in `seconds`; then workers return what still runs as partial
        samples (persisted, streamed) and every unfinished request fails with a reason."""
        await asyncio.shield(self.start_drain(seconds, why))

    def start_drain(
        self, seconds: float, why: str = "the daemon is shutting down", end: float | None = None
    ) -> asyncio.Future:
        """See `NodeDrain.start`."""
        return self._drain.start(seconds, why, end)

    @property
    def draining(self) -> bool:
        return self._drain.started

    @property
    def handed_over(self) -> bool:
        """A drain gave this node's work to the other nodes."""
        return self._drain.handed_over

    def others_up(self) -> bool:
        """Another node is up on the same database (it can run what this node cannot); a
        store call: not on the event loop."""
        return self.leases.others_up()

    def updating_policy(self, job_id: str) -> AbstractContextManager[None]:
        """Wrap the store write of a new policy version of `job_id` (any thread), so that a
        tick which read the jobs before it starts no drafter training on that stale read."""
        return self.policy_updates.updating(job_id)

    def _refusal(self, job_id: str, policy_version: int) -> tuple[FinishReason, str] | None:
        """Why a unit claimed now could never run, if it could not."""
        if self._drain.started:
            return FinishReason.ABORTED, DRAINED_REASON + self._drain.why
        return self._version_refusal(job_id, policy_version)

    def _version_refusal(self, job_id: str, policy_version: int) -> tuple[FinishReason, str] | None:
        """A policy version that failed to load here fails its units at once."""
        if (why := self.models.refusal(job_id, policy_version)) is not None:
            return FinishReason.FAILED, why
        return None

    async def stop(self, deadline: float | None = None) -> None:
        """Stop every worker (Shutdown; killed when still there at `deadline`, monotonic,
        default 5 s from now) and record them STOPPED."""
        deadline = time.monotonic() + 5.0 if deadline is None else deadline
        self._closed = True
        # Before the tasks are cancelled: a worker still exiting is then recorded by `stop`.
        self.workers.closed = True
        for t in self._tasks:
            if t is not self._writer:
                t.cancel()
        await self.workers.stop(deadline)
        if self._writer is not None:
            await self.writes.join(self._writer)
            self._writer.cancel()
        # What the workers' last messages queued after that wait (a unit's end) is not
        # written: its callers fail instead of waiting for a writer that is gone.
        self.writes.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _writer_ended(self, task: asyncio.Task) -> None:
        """The store writer ends only at `stop`; before, nothing here is stored any more: say so."""
        if self._closed:
            return
        why = "cancelled" if task.cancelled() else repr(task.exception())
        log.error("the supervisor's store writer ended while the daemon runs: %s", why)

    # ---- the rollout API (event loop) ----------------------------------------------------

    def subscribe(self, request_id: str) -> asyncio.Queue[StreamEvent]:
        return self.requests.subscribe(request_id)

    def unsubscribe(self, request_id: str, q: asyncio.Queue[StreamEvent]) -> None:
        self.requests.unsubscribe(request_id, q)

    def runs_every_unit(self, request_id: str) -> bool:
        """Every unit of the request is live on this node (and stays here: no hand-over), so
        every sample of it is stored here and reaches its streams as an event."""
        return not self._drain.handing_over and self.requests.holds_every_unit(request_id)

    def begin_admission(self, request_id: str) -> None:
        """Until `end_admission`, a cancel of the request (or another close) that finds it not
        live yet is kept for `submit`."""
        self._admitting[request_id] = None

    def end_admission(self, request_id: str) -> None:
        self._admitting.pop(request_id, None)

    def admission_claim(self) -> AdmissionClaim | None:
        """What a request admitted here now may lease to this node in its own transaction
        (`LeaseKeeper.admission_capacity`; a store read at most once per heartbeat period: not
        on the event loop); None: its units are claimed at a tick."""
        capacity = self.leases.admission_capacity(self._drain.started)
        if capacity <= 0:
            return None
        return AdmissionClaim(capacity, self.settings.lease_seconds)

    async def submit(self, req: RolloutRequest, job: Job, claims: Sequence[Claim] = ()) -> None:
        """A request was just stored here: the units it leased to this node in its own
        transaction (`admission_claim`) go live now, as a claim's would, with nothing stored
        yet (a close that came meanwhile ends them at once); the others are claimed (here,
        if there is room, or on another node) at the next tick."""
        if claims:
            closed = self._admitting.get(req.request_id)
            if closed is not None:  # (a claim's read of the request would have seen it)
                req = replace(req, status=closed[0], status_reason=closed[1])
            state = {req.request_id: (req, job, set[tuple[int, int]](), set[tuple[int, int]]())}
            await self.requests.take_claims(list(claims), state, self._refusal)
        if len(claims) < len(req.prompts):
            self.leases.claim_soon = True
        self.kick()

    def cancel_threadsafe(self, request_id: str, reason: str) -> None:
        """Called from any thread after the store marked the request CANCELLED."""
        if self._loop is not None and not self._closed:
            asyncio.run_coroutine_threadsafe(self.cancel(request_id, reason), self._loop)

    async def cancel(self, request_id: str, reason: str) -> None:
        """Stop a live request: waiting samples end now, running ones are cancelled in their
        workers (they come back CANCELLED with the tokens so far)."""
        await self._close(request_id, RequestStatus.CANCELLED, reason)
        # Streams here of a request that runs elsewhere (or nowhere yet) read the store now:
        # this node's own notification of the cancel wakes none of them.
        self.requests.publish(request_id, StreamEvent())

    async def park(self, request_id: str) -> int:
        """Park a bounded request at its bound (`tltd.supervisor.parking`); the units parked."""
        return await self.parking.park(request_id, DRAIN_ANSWER_SECONDS)

    async def _close(self, request_id: str, status: RequestStatus, reason: str) -> None:
        if request_id in self._admitting and self.queue.get(request_id) is None:
            self._admitting[request_id] = (status, reason)  # for its `submit`

        def cancel(worker_id: str, rid: str) -> None:
            self.handles[worker_id].send(msg.Cancel(rid))

        await self.requests.close(request_id, status, reason, cancel)

    def on_notify(self, channel: str, request_id: str, own: bool = False) -> None:
        """A notification from another node (event loop): streams of the request re-read the
        store, a request ended elsewhere stops here, new work is claimed soon. One this node
        sent (`own`) wakes no stream and stops nothing: what it stored or ended here reached
        its streams and its live requests with the samples (a sample batch's end) or from
        the call that ended it (a cancel here: `cancel`)."""
        if self._closed:
            return
        if channel == notifications.STATE:  # the next tick reads jobs and devices again
            self.store.db.scheduling_writes.changed_elsewhere(request_id)
            return
        if channel == notifications.SAMPLE and (own or self.runs_every_unit(request_id)):
            return  # stored by this node: its streams had it as an event
        if channel in (notifications.SAMPLE, notifications.REQUEST) and not own:
            self.requests.publish(request_id, StreamEvent())  # a wake-up: re-read the store
        if channel == notifications.REQUEST:
            if not own:  # (own: a store read each, when it came before the samples did)
                self._spawn(self.leases.follow(request_id))
        elif channel == notifications.WORK:
            self.leases.claim_soon = True
            self.kick()

    def kick(self) -> None:
        if self._kick is not None:
            self._kick.set()

    def policy_versions_in_use(self, job_id: str) -> set[int]:
        """The job's policy versions a live worker holds or is loading (read from any thread:
        a snapshot of the handles)."""
        used = set()
        for h in list(self.handles.values()):
            if not h.alive:
                continue
            if h.job_id == job_id:
                used.add(h.policy_version)
            load = h.load
            if load is not None and load.job_id == job_id and load.policy_weights:
                used.add(load.version)
        return used

    def join_broadcast_threadsafe(
        self, job_id: str, join: JoinFactory, first_rank: int = 2, cuda_only: bool = False
    ) -> int:
        """Called from any thread: the job's live workers join a policy broadcast from
        `first_rank` on (after the trainer, rank 0, and in the daemon's group the daemon, rank
        1), each with as many ranks as its engine takes; `cuda_only`: those on CUDA devices
        only (NCCL). `join(first_rank, world_size, ranks)` is what each is sent. Returns how
        many ranks the workers took."""
        if self._loop is None or self._closed:
            return 0
        coro = self._join_broadcast(job_id, join, first_rank, cuda_only)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _join_broadcast(
        self, job_id: str, join: JoinFactory, first_rank: int, cuda_only: bool
    ) -> int:
        # One pass on the event loop: the world size and every rank are fixed together.
        joined = [
            h
            for h in self.handles.values()
            if h.answered
            and h.job_id == job_id
            and not h.loading_job
            and (not cuda_only or h.device.kind is DeviceKind.CUDA)
            # SGLang receives into the weights it serves: only an idle engine joins, so no
            # running sample sees its weights change (torch workers hold a copy aside), and
            # one still in another broadcast does not (it would refuse, failing this one).
            and (
                h.backend is Backend.TORCH
                or (self.queue.inflight(h.worker_id) == 0 and not h.broadcast_path)
            )
        ]
        counts = [broadcast_ranks(h.backend) for h in joined]
        firsts, world = assign_ranks(counts, first_rank)
        for h, first, count in zip(joined, firsts, counts, strict=True):
            m = join(first, world, count)
            if h.backend is not Backend.TORCH:
                h.broadcast_path = m.path
            h.send(m)
        return sum(counts)

    async def apply_pauses(self, job_id: str, timeout: float) -> int:
        """A job's pause or resume was just recorded: freeze or thaw this node's workers now
        (a tick reads it) and, for a pause that keeps requests in place, wait until the job's
        workers here stopped stepping; returns how many did (0 after a resume). Other nodes
        follow at their next tick."""
        await self.tick()
        return await self.freezes.wait_stopped(job_id, timeout)

    def kick_threadsafe(self) -> None:
        """Something changed in the store (a policy version, a job): tick soon."""
        if self._loop is not None and not self._closed:
            self._loop.call_soon_threadsafe(self.kick)

    def worker_stats(self) -> dict[str, dict[str, object]]:
        """The latest engine counters each worker reported (tests, metrics)."""
        beats = {wid: h.heartbeat for wid, h in self.handles.items()}
        return {wid: dict(b.stats) for wid, b in beats.items() if b is not None}

    def last_read(self) -> tuple[list[Device], dict[str, Job]] | None:
        """The tick's last read of devices and active jobs while current (`TickState.reusable`)."""
        return self.state.reusable()

    async def reap(self, stalled: float = 0.0) -> list[str]:
        """Kill workers that stopped answering (the periodic reaper; `stalled`: seconds this
        daemon itself did not run, not held against them) and restart them now."""
        dead = await self.workers.reap(stalled)
        if dead:
            await self.tick()
        return dead

    # ---- the tick -----------------------------------------------------------------------

    async def _ticker(self) -> None:
        assert self._kick is not None
        while not self._closed:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # comes as the kick fires (a stop's can), and the ticker then ran one more tick
            # after the workers had stopped, which could wait for ever.
            try:
                async with asyncio.timeout(self.settings.scheduler_tick_seconds):
                    await self._kick.wait()
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop scheduling for good
                log.exception("supervisor tick failed")

    async def tick(self) -> Decision | None:
        """schedule -> apply -> record, once (the ticker and the reaper never overlap)."""
        assert self._tick_lock is not None
        async with self._tick_lock:
            return await self._tick()

    async def _tick(self) -> Decision | None:
        if self._closed:
            return None
        updates = self.policy_updates.mark()  # before the jobs are read: see policy_updates
        devices, jobs = self.state.reusable() or await asyncio.to_thread(self.state.read)
        self.workers.reconcile(devices, self.draining)
        frozen = self.state.frozen
        self.freezes.apply(frozen, thaw=False)  # before any work is sent this tick
        await self.models.plan(self.handles, self.queue, jobs)
        self.freezes.apply(frozen)  # after the loads: a thawed sample steps on the newest
        if self._drain.assigning:  # (also in a drain's grace: alone, the node runs its work)
            await self.leases.claim(self._version_refusal, draining=self._drain.started)
        else:  # after the grace, alone: what is still queued ends "drained" (nobody else runs it)
            await self.leases.claim(self._refusal, draining=True, everything=True)
            return None
        active = active_jobs(self.queue)
        if not active <= jobs.keys():  # units of a job this read predates
            devices, jobs = await asyncio.to_thread(self.state.read)
        accounts = self.fair_share.accounts(jobs.values(), active)
        snap = build_snapshot(
            time.monotonic(),
            devices,
            jobs.values(),
            self.handles.values(),
            self.queue,
            accounts,
            self.training,
        )
        decision = await self._apply(schedule(snap, self.sched_cfg), updates)
        self.workers.record(decision, devices)
        return decision

    async def _apply(self, decision: Decision, updates: Mapping[str, int]) -> Decision:
        """Carry out a decision; returns it with the training starts that did happen."""
        for s in decision.switches:
            self.handles[s.worker_id].next_job = s.job_id
            log.info(
                "rollout worker switches job", extra={"worker_id": s.worker_id, "job_id": s.job_id}
            )
        if decision.switches:
            self.kick()  # an empty switched worker loads its new job on the next tick
        for a in decision.assignments:
            self._assign(a)
        if self.training is None:
            return decision
        for device_id in decision.preempt_training:
            await self.training.preempt(device_id, decision.reasons.get(device_id, ""))
        started = []
        for t in decision.start_training:
            # Checked right before each start (earlier starts await): the jobs read above may
            # predate an UpdatePolicy of this job, whose load the snapshot then missed.
            if self.policy_updates.changed_since(updates, t.job_id):
                log.info("training start dropped: policy update", extra={"job_id": t.job_id})
                self.kick()  # the next tick decides on the new version
                continue
            await self.training.start(t.device_id, t.job_id)
            started.append(t)
        return replace(decision, start_training=tuple(started))

    def _assign(self, a: Assignment) -> None:
        handle = self.handles[a.worker_id]
        live, indices = self.requests.take(a.request_id, a.prompt_index, a.samples, a.worker_id)
        if live is None or not indices:
            return
        handle.seq += 1
        handle.send(live.work(handle.seq, a.prompt_index, indices))
        predicted = live.predicted_tokens(a.prompt_index) or live.req.sampling.max_new_tokens
        handle.unacked[handle.seq] = len(indices) * predicted
        handle.idle_since = None
        self.assigned_samples += len(indices)

    # ---- samples back from workers (event loop) ---------------------------------------

    def _on_finished(
        self, handle: WorkerHandle, sample: Sample, stored: bool | None, end: UnitEnd | None
    ) -> None:
        key = (sample.prompt_index, sample.sample_index)
        live = self.queue.get(sample.request_id)
        if sample.finish_reason is FinishReason.ABORTED and self._drain.handing_over:
            # The tokens so far of a unit handed to another node: streamed to the callers
            # that asked for partial samples; the sample itself stays unfinished here.
            if stored is not None and live is not None:
                self.requests.publish(live.request_id, StreamEvent(sample))
            return
        if live is not None and self.parking.took(live, sample, stored is not None):
            return  # paused at its request's step bound: it goes on later from what was stored
        if stored is None:
            # Not persisted, so not streamed: run it again (counts as a lost attempt).
            if live is not None and live.running.get(key) == handle.worker_id:
                self._spawn(self.requests.retry_sample(live, key))
            return
        live = self.requests.stored(sample, end)
        if live is not None and live.paused:  # its unit may now be all done or paused
            self._spawn(self.parking.settle(live, key[0]))
        if self.queue.inflight(handle.worker_id) == 0:
            handle.idle_since = time.monotonic()
        if live is None:
            return
        METRICS.record_sample(live.job_id, sample)
        if sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.fair_share.served[live.job_id] += len(sample.token_ids)
            if self.training is not None:
                self.training.on_sample(live.job_id, live.req.prompts[key[0]], sample)
        if self._slot_wanted(handle):
            self.kick()

    def _slot_wanted(self, handle: WorkerHandle) -> bool:
        """A stored sample frees a slot: tick at once when samples here wait for one, or when
        its device went idle and drafter training may use it. Otherwise the periodic tick
        does (claims go by their own interval, stored states by their settle time)."""
        if self.training is not None and self.queue.inflight(handle.worker_id) == 0:
            return True
        return self.queue.waiting()

    # ---- background tasks ---------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("supervisor task failed", exc_info=task.exception())
