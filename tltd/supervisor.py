"""The supervisor: one rollout worker process per device, their health, and the scheduling tick.

Everything here runs on the daemon's event loop except two threads per worker (one reads its
pipe and stores what it reports, one writes commands), so a slow or hung worker never blocks
the loop. The tick is schedule -> execute -> record: build a `Snapshot`, call the pure
`tltd.scheduler.schedule`, send the assignments, record device and worker states.

The tick is driven by the supervisor's own loop, not by APScheduler: it must react within
milliseconds of an event (a new request, a finished sample, a worker ready), so every such
event kicks it, with `scheduler_tick_seconds` as a fallback period. The health reaper (dead or
silent workers) is a periodic job in `tltd.periodic`.

Policy versions: a request runs entirely on the policy version that was current when it was
accepted ("finish on the old version"); every sample records the version that produced it.
A worker switches version (or job) only when it has nothing running, to the oldest version that
still has waiting work, else to its job's current version.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue as threading_queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from tltd.domain import (
    Device,
    DeviceKind,
    DeviceState,
    FinishReason,
    Job,
    JobStatus,
    RequestStatus,
    RolloutRequest,
    Sample,
    SpeculativeMode,
    Worker,
    WorkerKind,
    WorkerState,
)
from tltd.errors import TltError
from tltd.metrics import METRICS
from tltd.scheduler import (
    Decision,
    DeviceView,
    JobView,
    RolloutWorkerView,
    SchedulerConfig,
    Snapshot,
    TrainingView,
    schedule,
)
from tltd.settings import Settings
from tltd.workqueue import Key, LiveRequest, WorkQueue
from workers.rollout import protocol as msg

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

TERMINAL = (RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED)
_OPEN = (RequestStatus.QUEUED, RequestStatus.RUNNING)


@dataclass(frozen=True)
class StreamEvent:
    """What a Generate stream receives: a stored sample, or (sample None) the request's end."""

    sample: Sample | None = None
    status: RequestStatus | None = None
    reason: str = ""


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


@dataclass
class _Slot:
    """One device's rollout worker: the process, its pipe and what the daemon knows of it."""

    worker_id: str
    device: Device
    generation: int = 0  # increments per spawn; messages of an older process are ignored
    proc: Any = None  # multiprocessing Process
    outbox: threading_queue.Queue | None = None
    state: WorkerState = WorkerState.STOPPED
    reason: str = ""
    ready: bool = False  # the process said Ready at least once
    loading: bool = True  # a spawn or Load* is in flight (no work until Ready)
    since: float = 0.0  # monotonic: spawn or last load command
    last_heartbeat: float = 0.0
    heartbeat: msg.Heartbeat | None = None
    job_id: str = ""
    target_job: str = ""  # the job a LoadModel in flight is loading
    policy_version: int = 0
    drafter_version: int = 0
    seq: int = 0
    unacked: dict[int, int] = field(default_factory=dict)  # AddWork.seq -> expected tokens
    idle_since: float | None = None
    dead_at: float | None = None  # monotonic time the process was found dead
    failures: int = 0  # consecutive deaths (restart backoff)
    vacated: bool = False  # stopped on purpose (foreign device): not restarted
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    stored_state: tuple[WorkerState, str] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.dead_at is None

    def send(self, m: msg.ToWorker) -> None:
        if self.outbox is not None and self.alive:
            self.outbox.put(m)


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
        self.queue = WorkQueue()
        self.slots: dict[str, _Slot] = {}
        self.served_tokens: Counter[str] = Counter()
        self.assigned_samples = 0  # samples handed to workers, ever (no work is duplicated)
        self.draining = False
        self._assigning = True
        self._closed = False
        self._subs: dict[str, list[asyncio.Queue[StreamEvent]]] = {}
        self._paths: dict[tuple[str, int], str] = {}
        self._bad_versions: set[tuple[str, int]] = set()
        self._bad_drafters: set[tuple[str, int]] = set()
        self._device_states: dict[str, DeviceState] = {}
        self._ctx = mp.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Event | None = None
        self._writes: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._finalizing: set[str] = set()
        self._drain_task: asyncio.Future | None = None
        self._tick_lock: asyncio.Lock | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Recover what a previous daemon left open, start workers, start ticking."""
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._tick_lock = asyncio.Lock()
        self._writes = asyncio.Queue()
        self._tasks.append(asyncio.create_task(self._writer(), name="supervisor-writer"))
        await self.recover()
        await self.tick()
        self._tasks.append(asyncio.create_task(self._ticker(), name="supervisor-tick"))

    async def recover(self) -> None:
        """After a crash: workers of the old process are gone; every open request is
        re-queued with its missing samples, or failed with a reason when it cannot run."""
        for w in await asyncio.to_thread(self.store.list_workers):
            if w.state not in (WorkerState.STOPPED, WorkerState.FAILED):
                await self._write(
                    self.store.set_worker_state,
                    w.worker_id,
                    WorkerState.FAILED,
                    "daemon restarted: the previous daemon ended without stopping it",
                )
        open_reqs = await asyncio.to_thread(self.store.list_requests, list(_OPEN), None, 1 << 30)
        for req in open_reqs:
            await self._recover_request(req)

    async def _recover_request(self, req: RolloutRequest) -> None:
        job = await asyncio.to_thread(self.store.get_job, req.job_id)
        if job.status is not JobStatus.ACTIVE:
            await self._write(
                self.store.set_request_status,
                req.request_id,
                RequestStatus.FAILED,
                f"daemon restarted: job {job.job_id} is {job.status.value}",
            )
            return
        samples = await asyncio.to_thread(self.store.list_samples, req.request_id)
        complete = [s for s in samples if not s.partial]
        done = {(s.prompt_index, s.sample_index) for s in complete}
        # Keep the request on the version its finished samples came from.
        version = complete[0].policy_version if complete else job.policy_version
        if req.status is RequestStatus.RUNNING:
            missing = req.samples_total - len(done)
            await self._write(
                self.store.set_request_status,
                req.request_id,
                RequestStatus.QUEUED,
                f"daemon restarted: {missing} of {req.samples_total} samples re-queued",
            )
            req = replace(req, status=RequestStatus.QUEUED)
        live, _ = self.queue.add(req, version, done, time.monotonic())
        log.info(
            "request recovered",
            extra={"request_id": req.request_id, "missing": req.samples_total - len(done)},
        )
        if live.done:
            self._spawn(self._finalize(live))

    async def drain(self, seconds: float, why: str = "the daemon is shutting down") -> None:
        """Finish what fits in `seconds`; then workers return what still runs as partial
        samples (persisted, streamed) and every unfinished request fails with a reason."""
        await asyncio.shield(self.start_drain(seconds, why))

    def start_drain(
        self, seconds: float, why: str = "the daemon is shutting down"
    ) -> asyncio.Future:
        """Begin draining now (event loop thread); a drain already under way is returned."""
        if self._drain_task is None:
            self.draining = True
            self._drain_task = asyncio.ensure_future(self._drain(seconds, why))
        return self._drain_task

    async def _drain(self, seconds: float, why: str) -> None:
        deadline = time.monotonic() + max(0.0, seconds)
        while len(self.queue) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._assigning = False
        if not len(self.queue):
            return
        reason = f"drained: {why} (grace {seconds:g}s)"
        log.info("draining workers", extra={"requests": len(self.queue)})
        busy = [s for s in self.slots.values() if s.alive and self.queue.inflight(s.worker_id)]
        for slot in busy:
            slot.drained.clear()
            slot.send(msg.Drain(0.0))
        for live in list(self.queue):
            keys = self.queue.close(live.request_id, RequestStatus.FAILED, reason)
            await self._finish_unstarted(live, keys, FinishReason.ABORTED, reason)
        waits = [asyncio.create_task(s.drained.wait()) for s in busy]
        if waits:
            await asyncio.wait(waits, timeout=10.0)
            for w in waits:
                w.cancel()
        for slot in busy:  # a worker that did not answer: its samples end with no tokens
            if self.queue.inflight(slot.worker_id):
                await self._lose_samples(slot, "worker did not drain in time")
        for _ in range(200):  # final status writes of the requests just failed
            if not len(self.queue):
                break
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Stop every worker (Shutdown, then kill after 5 s) and record them STOPPED."""
        self._closed = True
        for t in self._tasks[1:]:
            t.cancel()
        for slot in self.slots.values():
            if slot.alive:
                self._record_state(slot, WorkerState.STOPPING, "daemon shutting down")
                slot.send(msg.Shutdown())
        for slot in self.slots.values():
            if slot.proc is not None:
                await asyncio.to_thread(slot.proc.join, 5.0)
                if slot.proc.is_alive():
                    slot.proc.kill()
                    await asyncio.to_thread(slot.proc.join, 5.0)
                if slot.state is WorkerState.STOPPING:
                    self._record_state(slot, WorkerState.STOPPED, "daemon shut down")
                slot.dead_at = slot.dead_at or time.monotonic()
                if slot.outbox is not None:
                    slot.outbox.put(None)
        if self._writes is not None:
            await self._writes.join()
        self._tasks[0].cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- the rollout API (event loop) ----------------------------------------------------

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

    async def submit(self, req: RolloutRequest, policy_version: int) -> None:
        """Make a stored request live (idempotent: a live request is left as it is). Samples
        already stored complete are not run again; a terminal request just ends its streams."""
        if self.queue.get(req.request_id) is not None:
            return
        cur = await asyncio.to_thread(self.store.get_request, req.request_id)
        if cur.status in TERMINAL:
            self._publish(cur.request_id, StreamEvent(None, cur.status, cur.status_reason))
            return
        samples = await asyncio.to_thread(self.store.list_samples, req.request_id)
        done = {(s.prompt_index, s.sample_index) for s in samples if not s.partial}
        live, created = self.queue.add(cur, policy_version, done, time.monotonic())
        if created and live.done:
            self._spawn(self._finalize(live))
        self.kick()

    def cancel_threadsafe(self, request_id: str, reason: str) -> None:
        """Called from any thread after the store marked the request CANCELLED."""
        if self._loop is not None and not self._closed:
            asyncio.run_coroutine_threadsafe(self.cancel(request_id, reason), self._loop)

    async def cancel(self, request_id: str, reason: str) -> None:
        """Stop a live request: waiting samples end now, running ones are cancelled in their
        workers (they come back CANCELLED with the tokens so far)."""
        live = self.queue.get(request_id)
        if live is None:
            return
        keys = self.queue.close(request_id, RequestStatus.CANCELLED, reason)
        for wid in set(live.running.values()):
            self.slots[wid].send(msg.Cancel(request_id))
        await self._finish_unstarted(live, keys, FinishReason.CANCELLED, reason)

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
        jobs = {
            j.job_id: j
            for j in await asyncio.to_thread(self.store.list_jobs, [JobStatus.ACTIVE], 10_000)
        }
        await self._reconcile(devices)
        await self._plan_models(jobs)
        if not self._assigning:
            return None
        now = time.monotonic()
        decision = schedule(self._snapshot(now, devices, jobs), self.sched_cfg)
        self._apply(decision, devices)
        if self.training is not None:
            for device_id in decision.preempt_training:
                await self.training.preempt(device_id, decision.reasons.get(device_id, ""))
            for t in decision.start_training:
                await self.training.start(t.device_id, t.job_id)
        return decision

    def _snapshot(self, now: float, devices: list[Device], jobs: dict[str, Job]) -> Snapshot:
        workers = []
        for s in self.slots.values():
            if not s.alive:
                continue
            tokens = (s.heartbeat.remaining_tokens if s.heartbeat else 0) + sum(s.unacked.values())
            workers.append(
                RolloutWorkerView(
                    s.worker_id,
                    s.device.device_id,
                    s.job_id,
                    ready=s.ready and not s.loading and bool(s.job_id),
                    running_samples=self.queue.inflight(s.worker_id),
                    remaining_tokens=tokens,
                    idle_since=s.idle_since,
                    policy_version=s.policy_version,
                )
            )
        job_views = []
        for j in jobs.values():
            fresh, last = self.training.job_view(j.job_id) if self.training else (0, None)
            job_views.append(
                JobView(
                    j.job_id,
                    weight=j.weight,
                    priority=j.priority,
                    served_tokens=self.served_tokens[j.job_id],
                    fresh_samples=fresh,
                    last_training_at=last,
                    online_training=self.training is not None and j.speculative.online_training,
                )
            )
        return Snapshot(
            now=now,
            devices=tuple(
                DeviceView(d.device_id, d.schedulable and d.state is not DeviceState.UNAVAILABLE)
                for d in devices
            ),
            workers=tuple(workers),
            training=self.training.views() if self.training else (),
            pending=tuple(self.queue.pending_work()),
            jobs=tuple(job_views),
        )

    def _apply(self, decision: Decision, devices: list[Device]) -> None:
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
                self._write_nowait(
                    self.store.set_request_status,
                    req.request_id,
                    RequestStatus.RUNNING,
                    f"running on {slot.worker_id}",
                )
        idle = set(decision.idle_devices)
        for d in devices:
            if d.state is DeviceState.UNAVAILABLE or d.state is DeviceState.TRAINING:
                continue
            busy = sum(self.queue.inflight(s.worker_id) for s in self._slots_on(d.device_id))
            if busy:
                self._record_device(d.device_id, DeviceState.ROLLOUT, f"{busy} samples running")
            elif d.device_id in idle:
                self._record_device(d.device_id, DeviceState.IDLE, "no rollout work")
        for slot in self.slots.values():
            if slot.alive and slot.ready:
                busy = self.queue.inflight(slot.worker_id) > 0
                state = WorkerState.BUSY if busy else WorkerState.READY
                self._record_state(slot, state, slot.reason)

    def _slots_on(self, device_id: str) -> list[_Slot]:
        return [s for s in self.slots.values() if s.device.device_id == device_id]

    # ---- workers: start, vacate, models -------------------------------------------------

    async def _reconcile(self, devices: list[Device]) -> None:
        """One worker per usable device; a device turned foreign is vacated, not fought over."""
        now = time.monotonic()
        for d in devices:
            wid = f"rollout-{d.device_id}"
            slot = self.slots.get(wid)
            usable = d.state is not DeviceState.UNAVAILABLE and not d.foreign and not self.draining
            if slot is None:
                if not usable:
                    continue
                slot = self.slots[wid] = _Slot(wid, d)
            slot.device = d
            if usable and not slot.alive:
                backoff = min(30.0, 0.5 * 2 ** max(0, slot.failures - 1)) if slot.failures else 0
                if slot.dead_at is None or now - slot.dead_at >= backoff or slot.vacated:
                    self._start_worker(slot)
            elif not usable and slot.alive and (d.foreign or d.state is DeviceState.UNAVAILABLE):
                why = "device taken by a foreign process" if d.foreign else "device unavailable"
                slot.vacated = True
                self._record_state(slot, WorkerState.STOPPING, why)
                slot.send(msg.Shutdown())
                await self._mark_dead(slot, why, WorkerState.STOPPED)

    def _start_worker(self, slot: _Slot) -> None:
        from workers.rollout.worker import main as worker_main

        parent, child = self._ctx.Pipe()
        s = self.settings
        proc = self._ctx.Process(
            target=worker_main,
            args=(child, s.worker_threads, s.worker_heartbeat_seconds),
            name=slot.worker_id,
            daemon=True,
        )
        proc.start()
        child.close()
        slot.generation += 1
        slot.proc, slot.outbox = proc, threading_queue.Queue()
        slot.ready, slot.loading, slot.since = False, True, time.monotonic()
        slot.dead_at, slot.vacated, slot.heartbeat = None, False, None
        slot.job_id, slot.policy_version, slot.drafter_version = "", 0, 0
        slot.target_job = ""
        slot.unacked.clear()
        slot.idle_since = None
        slot.last_heartbeat = time.monotonic()
        gen = slot.generation
        threading.Thread(
            target=self._read_pipe,
            args=(slot, gen, parent),
            name=f"{slot.worker_id}-rx",
            daemon=True,
        ).start()
        threading.Thread(
            target=_write_pipe,
            args=(slot.outbox, parent),
            name=f"{slot.worker_id}-tx",
            daemon=True,
        ).start()
        self._record_state(slot, WorkerState.STARTING, "spawned", pid=proc.pid)
        log.info("rollout worker started", extra={"worker_id": slot.worker_id, "pid": proc.pid})

    async def _plan_models(self, jobs: dict[str, Job]) -> None:
        """Point every empty worker at the (job, policy version) it should hold next."""
        pending: dict[str, set[int]] = {}
        for p in self.queue.pending_work():
            pending.setdefault(p.job_id, set()).add(p.policy_version or 0)
        for slot in self.slots.values():
            if not slot.alive or not slot.ready or slot.loading:
                continue
            if self.queue.inflight(slot.worker_id) == 0:
                target = self._target(slot, jobs, pending)
                if target is not None and target != (slot.job_id, slot.policy_version):
                    await self._load(slot, jobs[target[0]], target[1])
                    continue
            job = jobs.get(slot.job_id)
            if job is not None:
                await self._sync_drafter(slot, job)

    def _target(
        self, slot: _Slot, jobs: dict[str, Job], pending: dict[str, set[int]]
    ) -> tuple[str, int] | None:
        """What an empty worker should hold: its job's oldest version with waiting work; else
        the job with waiting work and the fewest workers; else its job's current version (an
        idle worker pre-loads a pushed policy); a worker with no job takes the newest job."""

        def ok(job_id: str, v: int) -> bool:
            return (job_id, v) not in self._bad_versions

        def oldest(job_id: str) -> int | None:
            return min((v for v in pending.get(job_id, ()) if ok(job_id, v)), default=None)

        own = slot.job_id if slot.job_id in jobs else ""
        if own and (v := oldest(own)) is not None:
            return own, v  # old requests finish on their version
        holders = Counter(s.target_job or s.job_id for s in self.slots.values() if s.alive)
        waiting = [j for j in pending if j in jobs and oldest(j) is not None]
        if waiting:
            job_id = min(waiting, key=lambda j: (holders[j], j))
            return job_id, oldest(job_id)  # type: ignore[return-value]
        if own and ok(own, jobs[own].policy_version):
            return own, jobs[own].policy_version
        if not own and jobs:
            newest = max(jobs.values(), key=lambda j: (j.created_at or 0, j.job_id))
            if ok(newest.job_id, newest.policy_version):
                return newest.job_id, newest.policy_version
        return None

    async def _load(self, slot: _Slot, job: Job, version: int) -> None:
        path = await self._policy_path(job.job_id, version)
        slot.loading, slot.since = True, time.monotonic()
        if slot.job_id == job.job_id:
            slot.send(msg.LoadPolicy(path, version))
            slot.reason = f"loading policy version {version}"
            return
        spec = job.speculative
        device = "cpu" if slot.device.kind is DeviceKind.CPU else slot.device.device_id
        engine = msg.EngineSpec(
            max_batch=self.settings.worker_max_batch,
            max_seq_len=self.settings.worker_max_seq_len,
            spec_mode="off" if spec.mode is SpeculativeMode.OFF else "adaptive",
            batch_threshold=spec.batch_threshold,
            draft_lengths=spec.draft_lengths,
            drafter=spec.drafter,
            device=device,
        )
        slot.target_job = job.job_id
        slot.send(msg.LoadModel(job.job_id, path, version, engine))
        slot.reason = f"loading job {job.job_id} policy version {version}"

    async def _policy_path(self, job_id: str, version: int) -> str:
        key = (job_id, version)
        if key not in self._paths:
            pv = await asyncio.to_thread(self.store.get_policy_version, job_id, version)
            self._paths[key] = pv.path
        return self._paths[key]

    async def _sync_drafter(self, slot: _Slot, job: Job) -> None:
        """Hot-swap the job's active learned drafter into the worker (between steps)."""
        wanted = job.drafter_version
        if job.speculative.mode is SpeculativeMode.OFF or job.speculative.drafter == "ngram":
            wanted = 0
        if wanted == slot.drafter_version or (job.job_id, wanted) in self._bad_drafters:
            return
        path = ""
        if wanted:
            path = (await asyncio.to_thread(self.store.get_drafter, job.job_id, wanted)).path
        slot.loading, slot.since = True, time.monotonic()
        slot.send(msg.SetDrafter(path, wanted))

    # ---- worker messages ----------------------------------------------------------------

    def _read_pipe(self, slot: _Slot, gen: int, conn: Connection) -> None:
        """Reader thread: samples are stored here, before the loop streams them."""
        last_beat = 0.0
        while True:
            try:
                m = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # an unpicklable message: treat the worker as broken
                log.exception("bad message from worker", extra={"worker_id": slot.worker_id})
                break
            stored: bool | None = None
            if isinstance(m, msg.Finished):
                try:
                    stored = self.store.add_sample(m.sample)
                except Exception:
                    log.exception("cannot store sample", extra={"worker_id": slot.worker_id})
            elif isinstance(m, msg.Heartbeat) and time.monotonic() - last_beat >= 2.0:
                last_beat = time.monotonic()
                try:
                    self.store.heartbeat_worker(slot.worker_id)
                except TltError:
                    pass  # the row is written by the loop's writer; next beat will do
            self._post(self._on_message, slot, gen, m, stored)
        conn.close()
        self._post(self._on_exit, slot, gen)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:
                pass  # the loop closed while we were reading

    def _on_message(self, slot: _Slot, gen: int, m: msg.FromWorker, stored: bool | None) -> None:
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
                slot.ready, slot.loading, slot.failures = True, False, 0
                slot.job_id, slot.policy_version = m.job_id, m.policy_version
                slot.target_job = ""
                slot.drafter_version = m.drafter_version
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
                self._on_load_failed(m)
            case msg.Drained():
                slot.drained.set()
            case msg.WorkerError(message=text, fatal=fatal):
                log.error(
                    "rollout worker error",
                    extra={"worker_id": slot.worker_id, "fatal": fatal, "error": text},
                )
                if fatal:
                    slot.reason = text.strip().splitlines()[-1] if text.strip() else "fatal error"

    def _on_finished(self, slot: _Slot, sample: Sample, stored: bool | None) -> None:
        key = (sample.prompt_index, sample.sample_index)
        live = self.queue.get(sample.request_id)
        if stored is None:
            # Not persisted, so not streamed: run it again (counts as a lost attempt).
            if live is not None and live.running.get(key) == slot.worker_id:
                self._spawn(self._retry_sample(live, key))
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
            self.served_tokens[live.job_id] += len(sample.token_ids)
            if self.training is not None:
                self.training.on_sample(live.job_id, live.req.prompts[key[0]], sample)
        self._publish(live.request_id, StreamEvent(sample))
        if live.done:
            self._spawn(self._finalize(live))
        self.kick()

    async def _retry_sample(self, live: LiveRequest, key: Key) -> None:
        if self.queue.requeue(live.request_id, key, self.settings.max_sample_attempts):
            await self._finish_unstarted(live, [key], FinishReason.FAILED, "cannot store sample")
        self.kick()

    def _on_load_failed(self, m: msg.LoadFailed) -> None:
        if m.drafter:
            self._bad_drafters.add((m.job_id, m.policy_version))
            log.error("drafter load failed", extra={"job_id": m.job_id, "error": m.message})
            return
        self._bad_versions.add((m.job_id, m.policy_version))
        reason = f"cannot load policy version {m.policy_version} of job {m.job_id}: {m.message}"
        log.error("policy load failed", extra={"job_id": m.job_id, "error": m.message})
        for live in list(self.queue):
            if live.job_id == m.job_id and live.policy_version == m.policy_version:
                keys = self.queue.close(live.request_id, RequestStatus.FAILED, reason)
                self._spawn(self._finish_unstarted(live, keys, FinishReason.FAILED, reason))

    def _on_exit(self, slot: _Slot, gen: int) -> None:
        if gen != slot.generation or slot.dead_at is not None:
            return
        if self._closed or slot.state is WorkerState.STOPPING:
            return  # an exit we asked for: stop() / vacating records it
        self._spawn(self._mark_dead(slot, slot.reason or "process exited", WorkerState.FAILED))

    async def _mark_dead(self, slot: _Slot, why: str, state: WorkerState) -> None:
        """The worker is gone (or being vacated): re-queue its samples, record it."""
        if slot.dead_at is not None:
            return
        slot.dead_at = time.monotonic()
        slot.ready = False
        if slot.outbox is not None:
            slot.outbox.put(None)
        proc = slot.proc
        if proc is not None and proc.is_alive() and state is WorkerState.FAILED:
            proc.kill()
        if proc is not None:
            await asyncio.to_thread(proc.join, 5.0)
            if proc.exitcode is not None and state is WorkerState.FAILED:
                why = f"{why} (exit code {proc.exitcode})"
        if state is WorkerState.FAILED:
            slot.failures += 1
        log.warning("rollout worker gone", extra={"worker_id": slot.worker_id, "reason": why})
        self._record_state(slot, state, why)
        await self._lose_samples(slot, why)
        self.kick()

    async def _lose_samples(self, slot: _Slot, why: str) -> None:
        n = self.settings.max_sample_attempts
        for live, key in self.queue.lose_worker(slot.worker_id, n):
            if live.outcome is RequestStatus.CANCELLED:
                reason, error = FinishReason.CANCELLED, live.reason
            elif live.outcome is RequestStatus.FAILED:
                reason, error = FinishReason.ABORTED, live.reason
            else:
                reason, error = FinishReason.FAILED, f"{n} workers lost running it: {why}"
            await self._finish_unstarted(live, [key], reason, error)

    # ---- health (called by the periodic reaper) -----------------------------------------

    async def reap(self) -> list[str]:
        """Kill workers that stopped answering; returns the ids of those found dead."""
        now = time.monotonic()
        dead = []
        s = self.settings
        for slot in list(self.slots.values()):
            if not slot.alive:
                continue
            if slot.proc.exitcode is not None:
                why = slot.reason or "process exited"
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

    # ---- finishing samples and requests -------------------------------------------------

    async def _finish_unstarted(
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
            await self._write(_add_samples, self.store, samples)
        for sample in samples:
            key = (sample.prompt_index, sample.sample_index)
            failed = error if reason is FinishReason.FAILED else None
            if self.queue.finish(live.request_id, key, failed) is not None:
                self._publish(live.request_id, StreamEvent(sample))
        if live.done:
            await self._finalize(live)

    async def _finalize(self, live: LiveRequest) -> None:
        """Every sample is accounted for: record the request's final status, end the streams."""
        if live.request_id in self._finalizing:
            return
        self._finalizing.add(live.request_id)
        total = live.req.samples_total
        if live.outcome is not None:
            status, reason = live.outcome, live.reason
        elif live.failed:
            status = RequestStatus.FAILED
            reason = f"{live.failed} of {total} samples failed: {live.first_error}"
        else:
            status, reason = RequestStatus.COMPLETED, f"all {total} samples finished"
        try:
            final = await self._write(_final_status, self.store, live.request_id, status, reason)
            status, reason = final.status, final.status_reason
        finally:
            self.queue.remove(live.request_id)
            self._finalizing.discard(live.request_id)
            self._publish(live.request_id, StreamEvent(None, status, reason))
            self.kick()

    def _publish(self, request_id: str, event: StreamEvent) -> None:
        for q in self._subs.get(request_id, []):
            q.put_nowait(event)

    # ---- ordered store writes -------------------------------------------------------------

    async def _writer(self) -> None:
        """Runs queued store writes one at a time, in order (RUNNING before COMPLETED)."""
        assert self._writes is not None
        while True:
            fn, args, fut = await self._writes.get()
            try:
                result = await asyncio.to_thread(fn, *args)
                if fut is not None and not fut.done():
                    fut.set_result(result)
            except Exception as exc:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                elif isinstance(exc, TltError):
                    log.debug("store write refused: %s", exc)
                else:
                    log.exception("store write failed")
            finally:
                self._writes.task_done()

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._writes is not None and self._loop is not None
        fut = self._loop.create_future()
        self._writes.put_nowait((fn, args, fut))
        return await fut

    def _write_nowait(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._writes is not None:
            self._writes.put_nowait((fn, args, None))

    def _record_state(
        self, slot: _Slot, state: WorkerState, reason: str, pid: int | None = None
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
        self._write_nowait(_upsert_worker, self.store, worker)

    def _record_device(self, device_id: str, state: DeviceState, reason: str) -> None:
        if self._device_states.get(device_id) is state:
            return
        self._device_states[device_id] = state
        METRICS.set_device_state(device_id, state.value)  # exact; the roll-up polls the store
        self._write_nowait(self.store.set_device_state, device_id, state, reason)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        if task in self._tasks:
            self._tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("supervisor task failed", exc_info=task.exception())


# ---- helpers run in worker threads ---------------------------------------------------------


def _write_pipe(outbox: threading_queue.Queue, conn: Connection) -> None:
    """Writer thread: a worker busy in a long step never blocks the event loop."""
    while True:
        m = outbox.get()
        if m is None:
            return
        try:
            conn.send(m)
        except (OSError, ValueError):
            return  # the worker is gone; the reader notices


def _add_samples(store: Store, samples: list[Sample]) -> None:
    for s in samples:
        store.add_sample(s)


def _upsert_worker(store: Store, worker: Worker) -> None:
    """A restart goes FAILED/STOPPED -> STARTING; the store checks every other move."""
    current = None
    try:
        current = store.get_worker(worker.worker_id)
    except TltError:
        pass
    if current is not None and current.state is worker.state:
        store.upsert_worker(replace(worker, started_at=current.started_at))
        return
    if (
        current is not None
        and worker.state is WorkerState.STARTING
        and current.state not in (WorkerState.STOPPED, WorkerState.FAILED)
    ):
        store.set_worker_state(worker.worker_id, WorkerState.FAILED, "replaced by a new process")
    store.upsert_worker(worker)


def _final_status(
    store: Store, request_id: str, status: RequestStatus, reason: str
) -> RolloutRequest:
    """Move a request to its final status; if something else finalized it first (a cancel
    racing completion), that status stands and is returned."""
    cur = store.get_request(request_id)
    if cur.status in TERMINAL:
        return cur
    try:
        if cur.status is RequestStatus.QUEUED and status is RequestStatus.COMPLETED:
            store.set_request_status(request_id, RequestStatus.RUNNING, "resumed")
        return store.set_request_status(request_id, status, reason)
    except TltError:
        return store.get_request(request_id)
