"""Drafter training on idle devices: the supervisor's `TrainingHook` over TrainerProcess processes.

The scheduler decides (`start_training`, `preempt_training`); this module carries it out:
- finished rollout samples (token ids only: hidden states are recomputed on the training device
  with one target prefill, see workers/drafter/trainer.py) are kept per job; every
  `training_held_out_every`-th one is held out to measure acceptance at publish time;
- `start` spawns (or reuses) one `TrainerProcess` process per job, feeds it the new samples and
  runs one round of `training_steps_per_round` optimizer steps on the device it was given; it
  returns at once (it runs in the supervisor's tick): stopping an old trainer, spawning and
  loading a new one run in a background task (`_launch`);
- `preempt` asks the worker for the device back and records the measured latency
  (request -> "device_free"); the trainer keeps its state in memory and resumes next round;
- at the end of a round the trainer saves its drafter and measures held-out acceptance against
  the active version (`Measure`); this module records the version and promotes it only when it
  beats the active one (`tltd.drafter_versions`), and the supervisor then hot-swaps a promoted
  version into the rollout workers;
- `close` (SIGTERM / drain) stops every worker, which writes its trainer checkpoint first;
- a worker heartbeats from a thread; `reap` (a periodic job) kills one silent for
  `training_heartbeat_timeout_seconds` (hung, not dead: a dead one's pipe closes).

Several nodes on PostgreSQL (`cluster`): a job's drafter trains on one node at a time, under
the drafter lease of `tltd.store.drafter_leases`. A round starts only on the node that holds
(or takes) the lease; `renew` (a periodic job) extends it while the trainer lives and stops a
trainer whose lease was lost; a stopped trainer releases it. Samples come from the store, every
node's, after the lease's cursor (the held-out ones are those whose row id is a multiple of
`training_held_out_every`, the same on every node); a publish is fenced by the lease epoch and
moves the cursor to the last sample read before it (what a holder read and never published is
read again by the next one). A node that takes the lease from another one starts from the last
published version (and its step count), not from its own older checkpoint.

The trainer speaks the typed protocol of `tltd.contract.drafter_messages`. Its messages are read by
one thread per process (`tltd.worker_pipe`) and handled, in order, by one task on the event
loop; store writes go through `asyncio.to_thread` so the loop never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue as threading_queue
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tltd.contract import drafter_messages as proto
from tltd.domain import (
    DeviceKind,
    DeviceState,
    DrafterLease,
    Sample,
    Worker,
    WorkerKind,
    WorkerState,
)
from tltd.drafter_versions import active_drafter, publish, record
from tltd.errors import Fenced, TltError
from tltd.metrics import METRICS
from tltd.scheduler import TrainingView
from tltd.settings import Settings
from tltd.worker_pipe import HeartbeatStamp, join_or_kill, serve_pipe

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.store.drafter_leases import FinishedSample
    from tltd_workers.drafter.trainer_process import TrainerProcess

log = logging.getLogger(__name__)

# Phases in which the run holds its device (what `views()` reports to the scheduler).
_HOLDING = ("starting", "training", "publishing")


@dataclass(frozen=True)
class Preemption:
    """One preemption: how long the device took to come back (request -> device free)."""

    job_id: str
    device_id: str
    reason: str
    latency_seconds: float
    step: int


@dataclass
class _Run:
    """One job's drafter-training worker process and what the daemon knows of it."""

    job_id: str
    device_id: str
    torch_device: str
    policy_version: int
    # starting|training|publishing|releasing|preempting|idle|stopping|stopped
    phase: str = "starting"
    worker: TrainerProcess | None = None
    spawning: TrainerProcess | None = None  # while `_launch` waits for its Ready
    outbox: threading_queue.Queue | None = None
    step: int = 0
    loss: float = 0.0
    published_step: int = 0
    preempt_at: float | None = None
    preempt_reason: str = ""
    checkpoint: str = ""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    launch: asyncio.Task | None = None
    replaces: _Run | None = None  # the trainer its launch stops first (another policy/device)
    lease_epoch: int = 0  # several nodes: the drafter lease this trainer runs under
    taken_over: bool = False  # the lease came from another node: start from its last version
    start_version: int = 0  # the drafter version a new trainer starts from (0: the active one)
    measured_to: int = 0  # several nodes: the last sample id read before the publish asked
    last_heartbeat: float = 0.0  # monotonic, of any message (set by the pipe reader thread)

    @property
    def worker_id(self) -> str:
        return f"drafter-{self.job_id}"

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.phase not in ("stopping", "stopped")

    def send(self, m: proto.ToTrainer) -> None:
        if self.outbox is not None:
            self.outbox.put(m)

    def processes(self) -> list[TrainerProcess]:
        """Every trainer process of this run: up, still loading, or the one its launch stops."""
        old = self.replaces.worker if self.replaces is not None else None
        return [w for w in (self.worker, self.spawning, old) if w is not None]


class DrafterTraining:
    """The `tltd.supervisor.TrainingHook` of the daemon (one per node)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.root = Path(settings.data_dir) / "drafters"  # this node's trainer checkpoints
        self.cluster = store.dialect == "postgresql"
        self._leases: dict[str, DrafterLease] = {}  # several nodes: the leases held here
        self._backlog: dict[str, int] = {}  # unconsumed samples of every node, per job
        self._asked: set[str] = set()  # jobs the scheduler asked about
        self._renewer = ThreadPoolExecutor(1, thread_name_prefix="drafter-lease")
        self._pulled: dict[str, int] = {}  # job -> lease epoch its buffers were filled under
        self._read_to: dict[str, int] = {}  # job -> the last sample id read into its buffers
        self.on_change: Callable[[], None] | None = None  # the supervisor's kick
        self.preemptions: list[Preemption] = []
        self.fenced: list[tuple[str, int]] = []  # (job, lease epoch) of publishes refused
        self._runs: dict[str, _Run] = {}
        self._recent: dict[str, deque[proto.TrainingSample]] = {}
        self._unsent: dict[str, list[proto.TrainingSample]] = {}
        self._held: dict[str, deque[proto.TrainingSample]] = {}
        self._seen: Counter[str] = Counter()
        self._fresh: Counter[str] = Counter()
        self._last_start: dict[str, float] = {}
        self._closed = False
        self._closing: asyncio.Future | None = None
        self._close_deadline = math.inf  # monotonic; a later, shorter close lowers it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: asyncio.Queue | None = None
        self._consumer: asyncio.Task | None = None
        self._write_lock: asyncio.Lock | None = None

    # ---- the TrainingHook protocol (event loop) ------------------------------------------

    def views(self) -> tuple[TrainingView, ...]:
        return tuple(
            TrainingView(r.device_id, r.job_id) for r in self._runs.values() if r.phase in _HOLDING
        )

    def job_view(self, job_id: str) -> tuple[int, float | None]:
        if self.cluster:
            self._asked.add(job_id)
            return max(self._fresh[job_id], self._backlog.get(job_id, 0)), self._last_start.get(
                job_id
            )
        return self._fresh[job_id], self._last_start.get(job_id)

    def on_sample(self, job_id: str, prompt: tuple[int, ...], sample: Sample) -> None:
        item = proto.TrainingSample(
            (*prompt, *sample.token_ids),
            len(prompt),
            sample.policy_version,
            # The rollout "step" of the one-step offset: a policy version is one RL step.
            step=sample.policy_version,
        )
        if len(item.token_ids) <= len(prompt) + 1:
            return  # nothing a drafter position could be trained on
        if self.cluster:
            self._fresh[job_id] += 1  # a hint: training reads every node's samples by cursor
            return
        self._seen[job_id] += 1
        if self._seen[job_id] % self.settings.training_held_out_every == 0:
            held = self._held.setdefault(
                job_id, deque(maxlen=self.settings.training_held_out_samples)
            )
            held.append(item)
            return
        n = self.settings.training_recent_samples
        self._recent.setdefault(job_id, deque(maxlen=n)).append(item)
        unsent = self._unsent.setdefault(job_id, [])
        unsent.append(item)
        del unsent[:-n]  # bounded like `recent`: a trainer never needs more than that
        self._fresh[job_id] += 1

    async def start(self, device_id: str, job_id: str) -> None:
        """Train `job_id`'s drafter on `device_id` for one round (spawning its worker if needed).

        Returns once the device is recorded TRAINING: it runs in the supervisor's tick, so a
        new trainer process (and the stop of one it replaces) is left to a background task."""
        self._ensure_loop()
        run = self._runs.get(job_id)
        if self._closed or (run is not None and run.phase not in ("idle", "stopped")):
            return
        lease = None
        if self.cluster:
            self._last_start[job_id] = time.monotonic()  # a refused claim waits the cadence
            lease = await self._claim(job_id)
            if lease is None or not await self._pull(job_id, lease):
                return
        job = await asyncio.to_thread(self.store.get_job, job_id)
        device = await asyncio.to_thread(self.store.get_device, device_id)
        torch_device = "cpu" if device.kind is DeviceKind.CPU else device_id
        self._last_start[job_id] = time.monotonic()
        self._fresh[job_id] = 0
        self._backlog.pop(job_id, None)
        reason = f"training the drafter of job {job_id} on idle device {device_id}"
        await self._set_device(device_id, DeviceState.TRAINING, reason)
        alive = run is not None and run.alive
        lease_epoch = lease.lease_epoch if lease is not None else 0
        same = (run.policy_version, run.torch_device, run.lease_epoch) if run else None
        if alive and same == (job.policy_version, torch_device, lease_epoch):
            run.device_id = device_id
            await self._begin_round(run, reason)
            return
        # The trainer's target is loaded at spawn: a new policy (or device) needs a new
        # process, which resumes from the checkpoint the old one writes as it stops. A new
        # lease taken from another node starts from the last version published.
        new = _Run(job_id, device_id, torch_device, job.policy_version, lease_epoch=lease_epoch)
        if lease is not None:
            new.taken_over = bool(lease.taken_from) or (
                run is not None and run.lease_epoch not in (0, lease_epoch)
            )
            new.start_version = lease.published_version
        new.replaces = run if alive else None
        self._runs[job_id] = new
        start_version = new.start_version or job.drafter_version
        new.launch = asyncio.ensure_future(self._launch(new, start_version, reason))

    async def preempt(self, device_id: str, reason: str) -> None:
        """Ask the training on `device_id` to yield now; `device_free` completes it."""
        for run in self._runs.values():
            if run.device_id != device_id or run.phase not in _HOLDING:
                continue
            run.preempt_at, run.preempt_reason = time.monotonic(), reason
            if run.phase == "starting":
                run.phase = "preempting"  # _launch releases it once the process is up
                continue
            run.phase = "preempting"
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
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)

    async def _close_run(self, run: _Run, why: str) -> None:
        if run.launch is not None and not await self._wait(run.launch):
            # Still loading its target at the deadline: kill what it spawned (its launch then
            # fails, or finds the daemon closed); there is nothing to checkpoint yet.
            run.phase = "stopped"
            for worker in run.processes():
                await asyncio.to_thread(worker.kill)
            await self._record(run, WorkerState.STOPPING, why)
            await self._record(run, WorkerState.STOPPED, f"{why}; killed while starting")
            await self._set_device(run.device_id, DeviceState.IDLE, why)
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

    async def reap(self) -> list[str]:
        """Kill trainers silent for `training_heartbeat_timeout_seconds` (hung, not dead: a
        dead one's pipe closes and `_on_died` records it); returns their worker ids."""
        timeout = self.settings.training_heartbeat_timeout_seconds
        now = time.monotonic()
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
        if self._consumer is not None:
            self._consumer.cancel()
            await asyncio.gather(self._consumer, return_exceptions=True)

    async def _stop_run(self, run: _Run, why: str, timeout: float = 60.0) -> None:
        """Stop one trainer (checkpoint first) within `timeout`, or the close deadline."""
        limit = time.monotonic() + timeout
        holding = run.phase in (*_HOLDING, "preempting", "releasing")
        run.phase = "stopping"  # its exit is expected from here on
        await self._record(run, WorkerState.STOPPING, why)
        run.send(proto.Stop())
        stopped = asyncio.ensure_future(run.stopped.wait())
        if not await self._wait(stopped, limit):
            stopped.cancel()
            log.error("drafter trainer did not stop in time", extra={"job_id": run.job_id})
        worker = run.worker
        if worker is not None:
            left = min(limit, self._close_deadline) - time.monotonic()
            await join_or_kill(worker.proc, min(10.0, left))
        run.phase = "stopped"
        if run.outbox is not None:
            run.outbox.put(None)
        ckpt = f"; checkpoint {run.checkpoint}" if run.checkpoint else "; no checkpoint written"
        await self._record(run, WorkerState.STOPPED, f"{why}{ckpt}")
        if holding:
            await self._set_device(run.device_id, DeviceState.IDLE, why)
        await self._release_lease(run)

    # ---- rounds ---------------------------------------------------------------------------

    async def _launch(self, run: _Run, active_drafter: int, reason: str) -> None:
        """`start`'s background part: stop the trainer `run` replaces, spawn `run`'s, wait for
        its Ready, begin the round. Every way it can fail records the run and gives the device
        back: nothing else rewrites a TRAINING device (the supervisor leaves it to us)."""
        try:
            started = await self._spawn_worker(run, active_drafter, reason)
        except Exception as exc:
            if run.phase != "stopped":  # not killed by `close` (which recorded it)
                log.exception("drafter trainer failed to start", extra={"job_id": run.job_id})
            await self._give_up(run, WorkerState.FAILED, f"cannot start: {exc}")
            return
        if started is None and run.phase == "preempting":
            why = self._note_preemption(run, run.step)
            await self._give_up(run, WorkerState.STOPPED, f"{why}; before its trainer started")
            return
        if started is None:
            await self._give_up(run, WorkerState.STOPPED, "not started: daemon shutting down")
            return
        worker, ready = started
        if run.phase == "stopped":  # up after `close` gave up on it: nobody else stops it
            await asyncio.to_thread(worker.kill)
            run.stopped.set()
            return
        run.worker, run.step = worker, ready.step
        run.published_step = run.step
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
        resumed = f", resumed from {ready.resumed_from}" if ready.resumed_from else ""
        await self._record(run, WorkerState.READY, f"up at step {run.step}{resumed}")
        # A new process has an empty buffer: refill it with the recent samples.
        run.send(proto.AddSamples(tuple(self._recent.get(run.job_id, ()))))
        self._unsent.pop(run.job_id, None)
        if run.phase == "preempting":  # preempted while loading: free the device at once
            run.send(proto.Preempt())
            return
        await self._begin_round(run, reason)

    async def _spawn_worker(
        self, run: _Run, active_drafter: int, reason: str
    ) -> tuple[TrainerProcess, proto.Ready] | None:
        """Stop the trainer `run` replaces, then spawn `run`'s and wait for its Ready (killed
        if that fails); None, with nothing spawned, once `close` has begun or the device
        was preempted back for rollouts."""
        from tltd_workers.drafter.trainer import TrainerConfig
        from tltd_workers.drafter.trainer_process import TrainerProcess, TrainerSpec

        if run.replaces is not None:
            why = f"restarting for policy version {run.policy_version}"
            await self._stop_run(run.replaces, why)
            run.replaces = None
        # `close` may have recorded this run already (not overwritten); a device preempted
        # meanwhile is rollout's now (a trainer loading there could run it out of memory).
        if self._closed or run.phase == "preempting":
            return None
        await self._record(run, WorkerState.STARTING, f"spawning: {reason}")
        policy = await asyncio.to_thread(
            self.store.get_policy_version, run.job_id, run.policy_version
        )
        start_from, start_step = None, 0
        if active_drafter:  # a fresh trainer starts from the drafter the workers use
            dv = await asyncio.to_thread(self.store.get_drafter, run.job_id, active_drafter)
            if dv.readable_on(self.store.node_id) and Path(dv.path).is_dir():
                start_from = dv.path
                start_step = dv.train_steps if run.taken_over else 0
        spec = TrainerSpec(
            model_path=policy.path,
            checkpoint_dir=str(self.root / run.job_id / "train"),
            device=run.torch_device,
            trainer=TrainerConfig(row_len=self.settings.training_row_len),
            buffer_bytes=self.settings.training_buffer_bytes,
            keep_hidden=False,
            drafter_path=start_from,
            start_step=start_step,
            # Another node trained since this one's checkpoint: it is older than `start_from`.
            resume=not run.taken_over,
            threads=self.settings.worker_threads,
            heartbeat_seconds=self.settings.worker_heartbeat_seconds,
        )
        if self._closed or run.phase == "preempting":  # again, right before the spawn
            if run.phase != "stopped":  # (STARTING is recorded: STOPPED only by way of it)
                await self._record(run, WorkerState.STOPPING, "not spawned")
            return None
        worker = run.spawning = TrainerProcess(spec)
        try:
            await asyncio.to_thread(worker.spawn)
            # Recorded at once: the model loading takes GPU memory, and a pid unknown to the
            # store would make that use look foreign (the device would be vacated).
            await self._record(run, WorkerState.STARTING, f"loading: {reason}", pid=worker.proc.pid)
            ready = await asyncio.to_thread(
                worker.wait_for, proto.Ready, self.settings.training_start_timeout_seconds
            )
        except Exception:
            await asyncio.to_thread(worker.kill)  # e.g. timed out loading: not left holding it
            raise
        finally:
            run.spawning = None
        return worker, ready

    async def _give_up(self, run: _Run, state: WorkerState, why: str) -> None:
        """A launch that ends without a trainer: record the run, give the device back."""
        run.stopped.set()
        if run.phase == "stopped":  # `close` gave up on it first, and recorded that
            return
        run.phase = "stopped"
        await self._record(run, state, why)
        await self._set_device(run.device_id, DeviceState.IDLE, why)
        await self._release_lease(run)
        self._kick()

    async def _begin_round(self, run: _Run, reason: str) -> None:
        unsent = self._unsent.pop(run.job_id, [])
        if unsent:
            run.send(proto.AddSamples(tuple(unsent)))
        run.phase = "training"
        target = run.step + self.settings.training_steps_per_round
        run.send(proto.Train(target))
        await self._record(run, WorkerState.BUSY, f"{reason} (steps {run.step} -> {target})")

    async def _end_round(self, run: _Run, why: str) -> None:
        held = tuple(self._held.get(run.job_id, ()))
        if run.step > run.published_step and held:
            run.phase = "publishing"
            active = await asyncio.to_thread(active_drafter, self.store, run.job_id)
            out_dir = str(self.settings.drafter_versions_dir(run.job_id))
            run.measured_to = self._read_to.get(run.job_id, 0)
            run.send(proto.Measure(held, run.policy_version, out_dir, active))
            return
        await self._release(run, why)

    async def _release(self, run: _Run, why: str) -> None:
        """The round is over: free the device (moves state off an accelerator, checkpoints)."""
        run.phase = "releasing"
        run.preempt_reason = why
        run.send(proto.Preempt())

    # ---- worker messages (one consumer task, in order) -------------------------------------

    def _receive(
        self, run: _Run, stamp: HeartbeatStamp, m: proto.FromTrainer
    ) -> proto.FromTrainer | None:
        """Reader thread: any message is a sign of life; heartbeats stop here."""
        run.last_heartbeat = time.monotonic()
        if isinstance(m, proto.Heartbeat):
            stamp()  # shown by `tltctl workers`; written here, off the loop
            return None
        return m

    def _inbox_put(self, run: _Run, m: proto.FromTrainer | None) -> None:
        """On the loop: one consumer handles every trainer's messages in order (None: the
        pipe closed)."""
        if self._inbox is not None:
            self._inbox.put_nowait((run, m))

    async def _consume(self) -> None:
        assert self._inbox is not None
        while True:
            run, m = await self._inbox.get()
            try:
                await self._handle(run, m)
            except Exception:
                log.exception("drafter trainer message failed", extra={"kind": type(m).__name__})

    async def _handle(self, run: _Run, m: proto.FromTrainer | None) -> None:
        match m:
            case proto.Stepped(result=r):
                run.step, run.loss = r.step, r.loss
            case proto.Idle(reason=reason) if run.phase == "training":
                await self._end_round(run, f"round done at step {run.step} ({reason})")
            case proto.Measured():
                await self._on_measured(run, m)
            case proto.DeviceFree():
                await self._on_device_free(run, m)
            case proto.Checkpointed(path=path):
                run.checkpoint = path or run.checkpoint
            case proto.Stopped(path=path):
                run.checkpoint = path or run.checkpoint
                run.stopped.set()
            case proto.Failed() | None:
                run.stopped.set()
                if run.phase not in ("stopping", "stopped") and not self._closed:
                    await self._on_died(run, m.traceback if m else "process exited")

    async def _on_measured(self, run: _Run, m: proto.Measured) -> None:
        """Record the candidate; the daemon decides whether it is promoted. Several nodes: the
        publish is fenced by the lease; a refused one is deleted and its trainer stopped."""
        run.published_step = m.train_steps
        shared = bool(self.settings.shared_dir)
        if self.cluster:
            args = (run.job_id, m, run.lease_epoch, shared, run.measured_to)
            try:
                dv = await self._write(publish, self.store, *args, fenced=True)
            except Fenced as exc:
                log.warning(
                    "drafter version not published: lease lost",
                    extra={"job_id": run.job_id, "error": str(exc)},
                )
                self.fenced.append((run.job_id, run.lease_epoch))
                await asyncio.to_thread(shutil.rmtree, m.path, True)
                self._leases.pop(run.job_id, None)
                if run.alive:  # not awaited: its Stopped comes through this consumer
                    asyncio.ensure_future(self._stop_run(run, f"drafter lease lost: {exc}"))
                return
        else:
            dv = await self._write(record, self.store, run.job_id, m, 0.0, shared)
        status = dv.status.value if dv is not None else "not recorded"
        version = dv.version if dv is not None else 0
        log.info(
            "drafter version published",
            extra={"job_id": run.job_id, "version": version, "status": status},
        )
        self._kick()  # a promoted version is hot-swapped by the supervisor's next tick
        if run.phase == "publishing":
            await self._release(run, f"round done: published version {version} ({status})")

    async def _on_device_free(self, run: _Run, m: proto.DeviceFree) -> None:
        if run.phase not in ("preempting", "releasing"):
            return
        why = run.preempt_reason
        if run.phase == "preempting":
            why = self._note_preemption(run, m.step)
        run.phase, run.preempt_at = "idle", None
        await self._record(run, WorkerState.READY, why)
        await self._set_device(run.device_id, DeviceState.IDLE, why)
        self._kick()

    def _note_preemption(self, run: _Run, step: int) -> str:
        """Record a preemption whose device is free now (latency from the request); returns
        the reason to record."""
        if run.preempt_at is None:
            return run.preempt_reason
        latency = time.monotonic() - run.preempt_at
        self.preemptions.append(
            Preemption(run.job_id, run.device_id, run.preempt_reason, latency, step)
        )
        METRICS.record_preemption(run.device_id, "rollout", latency_seconds=latency)
        log.info(
            "drafter training preempted",
            extra={"job_id": run.job_id, "latency_ms": round(latency * 1000, 1)},
        )
        return f"preempted: {run.preempt_reason}; device free after {latency * 1000:.0f} ms"

    async def _set_device(self, device_id: str, state: DeviceState, why: str) -> None:
        METRICS.set_device_state(device_id, state.value)  # exact training seconds
        await self._write(self.store.set_device_state, device_id, state, why)

    async def _on_died(self, run: _Run, why: str) -> None:
        last = why.strip().splitlines()[-1] if why.strip() else why
        log.error("drafter trainer died", extra={"job_id": run.job_id, "error": why})
        await self._fail(run, f"trainer died: {last}")

    async def _fail(self, run: _Run, why: str) -> None:
        """Kill the trainer, record it FAILED and give back the device it held."""
        holding = run.phase in (*_HOLDING, "preempting", "releasing")
        run.phase = "stopped"
        if run.outbox is not None:
            run.outbox.put(None)
        if run.worker is not None:
            await asyncio.to_thread(run.worker.kill)
        await self._record(run, WorkerState.FAILED, why)
        if holding:
            await self._set_device(run.device_id, DeviceState.IDLE, why)
        await self._release_lease(run)
        self._kick()

    # ---- several nodes: the drafter lease and the sample cursor ----------------------------

    async def _claim(self, job_id: str) -> DrafterLease | None:
        """Take or extend the job's drafter lease; None while another node holds it."""
        try:
            lease = await asyncio.to_thread(
                self.store.claim_drafter_lease, job_id, self.settings.drafter_lease_seconds
            )
        except Exception:
            log.exception("drafter lease claim failed", extra={"job_id": job_id})
            return None
        if lease is None:
            log.debug("drafter training runs on another node", extra={"job_id": job_id})
            self._leases.pop(job_id, None)
            return None
        held = self._leases.get(job_id)
        if held is None or held.lease_epoch != lease.lease_epoch:
            log.info(
                "drafter lease taken",
                extra={
                    "job_id": job_id,
                    "lease_epoch": lease.lease_epoch,
                    "taken_from": lease.taken_from or "-",
                    "cursor": lease.cursor,
                },
            )
        self._leases[job_id] = lease
        return lease

    async def _pull(self, job_id: str, lease: DrafterLease) -> bool:
        """Read the job's samples (every node's) after what this node has read under the
        lease, at first after the lease's cursor, into the buffers; a new lease first refills
        them with the newest samples up to the cursor (what the drafter was trained on). The
        cursor moves when a version is published. False when the samples cannot be read."""
        store, cfg = self.store, self.settings
        recent = cfg.training_recent_samples
        try:
            if self._pulled.get(job_id) != lease.lease_epoch:
                for q in (self._recent, self._held, self._unsent):
                    q.pop(job_id, None)
                n = recent + cfg.training_held_out_samples * cfg.training_held_out_every
                older = await asyncio.to_thread(
                    store.finished_samples, job_id, 0, n, up_to=lease.cursor, newest=True
                )
                self._take(job_id, older)
                self._pulled[job_id] = lease.lease_epoch
                self._read_to[job_id] = lease.cursor
            after = max(self._read_to.get(job_id, 0), lease.cursor)
            new = await asyncio.to_thread(store.finished_samples, job_id, after, recent)
        except Exception:
            log.exception("drafter samples not read", extra={"job_id": job_id})
            return False
        if new:
            self._take(job_id, new)
            self._read_to[job_id] = new[-1].sample_id
        return True

    def _take(self, job_id: str, samples: list[FinishedSample]) -> None:
        """Samples read from the store into the buffers: held out when their row id is a
        multiple of training_held_out_every (the same split on every node)."""
        cfg = self.settings
        for f in samples:
            item = proto.TrainingSample(
                (*f.prompt, *f.token_ids), len(f.prompt), f.policy_version, step=f.policy_version
            )
            if len(item.token_ids) <= len(f.prompt) + 1:
                continue
            if f.sample_id % cfg.training_held_out_every == 0:
                held = self._held.setdefault(job_id, deque(maxlen=cfg.training_held_out_samples))
                held.append(item)
                continue
            n = cfg.training_recent_samples
            self._recent.setdefault(job_id, deque(maxlen=n)).append(item)
            unsent = self._unsent.setdefault(job_id, [])
            unsent.append(item)
            del unsent[:-n]

    async def renew(self) -> list[str]:
        """Several nodes (a periodic job): extend the lease of every job whose trainer lives
        here, stop a trainer whose lease was lost (another node may train that drafter now),
        and read how many samples of every node wait for each job. Returns the jobs lost."""
        if not self.cluster:
            return []
        lost = []
        for job_id, lease in list(self._leases.items()):
            run = self._runs.get(job_id)
            if run is None or run.phase == "stopped" or run.lease_epoch != lease.lease_epoch:
                continue
            try:
                # Its own thread: a renewal queued behind busy store calls could let it lapse.
                ok = await asyncio.get_running_loop().run_in_executor(
                    self._renewer,
                    self.store.renew_drafter_lease,
                    job_id,
                    lease.lease_epoch,
                    self.settings.drafter_lease_seconds,
                )
            except Exception:
                log.exception("drafter lease renewal failed", extra={"job_id": job_id})
                continue
            if ok:
                continue
            lost.append(job_id)
            self._leases.pop(job_id, None)
            log.warning("drafter lease lost: trainer stopped", extra={"job_id": job_id})
            if run.alive:
                asyncio.ensure_future(self._stop_run(run, "drafter lease lost"))
        try:
            self._backlog = await asyncio.get_running_loop().run_in_executor(
                self._renewer, self.store.drafter_backlog, sorted(self._asked), dict(self._read_to)
            )
        except Exception:
            log.exception("drafter backlog not read")
        if any(n >= self.settings.training_min_fresh_samples for n in self._backlog.values()):
            self._kick()
        return lost

    async def _release_lease(self, run: _Run) -> None:
        """A stopped trainer gives its lease up at once (not when it would expire), unless a
        newer trainer of the job runs under it."""
        lease = self._leases.get(run.job_id)
        if not self.cluster or lease is None or lease.lease_epoch != run.lease_epoch:
            return
        if self._runs.get(run.job_id) is not run:
            return
        self._leases.pop(run.job_id, None)
        await self._write(self.store.release_drafter_lease, run.job_id, run.lease_epoch)

    # ---- helpers --------------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._inbox = asyncio.Queue()
            self._write_lock = asyncio.Lock()
            self._consumer = asyncio.ensure_future(self._consume())

    def _kick(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _write(self, fn: Callable[..., Any], *args: Any, fenced: bool = False) -> Any:
        """`fn(*args)` in a thread, in order; errors logged, not raised (Fenced is, with
        `fenced`)."""
        assert self._write_lock is not None
        async with self._write_lock:  # in order: READY is never overtaken by BUSY
            try:
                return await asyncio.to_thread(fn, *args)
            except Fenced:
                if fenced:
                    raise
                log.warning("training store write fenced", extra={"fn": fn.__name__})
                return None
            except TltError as exc:
                log.warning("training store write refused: %s", exc)
                return None
            except Exception:
                # e.g. "database is locked" past the busy timeout, a dropped PostgreSQL
                # connection: logged, never raised into a launch or a stop, which must still
                # give the device back and stop their processes.
                log.exception("training store write failed", extra={"fn": fn.__name__})
                return None

    async def _record(
        self, run: _Run, state: WorkerState, reason: str, pid: int | None = None
    ) -> None:
        from tltd.supervisor.writes import upsert_worker

        worker = Worker(
            worker_id=run.worker_id,
            kind=WorkerKind.DRAFTER_TRAINING,
            device_id=run.device_id,
            job_id=run.job_id,
            state=state,
            pid=pid if pid is not None else (run.worker.proc.pid or 0) if run.worker else 0,
            state_reason=reason,
        )
        await self._write(upsert_worker, self.store, worker)
