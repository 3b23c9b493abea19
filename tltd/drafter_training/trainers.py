"""This node's drafter trainers: the supervisor's `TrainingHook`, one `TrainerRun` (and trainer
process) per job, started, preempted, stopped and reaped here.

Where the rest lives: `runs.py` is one trainer as the daemon tracks it (its phases and their
transitions), `process.py` its process handle and spawn spec, `rounds.py` what a round does,
`records.py` the one writer of the rows drafter training writes, `samples.py` the samples it
trains and is measured on, `lease.py` the several-node lease, `versions.py` the promote-or-reject
decision on a measured candidate.

The scheduler decides (`start_training`, `preempt_training`); this module carries it out:
- finished rollout samples are kept per job (`samples.py`), some held out to measure
  acceptance at publish time;
- `start` spawns (or reuses) one `TrainerProcess` per job (a new policy version of the same
  architecture is loaded into it in place: `SetPolicy`), feeds it the new samples and runs one
  round of `training_steps_per_round` optimizer steps on the device it was given; it returns at
  once (it runs in the supervisor's tick): stopping an old trainer, spawning and loading a new
  one run in a background task (`_launch`);
- `preempt` asks the worker for the device back and records the measured latency
  (request -> "device_free"); the trainer keeps its state in memory and resumes next round;
- `close` (SIGTERM / drain) stops every worker, which writes its trainer checkpoint first;
- a worker heartbeats from a thread; `reap` (a periodic job) kills one silent for
  `training_heartbeat_timeout_seconds` (hung, not dead: a dead one's pipe closes).

Several nodes on PostgreSQL: a job's drafter trains on one node at a time, under its drafter
lease (`lease.py`); samples then come from the store, every node's (`samples.py` holds them).

The trainer speaks the typed protocol of `tltd.contract.drafter_messages`. Its messages are
read by one thread per process (`tltd.supervisor.worker_pipe`) and handled, in order, by one
task on the event loop (`inbox.py`); store writes go through the one writer (`records.py`) so
the loop never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.contract import drafter_messages as proto
from tltd.domain import DeviceKind, DeviceState, Sample, WorkerState
from tltd.drafter_training.inbox import Inbox
from tltd.drafter_training.lease import LeaseHolder
from tltd.drafter_training.process import TrainerProcess, new_trainer, policy_config
from tltd.drafter_training.records import TrainingRecords
from tltd.drafter_training.rounds import RoundRunner
from tltd.drafter_training.runs import HOLDING, Preemption, TrainerPhase, TrainerRun
from tltd.drafter_training.samples import SampleBuffers, training_sample
from tltd.metrics import METRICS
from tltd.scheduler import TrainingView
from tltd.settings import Settings
from tltd.stall import forgiven
from tltd.supervisor.training_hook import JobTraining
from tltd.supervisor.worker_pipe import HeartbeatStamp, join_or_kill, serve_pipe

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# Phases names, short: every method below moves runs between them.
P = TrainerPhase


class DrafterTraining:
    """The `tltd.supervisor.TrainingHook` of the daemon (one per node)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.root = Path(settings.data_dir) / "drafters"  # this node's trainer checkpoints
        self.cluster = store.dialect == "postgresql"
        self.samples = SampleBuffers(settings)
        self.leases = LeaseHolder(store, settings, self.samples)  # several nodes
        self.records = TrainingRecords(store)
        self.rounds = RoundRunner(
            store, settings, self.samples, self.leases, self.records, self._kick
        )
        self.on_change: Callable[[], None] | None = None  # the supervisor's kick
        self._runs: dict[str, TrainerRun] = {}
        self._warmed: set[str] = set()  # jobs whose trainer was spawned ahead (or judged not to)
        self._last_start: dict[str, float] = {}
        self._closed = False
        self._closing: asyncio.Future | None = None
        self._close_deadline = math.inf  # monotonic; a later, shorter close lowers it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: Inbox[tuple[TrainerRun, proto.FromTrainer | None]] | None = None

    @property
    def preemptions(self) -> list[Preemption]:
        return self.rounds.preemptions

    @property
    def fenced(self) -> list[tuple[str, int]]:
        """(job, lease epoch) of the publishes a lost lease refused."""
        return self.rounds.fenced

    # ---- the TrainingHook protocol (event loop) ------------------------------------------

    def views(self) -> tuple[TrainingView, ...]:
        return tuple(
            TrainingView(r.device_id, r.job_id) for r in self._runs.values() if r.phase in HOLDING
        )

    def job_view(self, job_id: str) -> JobTraining:
        fresh = self.samples.fresh[job_id]
        if self.cluster:
            self.leases.asked.add(job_id)
            fresh = max(fresh, self.leases.backlog.get(job_id, 0))
        run = self._runs.get(job_id)
        cut_short = (
            run is not None and run.round.open and (run.phase is P.IDLE or run.round.gave_way)
        )
        last = self._last_start.get(job_id)
        # A trainer that found nothing to train on holds nothing the next round could use.
        buffered = 0 if run is not None and run.round.starved else self.samples.buffered(job_id)
        return JobTraining(fresh, last, cut_short, buffered)

    def on_sample(self, job_id: str, prompt: tuple[int, ...], sample: Sample) -> None:
        item = training_sample(prompt, sample.token_ids, sample.policy_version)
        if item is None:
            return
        run = self._runs.get(job_id)
        if run is not None:
            run.round.starved = False
        elif self.settings.training_warm_start and not self.cluster and job_id not in self._warmed:
            self._warmed.add(job_id)
            self._ensure_loop()
            asyncio.ensure_future(self._warm(job_id))
        if self.cluster:
            self.samples.fresh[job_id] += 1  # a hint: training reads every node's samples by cursor
            return
        self.samples.add_finished(job_id, item)

    async def start(self, device_id: str, job_id: str) -> None:
        """Train `job_id`'s drafter on `device_id` for one round (spawning its worker if needed).

        Returns once the device is recorded TRAINING: it runs in the supervisor's tick, so a
        new trainer process (and the stop of one it replaces) is left to a background task."""
        self._ensure_loop()
        run = self._runs.get(job_id)
        if self._closed or (run is not None and run.phase not in (P.IDLE, P.STOPPED)):
            return
        lease = None
        if self.cluster:
            self._last_start[job_id] = time.monotonic()  # a refused claim waits the cadence
            lease = await self.leases.claim(job_id)
            if lease is None or not await self.leases.pull(job_id, lease):
                if run is not None:
                    run.round.open = False  # not resumed at once either: it waits the cadence
                return
        job = await asyncio.to_thread(self.store.jobs.get, job_id)
        device = await asyncio.to_thread(self.store.devices.get, device_id)
        torch_device = "cpu" if device.kind is DeviceKind.CPU else device_id
        self._last_start[job_id] = time.monotonic()
        self.samples.fresh[job_id] = 0
        self.leases.backlog.pop(job_id, None)
        reason = f"training the drafter of job {job_id} on idle device {device_id}"
        await self.records.device(device_id, DeviceState.TRAINING, reason)
        alive = run is not None and run.alive
        lease_epoch = lease.lease_epoch if lease is not None else 0
        if alive and (run.torch_device, run.lease.epoch) == (torch_device, lease_epoch):
            if run.policy_version != job.policy_version:
                if await self._load_in_place(run, job.policy_version):
                    reason = f"{reason}; policy version {run.policy_version} loaded in place"
            if run.phase is not P.IDLE:  # stopped meanwhile (a lost lease, a failure)
                await self.records.device(device_id, DeviceState.IDLE, "its trainer stopped")
                return
            if run.policy_version == job.policy_version:
                run.device_id = device_id
                await self.rounds.begin(run, reason)
                return
        # A new device, another architecture or a dead trainer needs a new process, which
        # resumes from the checkpoint the old one writes as it stops. A new
        # lease taken from another node starts from the last version published.
        new = TrainerRun(job_id, device_id, torch_device, job.policy_version)
        new.lease.epoch = lease_epoch
        if lease is not None:
            new.lease.taken_over = bool(lease.taken_from) or (
                run is not None and run.lease.epoch not in (0, lease_epoch)
            )
            new.lease.start_version = lease.published_version
        new.replaces = run if alive else None
        self._runs[job_id] = new
        METRICS.set_trainer_loading(device_id, True)  # held, not training until its Ready
        start_version = new.lease.start_version or job.drafter_version
        new.launch = asyncio.ensure_future(self._launch(new, start_version, reason))

    async def _warm(self, job_id: str) -> None:
        """`training_warm_start`: spawn the job's trainer at its first finished sample, on the
        CPU, and leave it idle, so that its first round trains from the first second of an
        idle window instead of loading through it. Single node, CPU devices only: a trainer
        on an accelerator loads onto the device it is given."""
        if self._closed:
            return
        try:
            job = await asyncio.to_thread(self.store.jobs.get, job_id)
            devices = await asyncio.to_thread(self.store.devices.list)
        except Exception:  # an optimisation: the first round starts its trainer anyway
            log.warning("no warm start for the drafter trainer", exc_info=True,
                        extra={"job_id": job_id})  # fmt: skip
            return
        cpu_only = bool(devices) and all(d.kind is DeviceKind.CPU for d in devices)
        if not (job.speculative.online_training and cpu_only):
            return
        if self._closed or job_id in self._runs:  # a round started meanwhile
            return
        # No round asked yet (round.open False): the scheduler's rule starts the first one.
        run = TrainerRun(job_id, "", "cpu", job.policy_version, phase=P.WARMING)
        run.round.open = False
        self._runs[job_id] = run
        reason = f"warm start: job {job_id}'s first samples are in; waits for an idle device"
        run.launch = asyncio.ensure_future(self._launch(run, job.drafter_version, reason))

    async def preempt(self, device_id: str, reason: str) -> None:
        """Ask the training on `device_id` to yield now; `device_free` completes it."""
        for run in self._runs.values():
            if run.device_id != device_id or run.phase not in HOLDING:
                continue
            run.preempt_at, run.preempt_reason = time.monotonic(), reason
            starting = run.phase is P.STARTING
            run.to(P.PREEMPTING)
            if starting:
                continue  # _launch releases it once the process is up
            run.send(proto.Preempt())
            log.info("preempting drafter training", extra={"job_id": run.job_id, "reason": reason})

    # ---- lifecycle ------------------------------------------------------------------------

    def close(
        self, why: str = "daemon shutting down", deadline: float | None = None
    ) -> asyncio.Future:
        """Stop every trainer; each writes its checkpoint before it exits (SIGTERM, drain)
        unless `deadline` (monotonic; default 70 s from now) comes first: what is left then
        is killed. Idempotent: a close already under way (a node drain, then SIGTERM) is
        returned, its deadline lowered to this one if earlier."""
        deadline = time.monotonic() + 70.0 if deadline is None else deadline
        self._close_deadline = min(self._close_deadline, deadline)
        if self._closing is None:
            self._closed = True
            self._closing = asyncio.ensure_future(self._close(why))
        return self._closing

    async def _close(self, why: str) -> None:
        # All at once: each trainer gets the whole time left to checkpoint.
        runs = list(self._runs.values())
        await asyncio.gather(*(self._close_run(run, why) for run in runs))
        if self._inbox is not None:
            await self._inbox.close()
        await self.records.close()

    async def _close_run(self, run: TrainerRun, why: str) -> None:
        if run.launch is not None and not await self._wait(run.launch):
            # Still loading its target at the deadline: kill what it spawned (its launch then
            # fails, or finds the daemon closed); there is nothing to checkpoint yet.
            run.to(P.STOPPED)
            for worker in run.processes():
                await asyncio.to_thread(worker.kill)
            await self.records.worker(run, WorkerState.STOPPING, why)
            await self.records.worker(run, WorkerState.STOPPED, f"{why}; killed while starting")
            if run.device_id:  # a warm start holds no device
                await self.records.device(run.device_id, DeviceState.IDLE, why)
            return
        if run.alive:
            await self._stop_run(run, why)

    async def _wait(self, fut: asyncio.Future, limit: float = math.inf) -> bool:
        """Wait for `fut` until `limit` (monotonic) or the close deadline, which a shutdown
        may lower meanwhile (hence polled); True when it is done."""
        while not fut.done():
            left = min(limit, self._close_deadline) - time.monotonic()
            if left <= 0:
                return False
            await asyncio.wait([fut], timeout=min(left, 0.1))
        return True

    async def reap(self, stalled: float = 0.0) -> list[str]:
        """Kill trainers silent for `training_heartbeat_timeout_seconds` (hung, not dead: a
        dead one's pipe closes and `_on_died` records it); returns their worker ids.
        `stalled`: seconds the daemon itself did not run since the last look (not theirs)."""
        timeout = self.settings.training_heartbeat_timeout_seconds
        now = time.monotonic()
        if stalled:
            for run in self._runs.values():
                run.last_heartbeat = forgiven(run.last_heartbeat, stalled, now)
        silent = [r for r in self._runs.values() if r.alive and now - r.last_heartbeat > timeout]
        for run in silent:
            log.error("drafter trainer silent: killed", extra={"job_id": run.job_id})
            await self._fail(run, f"killed: no heartbeat for {timeout:g}s")
        return [run.worker_id for run in silent]

    async def abort(self) -> None:
        """Kill every trainer without a checkpoint (a daemon crash, in tests)."""
        self._closed = True
        for run in self._runs.values():
            for worker in run.processes():
                await asyncio.to_thread(worker.kill)
            if run.outbox is not None:
                run.outbox.put(None)
        if self._inbox is not None:
            await self._inbox.close()
        await self.records.close(wait=False)

    async def _stop_run(self, run: TrainerRun, why: str, timeout: float = 60.0) -> None:
        """Stop one trainer (checkpoint first) within `timeout`, or the close deadline."""
        limit = time.monotonic() + timeout
        holding = run.holding
        run.to(P.STOPPING)  # its exit is expected from here on
        await self.records.worker(run, WorkerState.STOPPING, why)
        run.send(proto.StopTrainer())
        stopped = asyncio.ensure_future(run.stopped.wait())
        if not await self._wait(stopped, limit):
            stopped.cancel()
            log.error("drafter trainer did not stop in time", extra={"job_id": run.job_id})
        worker = run.worker
        if worker is not None:
            left = min(limit, self._close_deadline) - time.monotonic()
            await join_or_kill(worker.proc, min(10.0, left))
        run.to(P.STOPPED)
        if run.outbox is not None:
            run.outbox.put(None)
        ckpt = f"; checkpoint {run.checkpoint}" if run.checkpoint else "; no checkpoint written"
        await self.records.worker(run, WorkerState.STOPPED, f"{why}{ckpt}")
        if holding:
            await self.records.device(run.device_id, DeviceState.IDLE, why)
        await self._release_lease(run)

    # ---- a trainer's process ----------------------------------------------------------------

    async def _launch(self, run: TrainerRun, active_drafter: int, reason: str) -> None:
        """`start`'s background part: stop the trainer `run` replaces, spawn `run`'s, wait for
        its Ready, begin the round. Every way it can fail records the run and gives the device
        back: nothing else rewrites a TRAINING device (the supervisor leaves it to us)."""
        try:
            started = await self._spawn_worker(run, active_drafter, reason)
        except Exception as exc:
            if run.phase is not P.STOPPED:  # not killed by `close` (which recorded it)
                log.exception("drafter trainer failed to start", extra={"job_id": run.job_id})
            await self._give_up(run, WorkerState.FAILED, f"cannot start: {exc}")
            return
        if started is None and run.phase is P.PREEMPTING:
            why = self.rounds.note_preemption(run, run.step)
            run.round.gave_way = True  # its round is still asked for: a new launch, at once
            await self._give_up(run, WorkerState.STOPPED, f"{why}; before its trainer started")
            return
        if started is None:
            await self._give_up(run, WorkerState.STOPPED, "not started: daemon shutting down")
            return
        worker, ready = started
        if run.phase is P.STOPPED:  # up after `close` gave up on it: nobody else stops it
            await asyncio.to_thread(worker.kill)
            run.stopped.set()
            return
        self._serve(run, worker, ready)
        resumed = f", resumed from {ready.resumed_from}" if ready.resumed_from else ""
        if run.phase is P.WARMING:
            run.to(P.IDLE)
            why = f"up at step {run.step}{resumed}; idle"
            await self.records.worker(run, WorkerState.READY, why)
            self._kick()
            return
        METRICS.set_trainer_loading(run.device_id, False)
        await self.records.worker(run, WorkerState.READY, f"up at step {run.step}{resumed}")
        if run.phase is P.PREEMPTING:  # preempted while loading: free the device at once
            run.send(proto.Preempt())
            return
        if run.phase is P.STARTING:  # not stopped meanwhile
            await self.rounds.begin(run, reason)

    def _serve(self, run: TrainerRun, worker: TrainerProcess, ready: proto.TrainerReady) -> None:
        """A trainer up: serve its pipe (messages to the inbox) and refill its empty buffer."""
        run.worker, run.step = worker, ready.step
        run.round.published_step = run.step
        run.last_heartbeat = time.monotonic()
        assert self._loop is not None
        stamp = HeartbeatStamp(self.store, run.worker_id)
        run.outbox = serve_pipe(
            run.worker_id,
            worker.conn,
            self._loop,
            receive=lambda ms: [self._receive(run, stamp, m) for m in ms],
            deliver=lambda m: self._inbox_put(run, m),
            closed=lambda: self._inbox_put(run, None),
        )
        # A new process has an empty buffer: refill it with the recent samples.
        run.send(proto.AddSamples(self.samples.recent(run.job_id)))

    async def _spawn_worker(
        self, run: TrainerRun, active_drafter: int, reason: str
    ) -> tuple[TrainerProcess, proto.TrainerReady] | None:
        """Stop the trainer `run` replaces, then spawn `run`'s and wait for its Ready (killed
        if that fails); None, with nothing spawned, once `close` has begun or the device
        was preempted back for rollouts."""
        if run.replaces is not None:
            why = f"restarting for policy version {run.policy_version}"
            await self._stop_run(run.replaces, why)
            run.replaces = None
        # `close` may have recorded this run already (not overwritten); a device preempted
        # meanwhile is rollout's now (a trainer loading there could run it out of memory).
        if self._closed or run.phase is P.PREEMPTING:
            return None
        await self.records.worker(run, WorkerState.STARTING, f"spawning: {reason}")
        args = (self.store, self.settings, self.root, run.job_id, run.policy_version)
        worker, run.policy_config = await asyncio.to_thread(
            new_trainer, *args, run.torch_device, active_drafter, run.lease.taken_over
        )
        if self._closed or run.phase is P.PREEMPTING:  # again, right before the spawn
            if run.phase is not P.STOPPED:  # (STARTING is recorded: STOPPED only by way of it)
                await self.records.worker(run, WorkerState.STOPPING, "not spawned")
            return None
        run.spawning = worker
        try:
            await asyncio.to_thread(worker.spawn)
            # Recorded at once: the model loading takes GPU memory, and a pid unknown to the
            # store would make that use look foreign (the device would be vacated).
            pid = worker.proc.pid
            await self.records.worker(run, WorkerState.STARTING, f"loading: {reason}", pid=pid)
            ready = await asyncio.to_thread(
                worker.wait_for, proto.TrainerReady, self.settings.training_start_timeout_seconds
            )
        except Exception:
            await asyncio.to_thread(worker.kill)  # e.g. timed out loading: not left holding it
            raise
        finally:
            run.spawning = None
        return worker, ready

    async def _load_in_place(self, run: TrainerRun, version: int) -> bool:
        """An idle trainer takes policy `version` into its loaded target when the architecture
        is the same (an RL job pushes one every step: a new process would load torch, the
        target and a checkpoint again, seconds of a rollout's short tail); its drafter,
        optimizer and buffer carry on. Otherwise it is left to a new process."""
        policy = await asyncio.to_thread(self.store.policies.get, run.job_id, version)
        config = await asyncio.to_thread(policy_config, policy.path)
        if config is None or config != run.policy_config:
            return False
        run.send(proto.SetPolicy(policy.path, version))
        run.policy_version = version
        return True

    async def _give_up(self, run: TrainerRun, state: WorkerState, why: str) -> None:
        """A launch that ends without a trainer: record the run, give the device back."""
        run.stopped.set()
        if run.phase is P.STOPPED:  # `close` gave up on it first, and recorded that
            return
        holding = run.holding
        run.to(P.STOPPED)
        await self.records.worker(run, state, why)
        if holding:  # not a warm start's (which holds no device)
            await self.records.device(run.device_id, DeviceState.IDLE, why)
        await self._release_lease(run)
        self._kick()

    async def _fail(self, run: TrainerRun, why: str) -> None:
        """Kill the trainer, record it FAILED and give back the device it held."""
        holding = run.holding
        run.to(P.STOPPED)
        if run.outbox is not None:
            run.outbox.put(None)
        if run.worker is not None:
            await asyncio.to_thread(run.worker.kill)
        await self.records.worker(run, WorkerState.FAILED, why)
        if holding:
            await self.records.device(run.device_id, DeviceState.IDLE, why)
        await self._release_lease(run)
        self._kick()

    # ---- worker messages (one consumer task, in order) -------------------------------------

    def _receive(
        self, run: TrainerRun, stamp: HeartbeatStamp, m: proto.FromTrainer
    ) -> proto.FromTrainer | None:
        """Reader thread: any message is a sign of life; heartbeats stop here."""
        run.last_heartbeat = time.monotonic()
        if isinstance(m, proto.TrainerHeartbeat):
            stamp()  # shown by `tltctl workers`; written here, off the loop
            return None
        return m

    def _inbox_put(self, run: TrainerRun, m: proto.FromTrainer | None) -> None:
        """On the loop: one consumer handles every trainer's messages in order (None: the
        pipe closed)."""
        if self._inbox is not None:
            self._inbox.put((run, m))

    async def _handle(self, item: tuple[TrainerRun, proto.FromTrainer | None]) -> None:
        run, m = item
        match m:
            case proto.Stepped(result=r):
                run.step, run.loss = r.step, r.loss
            case proto.Idle(reason=reason) if run.phase is P.TRAINING:
                run.round.open = False  # its steps done, or no data left to train on
                run.round.starved = reason == "no_data"
                await self.rounds.end(run, f"round done at step {run.step} ({reason})")
            case proto.Measured():
                lost = await self.rounds.on_measured(run, m)
                if lost and run.alive:  # not awaited: its Stopped comes through this consumer
                    asyncio.ensure_future(self._stop_run(run, lost))
            case proto.DeviceFree():
                await self.rounds.on_device_free(run, m)
            case proto.Checkpointed(path=path):
                run.checkpoint = path or run.checkpoint
            case proto.Stopped(path=path):
                run.checkpoint = path or run.checkpoint
                run.stopped.set()
            case proto.Failed() | None:
                run.stopped.set()
                if run.phase not in (P.STOPPING, P.STOPPED) and not self._closed:
                    await self._on_died(run, m.traceback if m else "process exited")

    async def _on_died(self, run: TrainerRun, why: str) -> None:
        last = why.strip().splitlines()[-1] if why.strip() else why
        log.error("drafter trainer died", extra={"job_id": run.job_id, "error": why})
        await self._fail(run, f"trainer died: {last}")

    # ---- several nodes: the drafter lease (lease.py) -------------------------------------

    async def renew(self) -> list[str]:
        """Several nodes (a periodic job): extend the lease of every job whose trainer lives
        here, stop a trainer whose lease was lost (another node may train that drafter now),
        and read how many samples of every node wait for each job. Returns the jobs lost."""
        if not self.cluster:
            return []

        def live_epoch(job_id: str) -> int | None:
            run = self._runs.get(job_id)
            return None if run is None or run.phase is P.STOPPED else run.lease.epoch

        lost = await self.leases.renew(live_epoch)
        for job_id in lost:
            run = self._runs[job_id]
            if run.alive:
                asyncio.ensure_future(self._stop_run(run, "drafter lease lost"))
        if self.leases.waiting():
            self._kick()
        return lost

    async def _release_lease(self, run: TrainerRun) -> None:
        """A stopped trainer gives its lease up at once (not when it would expire), unless a
        newer trainer of the job runs under it."""
        if not self.cluster or self._runs.get(run.job_id) is not run:
            return
        if self.leases.forget_if_held(run.job_id, run.lease.epoch):
            release = self.store.drafter_leases.release
            await self.records.write(release, run.job_id, run.lease.epoch)

    # ---- helpers --------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._inbox = Inbox(self._handle, lambda item: type(item[1]).__name__)
            self.records.start()

    def _kick(self) -> None:
        if self.on_change is not None:
            self.on_change()
