"""The supervisor: one rollout worker process per device, their health, and the scheduling tick.

The tick is schedule -> execute -> record: build a `Snapshot` (`snapshot`), call the pure
`tltd.scheduler.schedule`, send the assignments, record device and worker states. It is driven
by the supervisor's own loop, not by APScheduler: it must react within milliseconds of an event
(a new request, a finished sample, a worker ready), so every such event kicks it, with
`scheduler_tick_seconds` as a fallback period. The health reaper (dead or silent workers) is a
periodic job in `tltd.periodic`.

The parts live next to this module: `worker_process` (a worker's process and pipe threads),
`requests` (live requests, streams, finishing samples), `models` (which job, policy and drafter
each worker holds; the policy-version semantics are stated there), `writes` (ordered store
writes), `policy_updates` (UpdatePolicy writes in flight, which gate training starts),
`fair_share` (the tokens-served accounts, a job waking from idle placed level).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from tltd.domain import (
    Backend,
    Device,
    DeviceState,
    FinishReason,
    JobStatus,
    RequestStatus,
    RolloutRequest,
    Sample,
    SpeculativeMode,
    Worker,
    WorkerKind,
    WorkerState,
)
from tltd.metrics import METRICS
from tltd.scheduler import Decision, SchedulerConfig, TrainingView, schedule
from tltd.settings import Settings
from tltd.supervisor.fair_share import FairShare, active_jobs
from tltd.supervisor.models import ModelPlanner
from tltd.supervisor.policy_updates import PolicyUpdates
from tltd.supervisor.requests import RolloutRequests, StreamEvent
from tltd.supervisor.snapshot import build_snapshot
from tltd.supervisor.worker_process import WorkerSlot, spawn
from tltd.supervisor.writes import OrderedWrites, upsert_worker
from workers.rollout import protocol as msg

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# How long workers get to answer a node drain's Drain (return what runs as partial samples)
# after its grace; a shutdown's one deadline replaces it.
_DRAIN_ANSWER_SECONDS = 5.0
# How long a stopped (or vacated) worker gets to exit before it is killed.
_EXIT_SECONDS = 5.0
_SWITCH_EXIT_SECONDS = 20.0  # a graceful engine shutdown (SGLang frees its GPU memory)


def restart_backoff(failures: int) -> float:
    """Seconds before a worker that died `failures` times in a row is started again: 0, then
    0.5 doubling to 30 (the exponent capped: 2.0 ** 1024 overflows in a long crash loop)."""
    return min(30.0, 0.5 * 2 ** min(failures - 1, 16)) if failures > 0 else 0.0


class TrainingHook(Protocol):
    """The seam for drafter-training workers (kind `drafter_training`, see workers/drafter).

    The supervisor passes the hook's view into every snapshot and applies the scheduler's
    training decisions through it; without a hook no training is scheduled.
    """

    def views(self) -> tuple[TrainingView, ...]: ...

    def job_view(self, job_id: str) -> tuple[int, float | None]:
        """(fresh samples not yet trained on, when training last started) for a job."""
        ...

    def on_sample(self, job_id: str, prompt: tuple[int, ...], sample: Sample) -> None:
        """A complete sample (stop/length) for the training buffer: tokens = prompt +
        sample.token_ids, the response starting at len(prompt)."""
        ...

    async def start(self, device_id: str, job_id: str) -> None: ...

    async def preempt(self, device_id: str, reason: str) -> None: ...


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
        self.writes = OrderedWrites()
        self.requests = RolloutRequests(store, settings, self.writes, self._spawn, self.kick)
        self.queue = self.requests.queue
        self.models = ModelPlanner(store, settings, self._switch_backend)
        self.policy_updates = PolicyUpdates()  # the PolicyService wraps its store write in it
        self.slots: dict[str, WorkerSlot] = {}
        self.fair_share = FairShare()  # tokens served per job; a job waking from idle lifted
        self.assigned_samples = 0  # samples handed to workers, ever (no work is duplicated)
        self.draining = False
        self._assigning = True
        self._closed = False
        self._device_states: dict[str, DeviceState] = {}
        self._ctx = mp.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._drain_task: asyncio.Future | None = None
        self._drain_why = ""
        self._work_end = self._drain_end = 0.0  # monotonic deadlines of the drain
        self._tick_lock: asyncio.Lock | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Recover what a previous daemon left open, start workers, start ticking."""
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._tick_lock = asyncio.Lock()
        self.writes.bind()
        self._tasks.append(asyncio.create_task(self.writes.run(), name="supervisor-writer"))
        await self.recover()
        await self.tick()
        self._tasks.append(asyncio.create_task(self._ticker(), name="supervisor-tick"))

    async def recover(self) -> None:
        """After a crash: workers of the old process are gone; every open request is
        re-queued with its missing samples, or ended with a reason when it cannot run."""
        for w in await asyncio.to_thread(self.store.list_workers):
            if w.state not in (WorkerState.STOPPED, WorkerState.FAILED):
                await self.writes.write(
                    self.store.set_worker_state,
                    w.worker_id,
                    WorkerState.FAILED,
                    "daemon restarted: the previous daemon ended without stopping it",
                )
        # Drafter training of the old process is gone too; nothing else rewrites TRAINING.
        for d in await asyncio.to_thread(self.store.list_devices):
            if d.state is DeviceState.TRAINING:
                await self.writes.write(
                    self.store.set_device_state,
                    d.device_id,
                    DeviceState.IDLE,
                    "daemon restarted: the previous daemon's drafter training is gone",
                )
        await self.requests.recover()

    async def drain(self, seconds: float, why: str = "the daemon is shutting down") -> None:
        """Finish what fits in `seconds`; then workers return what still runs as partial
        samples (persisted, streamed) and every unfinished request fails with a reason."""
        await asyncio.shield(self.start_drain(seconds, why))

    def start_drain(
        self, seconds: float, why: str = "the daemon is shutting down", end: float | None = None
    ) -> asyncio.Future:
        """Begin draining now (event loop thread): work runs `seconds`, then workers have
        until `end` (monotonic; default `_DRAIN_ANSWER_SECONDS` later) to return what runs.
        A drain already under way is returned, its deadlines shortened to these if earlier
        (SIGTERM during a node drain keeps the shutdown's grace)."""
        work_end = time.monotonic() + max(0.0, seconds)
        end = work_end + _DRAIN_ANSWER_SECONDS if end is None else end
        if self._drain_task is None:
            self.draining = True
            self._drain_why = f"{why} (grace {seconds:g}s)"
            self._work_end, self._drain_end = work_end, end
            self._drain_task = asyncio.ensure_future(self._drain())
        else:
            self._work_end = min(self._work_end, work_end)
            self._drain_end = min(self._drain_end, end)
        return self._drain_task

    async def _drain(self) -> None:
        while len(self.queue) and time.monotonic() < self._work_end:
            await asyncio.sleep(0.05)
        self._assigning = False
        if not len(self.queue):
            return
        reason = f"drained: {self._drain_why}"
        log.info("draining workers", extra={"requests": len(self.queue)})
        busy = [s for s in self.slots.values() if s.alive and self.queue.inflight(s.worker_id)]
        for slot in busy:
            slot.drained.clear()
            slot.send(msg.Drain(0.0))
        for live in list(self.queue):
            keys = self.queue.close(live.request_id, RequestStatus.FAILED, reason)
            try:  # one request's failure must not keep the others open
                await self.requests.finish_unstarted(live, keys, FinishReason.ABORTED, reason)
            except Exception:
                log.exception(
                    "cannot close a drained request", extra={"request_id": live.request_id}
                )
        # Polled, not one wait: a shutdown may shorten `_drain_end` meanwhile.
        while any(not s.drained.is_set() for s in busy) and time.monotonic() < self._drain_end:
            await asyncio.sleep(0.05)
        for slot in busy:  # a worker that did not answer: its samples end with no tokens
            if self.queue.inflight(slot.worker_id):
                await self.requests.lose_worker(slot.worker_id, "worker did not drain in time")
        # The final status writes of the requests just failed (store writes, not workers:
        # they get a second past the deadline).
        writes_end = max(self._drain_end, time.monotonic() + 1.0)
        while len(self.queue) and time.monotonic() < writes_end:
            await asyncio.sleep(0.05)

    def _refusal(self, job_id: str, policy_version: int) -> tuple[FinishReason, str] | None:
        """Why a request made live now could never run, if it could not."""
        if self.draining:
            return FinishReason.ABORTED, f"drained: {self._drain_why}"
        if (why := self.models.refusal(job_id, policy_version)) is not None:
            return FinishReason.FAILED, why
        return None

    async def stop(self, deadline: float | None = None) -> None:
        """Stop every worker (Shutdown; killed when still there at `deadline`, monotonic,
        default 5 s from now) and record them STOPPED."""
        deadline = time.monotonic() + 5.0 if deadline is None else deadline
        self._closed = True
        # Their `_bury` (which records them) is cancelled here: recorded below instead.
        exiting = {s.worker_id for s in self.slots.values() if s.exiting}
        for t in self._tasks[1:]:
            t.cancel()
        for slot in self.slots.values():
            if slot.alive:
                self._record_state(slot, WorkerState.STOPPING, "daemon shutting down")
                slot.send(msg.Shutdown())
        for slot in self.slots.values():
            if slot.proc is not None:
                left = max(0.0, deadline - time.monotonic())
                await asyncio.to_thread(slot.proc.join, left)
                if slot.proc.is_alive():
                    slot.proc.kill()
                    await asyncio.to_thread(slot.proc.join, 5.0)
                if slot.state is WorkerState.STOPPING or slot.worker_id in exiting:
                    self._record_state(slot, WorkerState.STOPPED, "daemon shut down")
                slot.dead_at = slot.dead_at or time.monotonic()
                if slot.outbox is not None:
                    slot.outbox.put(None)
        await self.writes.join()
        self._tasks[0].cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the rollout API (event loop) ----------------------------------------------------

    def subscribe(self, request_id: str) -> asyncio.Queue[StreamEvent]:
        return self.requests.subscribe(request_id)

    def unsubscribe(self, request_id: str, q: asyncio.Queue[StreamEvent]) -> None:
        self.requests.unsubscribe(request_id, q)

    async def submit(self, req: RolloutRequest, policy_version: int) -> None:
        """Make a stored request live (idempotent, see `RolloutRequests.submit`); one that
        can never run (draining, a version that failed to load) fails at once."""
        if not await self.requests.submit(req, policy_version, self._refusal):
            return
        self.kick()
        # A CancelRequest that landed while submit read the store found nothing live to stop
        # (its `cancel` was a no-op): the store has the last word.
        cur = await asyncio.to_thread(self.store.get_request, req.request_id)
        live = self.queue.get(req.request_id)
        closed = (RequestStatus.CANCELLED, RequestStatus.FAILED)
        if cur.status in closed and live is not None and live.outcome is None:
            await self._close(req.request_id, cur.status, cur.status_reason)

    def unfinished(self, request_id: str) -> set[tuple[int, int]]:
        """The (prompt, sample) keys a live request has not finished yet (waiting or running);
        empty when it is not live."""
        live = self.queue.get(request_id)
        if live is None:
            return set()
        return set(live.running) | set(live.pending_keys())

    def cancel_threadsafe(self, request_id: str, reason: str) -> None:
        """Called from any thread after the store marked the request CANCELLED."""
        if self._loop is not None and not self._closed:
            asyncio.run_coroutine_threadsafe(self.cancel(request_id, reason), self._loop)

    async def cancel(self, request_id: str, reason: str) -> None:
        """Stop a live request: waiting samples end now, running ones are cancelled in their
        workers (they come back CANCELLED with the tokens so far)."""
        await self._close(request_id, RequestStatus.CANCELLED, reason)

    async def _close(self, request_id: str, status: RequestStatus, reason: str) -> None:
        live = self.queue.get(request_id)
        if live is None:
            return
        keys = self.queue.close(request_id, status, reason)
        for wid in set(live.running.values()):
            self.slots[wid].send(msg.Cancel(request_id))
        cancelled = status is RequestStatus.CANCELLED
        finish = FinishReason.CANCELLED if cancelled else FinishReason.ABORTED
        await self.requests.finish_unstarted(live, keys, finish, reason)

    def kick(self) -> None:
        if self._kick is not None:
            self._kick.set()

    def kick_threadsafe(self) -> None:
        """Something changed in the store (a policy version, a job): tick soon."""
        if self._loop is not None and not self._closed:
            self._loop.call_soon_threadsafe(self.kick)

    def worker_stats(self) -> dict[str, dict[str, object]]:
        """The latest engine counters each worker reported (tests, metrics)."""
        return {
            wid: dict(s.heartbeat.stats) for wid, s in self.slots.items() if s.heartbeat is not None
        }

    # ---- the tick -----------------------------------------------------------------------

    async def _ticker(self) -> None:
        assert self._kick is not None
        while not self._closed:
            try:
                await asyncio.wait_for(self._kick.wait(), self.settings.scheduler_tick_seconds)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                await self.tick()
            except Exception:  # one bad tick must not stop scheduling for good
                log.exception("supervisor tick failed")

    async def tick(self) -> Decision | None:
        """schedule -> execute -> record, once (the ticker and the reaper never overlap)."""
        assert self._tick_lock is not None
        async with self._tick_lock:
            return await self._tick()

    async def _tick(self) -> Decision | None:
        if self._closed:
            return None
        devices = await asyncio.to_thread(self.store.list_devices)
        updates = self.policy_updates.mark()  # before the jobs are read: see policy_updates
        jobs = {
            j.job_id: j
            for j in await asyncio.to_thread(self.store.list_jobs, [JobStatus.ACTIVE], 10_000)
        }
        self._reconcile(devices)
        await self.models.plan(self.slots, self.queue, jobs)
        if not self._assigning:
            return None
        snap = build_snapshot(
            time.monotonic(),
            devices,
            jobs.values(),
            self.slots.values(),
            self.queue,
            self.fair_share.accounts(jobs.values(), active_jobs(self.queue)),
            self.training,
        )
        decision = schedule(snap, self.sched_cfg)
        self._apply(decision, devices)
        if self.training is not None:
            for device_id in decision.preempt_training:
                await self.training.preempt(device_id, decision.reasons.get(device_id, ""))
            started = []
            for t in decision.start_training:
                # Checked right before each start (earlier starts await): the jobs read above
                # may predate an UpdatePolicy of this job, whose load the snapshot then missed.
                if self.policy_updates.changed_since(updates, t.job_id):
                    log.info("training start dropped: policy update", extra={"job_id": t.job_id})
                    self.kick()  # the next tick decides on the new version
                    continue
                await self.training.start(t.device_id, t.job_id)
                started.append(t)
            decision = replace(decision, start_training=tuple(started))
        return decision

    def _apply(self, decision: Decision, devices: list[Device]) -> None:
        for s in decision.switches:
            slot = self.slots[s.worker_id]
            slot.next_job = s.job_id
            log.info(
                "rollout worker switches job", extra={"worker_id": s.worker_id, "job_id": s.job_id}
            )
        if decision.switches:
            self.kick()  # an empty switched worker loads its new job on the next tick
        for a in decision.assignments:
            live, slot = self.queue.get(a.request_id), self.slots[a.worker_id]
            indices = self.queue.take(a.request_id, a.prompt_index, a.samples, a.worker_id)
            if live is None or not indices:
                continue
            req = live.req
            slot.seq += 1
            slot.send(
                msg.AddWork(
                    slot.seq,
                    req.request_id,
                    a.prompt_index,
                    tuple(indices),
                    req.prompts[a.prompt_index],
                    req.sampling,
                    speculative=req.speculative is not SpeculativeMode.OFF,
                )
            )
            slot.unacked[slot.seq] = len(indices) * req.sampling.max_new_tokens
            slot.idle_since = None
            self.assigned_samples += len(indices)
            if not live.started:
                live.started = True
                self.writes.write_nowait(
                    self.store.set_request_status,
                    req.request_id,
                    RequestStatus.RUNNING,
                    f"running on {slot.worker_id}",
                )
        idle = set(decision.idle_devices)
        # A device handed to training this tick gets its state from the training hook; an
        # IDLE written here too could land after it (another writer) and hide the training.
        to_training = {t.device_id for t in decision.start_training}
        for d in devices:
            if d.state in (DeviceState.UNAVAILABLE, DeviceState.TRAINING):
                continue
            if d.device_id in to_training:
                # Not ours to write, but remembered, so that our next state for it is written.
                self._device_states[d.device_id] = DeviceState.TRAINING
                continue
            busy = sum(self.queue.inflight(s.worker_id) for s in self._slots_on(d.device_id))
            if busy:
                self._record_device(d.device_id, DeviceState.ROLLOUT, f"{busy} samples running")
            elif d.device_id in idle or not d.schedulable:
                # A cordoned or draining device never counts as idle for training, but once
                # its work ends it no longer runs rollouts either.
                self._record_device(d.device_id, DeviceState.IDLE, "no rollout work")
        for slot in self.slots.values():
            if slot.alive and slot.ready:
                busy = self.queue.inflight(slot.worker_id) > 0
                state = WorkerState.BUSY if busy else WorkerState.READY
                self._record_state(slot, state, slot.reason)

    def _slots_on(self, device_id: str) -> list[WorkerSlot]:
        return [s for s in self.slots.values() if s.device.device_id == device_id]

    # ---- workers: start, vacate, health -------------------------------------------------

    def _reconcile(self, devices: list[Device]) -> None:
        """One worker per usable device; a device turned foreign is vacated, not fought over."""
        now = time.monotonic()
        for d in devices:
            wid = f"rollout-{d.device_id}"
            slot = self.slots.get(wid)
            usable = d.state is not DeviceState.UNAVAILABLE and not d.foreign and not self.draining
            if slot is None:
                if not usable:
                    continue
                backend = Backend(self.settings.default_backend)
                slot = self.slots[wid] = WorkerSlot(wid, d, backend)
            slot.device = d
            # Not while the old process is still being stopped (`exiting`): its samples are
            # not re-queued yet, and it may still hold the device.
            if usable and not slot.alive and not slot.exiting:
                backoff = restart_backoff(slot.failures)
                if slot.dead_at is None or now - slot.dead_at >= backoff or slot.vacated:
                    self._start_worker(slot)
            elif not usable and slot.alive and (d.foreign or d.state is DeviceState.UNAVAILABLE):
                why = "device taken by a foreign process" if d.foreign else "device unavailable"
                slot.vacated = True
                self._record_state(slot, WorkerState.STOPPING, why)
                slot.send(msg.Shutdown())
                # Out of service now (this tick assigns it nothing); the wait for the process
                # (`_EXIT_SECONDS`, then a kill, if it hangs) runs beside the tick, not in it.
                if self._retire(slot):
                    self._spawn(self._bury(slot, why, WorkerState.STOPPED))

    def _start_worker(self, slot: WorkerSlot) -> None:
        assert self._loop is not None
        spawn(
            slot, self._ctx, self.settings, self.store, self._loop, self._on_message, self._on_exit
        )
        self._record_state(slot, WorkerState.STARTING, "spawned", pid=slot.proc.pid)
        log.info(
            "rollout worker started", extra={"worker_id": slot.worker_id, "pid": slot.proc.pid}
        )

    async def _switch_backend(self, slot: WorkerSlot, backend: Backend) -> None:
        """Stop an empty worker so that a later tick starts it on `backend` (the planner
        switches only workers with nothing running). The wait for the old process runs beside
        the tick, not in it; no new worker starts on the device until the old one is gone."""
        why = f"switching to the {backend} backend"
        log.info("rollout worker switches backend", extra={"worker_id": slot.worker_id})
        slot.backend = backend
        self._record_state(slot, WorkerState.STOPPING, why)
        slot.send(msg.Shutdown())
        if self._retire(slot):
            # An SGLang worker frees its GPU before it exits: give it time to, then kill.
            self._spawn(self._bury(slot, why, WorkerState.STOPPED, _SWITCH_EXIT_SECONDS))

    async def reap(self) -> list[str]:
        """Kill workers that stopped answering (the periodic reaper); returns the ids of those
        found dead."""
        now = time.monotonic()
        dead = []
        s = self.settings
        for slot in list(self.slots.values()):
            if not slot.alive:
                continue
            if slot.proc.exitcode is not None:
                why = slot.fatal or "process exited"
            elif slot.loading and now - slot.since > s.worker_start_timeout_seconds:
                why = f"no Ready within {s.worker_start_timeout_seconds:g}s"
            elif (
                not slot.loading and now - slot.last_heartbeat > s.worker_heartbeat_timeout_seconds
            ):
                why = f"no heartbeat for {s.worker_heartbeat_timeout_seconds:g}s"
            else:
                continue
            dead.append(slot.worker_id)
            await self._mark_dead(slot, why, WorkerState.FAILED)
        if dead:
            await self.tick()  # restart them now
        return dead

    def _on_exit(self, slot: WorkerSlot, gen: int) -> None:
        if gen != slot.generation or slot.dead_at is not None:
            return
        if self._closed or slot.state is WorkerState.STOPPING:
            return  # an exit we asked for: stop() / vacating records it
        if self._retire(slot):  # no work for it from now, even before the task runs
            self._spawn(self._bury(slot, slot.fatal or "process exited", WorkerState.FAILED))

    async def _mark_dead(self, slot: WorkerSlot, why: str, state: WorkerState) -> None:
        """The worker is gone (or being stopped): re-queue its samples, record it."""
        if self._retire(slot):
            await self._bury(slot, why, state)

    def _retire(self, slot: WorkerSlot) -> bool:
        """Take the worker out of service at once (no work, no restart until `_bury` is
        done); False when it already was."""
        if slot.dead_at is not None:
            return False
        slot.dead_at = time.monotonic()
        slot.exiting = True
        slot.ready, slot.policy_load = False, ""
        if slot.outbox is not None:
            slot.outbox.put(None)
        return True

    async def _bury(
        self, slot: WorkerSlot, why: str, state: WorkerState, grace: float = _EXIT_SECONDS
    ) -> None:
        """After `_retire`: wait `grace` seconds for the process (then kill it), record it,
        re-queue its samples."""
        proc = slot.proc
        try:
            if proc is not None and proc.is_alive() and state is WorkerState.FAILED:
                proc.kill()
            if proc is not None:
                await asyncio.to_thread(proc.join, grace)
                if proc.is_alive():  # hung (e.g. vacated while stuck): never leave it running
                    proc.kill()
                    await asyncio.to_thread(proc.join, 5.0)
                if proc.exitcode is not None and state is WorkerState.FAILED:
                    why = f"{why} (exit code {proc.exitcode})"
            if state is WorkerState.FAILED:
                slot.failures += 1
                if slot.load_in_flight is not None:
                    # The load killed the process (no LoadFailed can come): the same failure,
                    # or a fresh process would load it again at once, for ever.
                    job_id, version, drafter = slot.load_in_flight
                    died = f"the worker process died while loading it: {why}"
                    self._load_failed(slot, msg.LoadFailed(job_id, version, died, drafter))
            slot.load_in_flight = None
            log.warning("rollout worker gone", extra={"worker_id": slot.worker_id, "reason": why})
            self._record_state(slot, state, why)
            await self.requests.lose_worker(slot.worker_id, why)
        finally:
            slot.exiting = False
            self.kick()  # its device may get a new worker now

    # ---- worker messages (event loop, posted by the worker's reader thread) ---------------

    def _on_message(
        self, slot: WorkerSlot, gen: int, m: msg.FromWorker, stored: bool | None
    ) -> None:
        if gen != slot.generation:
            return  # from a process that was already replaced
        now = time.monotonic()
        slot.last_heartbeat = now
        match m:
            case msg.Finished(sample=sample):
                self._on_finished(slot, sample, stored)
            case msg.Heartbeat():
                previous = slot.heartbeat.stats if slot.heartbeat is not None else None
                METRICS.observe_engine_summary(slot.device.device_id, previous, m.stats)
                slot.heartbeat = m
                for seq in [q for q in slot.unacked if q <= m.acked_seq]:
                    del slot.unacked[seq]
            case msg.Ready():
                first = not slot.ready
                slot.ready, slot.loading, slot.load_in_flight = True, False, None
                if m.job_id:
                    # Only a loaded model ends a crash loop: every fresh process says Ready
                    # before its first load, also one whose load is about to kill it again.
                    slot.failures = 0
                slot.job_id, slot.policy_version = m.job_id, m.policy_version
                slot.target_job = slot.policy_load = ""
                slot.drafter_version = m.drafter_version
                self.models.loaded(m, slot)  # a version that loads is no longer held back
                slot.reason = (
                    f"job {m.job_id} policy v{m.policy_version} drafter v{m.drafter_version}"
                    if m.job_id
                    else "no model loaded"
                )
                if self.queue.inflight(slot.worker_id) == 0:
                    slot.idle_since = now
                self._record_state(
                    slot, WorkerState.READY if first else slot.state, slot.reason, pid=m.pid
                )
                self.kick()
            case msg.LoadFailed():
                self._load_failed(slot, m)
            case msg.Drained():
                slot.drained.set()
            case msg.WorkerError(message=text, fatal=fatal):
                log.error(
                    "rollout worker error",
                    extra={"worker_id": slot.worker_id, "fatal": fatal, "error": text},
                )
                if fatal:
                    slot.fatal = text.strip().splitlines()[-1] if text.strip() else "fatal error"
                    slot.reason = slot.fatal

    def _load_failed(self, slot: WorkerSlot, m: msg.LoadFailed) -> None:
        """Hold the version back; a policy's live requests fail with the reason."""
        reason = self.models.load_failed(m, slot, self.slots)
        if reason is not None:
            self.requests.fail_version(m.job_id, m.policy_version, reason)

    def _on_finished(self, slot: WorkerSlot, sample: Sample, stored: bool | None) -> None:
        key = (sample.prompt_index, sample.sample_index)
        live = self.queue.get(sample.request_id)
        if stored is None:
            # Not persisted, so not streamed: run it again (counts as a lost attempt).
            if live is not None and live.running.get(key) == slot.worker_id:
                self._spawn(self.requests.retry_sample(live, key))
            return
        failed = None
        if sample.finish_reason is FinishReason.FAILED:
            failed = sample.error or "failed"
        live = self.queue.finish(sample.request_id, key, failed)
        if self.queue.inflight(slot.worker_id) == 0:
            slot.idle_since = time.monotonic()
        if live is None:
            return
        METRICS.record_sample(live.job_id, sample)
        if sample.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.fair_share.served[live.job_id] += len(sample.token_ids)
            if self.training is not None:
                self.training.on_sample(live.job_id, live.req.prompts[key[0]], sample)
        self.requests.publish(live.request_id, StreamEvent(sample))
        if live.done:
            self._spawn(self.requests.finalize(live))
        self.kick()

    # ---- recording ------------------------------------------------------------------------

    def _record_state(
        self, slot: WorkerSlot, state: WorkerState, reason: str, pid: int | None = None
    ) -> None:
        slot.state = state
        if slot.stored_state == (state, reason) and pid is None:
            return
        slot.stored_state = (state, reason)
        worker = Worker(
            worker_id=slot.worker_id,
            kind=WorkerKind.ROLLOUT,
            device_id=slot.device.device_id,
            job_id=slot.job_id,
            state=state,
            pid=pid if pid is not None else (slot.proc.pid if slot.proc is not None else 0),
            state_reason=reason,
        )
        self.writes.write_nowait(upsert_worker, self.store, worker)

    def _record_device(self, device_id: str, state: DeviceState, reason: str) -> None:
        if self._device_states.get(device_id) is state:
            return
        self._device_states[device_id] = state
        METRICS.set_device_state(device_id, state.value)  # exact; the roll-up polls the store
        self.writes.write_nowait(self.store.set_device_state, device_id, state, reason)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("supervisor task failed", exc_info=task.exception())
