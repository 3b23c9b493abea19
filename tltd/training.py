"""Drafter training on idle devices: the supervisor's `TrainingHook` over DrafterWorker processes.

The scheduler decides (`start_training`, `preempt_training`); this module carries it out:
- finished rollout samples (token ids only: hidden states are recomputed on the training device
  with one target prefill, see workers/drafter/trainer.py) are kept per job; every
  `training_held_out_every`-th one is held out to measure acceptance at publish time;
- `start` spawns (or reuses) one `DrafterWorker` process per job, feeds it the new samples and
  runs one round of `training_steps_per_round` optimizer steps on the device it was given; it
  returns at once (it runs in the supervisor's tick): stopping an old trainer, spawning and
  loading a new one run in a background task (`_launch`);
- `preempt` asks the worker for the device back and records the measured latency
  (request -> "device_free"); the trainer keeps its state in memory and resumes next round;
- at the end of a round the worker publishes a drafter version (`versions.publish`: a store row,
  promoted only when its held-out acceptance beats the active one), and the supervisor then
  hot-swaps a promoted version into the rollout workers;
- `close` (SIGTERM / drain) stops every worker, which writes its trainer checkpoint first;
- a worker heartbeats from a thread; `reap` (a periodic job) kills one silent for
  `training_heartbeat_timeout_seconds` (hung, not dead: a dead one's pipe closes).

The worker's messages are read by one thread per process and handled, in order, by one task
on the event loop; store writes go through `asyncio.to_thread` so the loop never waits on them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue as threading_queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tltd.domain import DeviceKind, DeviceState, Sample, Worker, WorkerKind, WorkerState
from tltd.errors import TltError
from tltd.metrics import METRICS
from tltd.scheduler import TrainingView
from tltd.settings import Settings
from tltd.supervisor.worker_process import write_pipe

if TYPE_CHECKING:
    from tltd.store import Store
    from workers.drafter.worker import DrafterWorker

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
    worker: DrafterWorker | None = None
    spawning: DrafterWorker | None = None  # while `_launch` waits for its Ready
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
    last_heartbeat: float = 0.0  # monotonic, of any message (set by the pipe reader thread)

    @property
    def worker_id(self) -> str:
        return f"drafter-{self.job_id}"

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.phase not in ("stopping", "stopped")

    def send(self, kind: str, payload: Any = None) -> None:
        if self.outbox is not None:
            self.outbox.put((kind, payload))

    def processes(self) -> list[DrafterWorker]:
        """Every trainer process of this run: up, still loading, or the one its launch stops."""
        old = self.replaces.worker if self.replaces is not None else None
        return [w for w in (self.worker, self.spawning, old) if w is not None]


class DrafterTraining:
    """The `tltd.supervisor.TrainingHook` of the daemon (one per node)."""

    def __init__(self, store: Store, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.root = Path(settings.data_dir) / "drafters"
        self.on_change: Callable[[], None] | None = None  # the supervisor's kick
        self.preemptions: list[Preemption] = []
        self._runs: dict[str, _Run] = {}
        self._recent: dict[str, deque[dict]] = {}
        self._unsent: dict[str, list[dict]] = {}
        self._held: dict[str, deque[dict]] = {}
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
        return self._fresh[job_id], self._last_start.get(job_id)

    def on_sample(self, job_id: str, prompt: tuple[int, ...], sample: Sample) -> None:
        item = {
            "token_ids": [*prompt, *sample.token_ids],
            "response_start": len(prompt),
            "policy_version": sample.policy_version,
            # The rollout "step" of the one-step offset: a policy version is one RL step.
            "step": sample.policy_version,
            "hidden": None,
        }
        if len(item["token_ids"]) <= len(prompt) + 1:
            return  # nothing a drafter position could be trained on
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
        job = await asyncio.to_thread(self.store.get_job, job_id)
        device = await asyncio.to_thread(self.store.get_device, device_id)
        torch_device = "cpu" if device.kind is DeviceKind.CPU else device_id
        self._last_start[job_id] = time.monotonic()
        self._fresh[job_id] = 0
        reason = f"training the drafter of job {job_id} on idle device {device_id}"
        await self._set_device(device_id, DeviceState.TRAINING, reason)
        alive = run is not None and run.alive
        if alive and (run.policy_version, run.torch_device) == (job.policy_version, torch_device):
            run.device_id = device_id
            await self._begin_round(run, reason)
            return
        # The trainer's target is loaded at spawn: a new policy (or device) needs a new
        # process, which resumes from the checkpoint the old one writes as it stops.
        new = _Run(job_id, device_id, torch_device, job.policy_version)
        new.replaces = run if alive else None
        self._runs[job_id] = new
        new.launch = asyncio.ensure_future(self._launch(new, job.drafter_version, reason))

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
            run.send("preempt")
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
        run.send("stop")
        stopped = asyncio.ensure_future(run.stopped.wait())
        if not await self._wait(stopped, limit):
            stopped.cancel()
            log.error("drafter trainer did not stop in time", extra={"job_id": run.job_id})
        worker = run.worker
        if worker is not None:
            left = min(limit, self._close_deadline) - time.monotonic()
            await asyncio.to_thread(worker.proc.join, min(10.0, max(0.0, left)))
            await asyncio.to_thread(worker.kill)
        run.phase = "stopped"
        if run.outbox is not None:
            run.outbox.put(None)
        ckpt = f"; checkpoint {run.checkpoint}" if run.checkpoint else "; no checkpoint written"
        await self._record(run, WorkerState.STOPPED, f"{why}{ckpt}")
        if holding:
            await self._set_device(run.device_id, DeviceState.IDLE, why)

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
        worker, info = started
        if run.phase == "stopped":  # up after `close` gave up on it: nobody else stops it
            await asyncio.to_thread(worker.kill)
            run.stopped.set()
            return
        run.worker, run.step = worker, int(info["step"])
        run.published_step = run.step
        run.last_heartbeat = time.monotonic()
        run.outbox = threading_queue.Queue()
        threading.Thread(
            target=write_pipe,
            args=(run.outbox, worker.conn),
            daemon=True,
            name=f"{run.worker_id}-tx",
        ).start()
        threading.Thread(
            target=self._read_pipe, args=(run,), daemon=True, name=f"{run.worker_id}-rx"
        ).start()
        resumed = f", resumed from {info['resumed_from']}" if info.get("resumed_from") else ""
        await self._record(run, WorkerState.READY, f"up at step {run.step}{resumed}")
        # A new process has an empty buffer: refill it with the recent samples.
        run.send("add", list(self._recent.get(run.job_id, ())))
        self._unsent.pop(run.job_id, None)
        if run.phase == "preempting":  # preempted while loading: free the device at once
            run.send("preempt")
            return
        await self._begin_round(run, reason)

    async def _spawn_worker(
        self, run: _Run, active_drafter: int, reason: str
    ) -> tuple[DrafterWorker, dict] | None:
        """Stop the trainer `run` replaces, then spawn `run`'s and wait for its Ready (killed
        if that fails); None, with nothing spawned, once `close` has begun or the device
        was preempted back for rollouts."""
        from workers.drafter.trainer import TrainerConfig
        from workers.drafter.worker import DrafterWorker, WorkerSpec

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
        start_from = None
        if active_drafter:  # a fresh trainer starts from the drafter the workers use
            dv = await asyncio.to_thread(self.store.get_drafter, run.job_id, active_drafter)
            start_from = dv.path if Path(dv.path).is_dir() else None
        spec = WorkerSpec(
            model_path=policy.path,
            checkpoint_dir=str(self.root / run.job_id / "train"),
            device=run.torch_device,
            trainer=TrainerConfig(row_len=self.settings.training_row_len),
            buffer_bytes=self.settings.training_buffer_bytes,
            keep_hidden=False,
            drafter_path=start_from,
            threads=self.settings.worker_threads,
            heartbeat_seconds=self.settings.worker_heartbeat_seconds,
        )
        if self._closed or run.phase == "preempting":  # again, right before the spawn
            if run.phase != "stopped":  # (STARTING is recorded: STOPPED only by way of it)
                await self._record(run, WorkerState.STOPPING, "not spawned")
            return None
        worker = run.spawning = DrafterWorker(spec)
        try:
            await asyncio.to_thread(worker.spawn)
            # Recorded at once: the model loading takes GPU memory, and a pid unknown to the
            # store would make that use look foreign (the device would be vacated).
            await self._record(run, WorkerState.STARTING, f"loading: {reason}", pid=worker.proc.pid)
            info = await asyncio.to_thread(
                worker.wait_for, "ready", self.settings.training_start_timeout_seconds
            )
        except Exception:
            await asyncio.to_thread(worker.kill)  # e.g. timed out loading: not left holding it
            raise
        finally:
            run.spawning = None
        return worker, info

    async def _give_up(self, run: _Run, state: WorkerState, why: str) -> None:
        """A launch that ends without a trainer: record the run, give the device back."""
        run.stopped.set()
        if run.phase == "stopped":  # `close` gave up on it first, and recorded that
            return
        run.phase = "stopped"
        await self._record(run, state, why)
        await self._set_device(run.device_id, DeviceState.IDLE, why)
        self._kick()

    async def _begin_round(self, run: _Run, reason: str) -> None:
        unsent = self._unsent.pop(run.job_id, [])
        if unsent:
            run.send("add", unsent)
        run.phase = "training"
        target = run.step + self.settings.training_steps_per_round
        run.send("train", target)
        await self._record(run, WorkerState.BUSY, f"{reason} (steps {run.step} -> {target})")

    async def _end_round(self, run: _Run, why: str) -> None:
        held = list(self._held.get(run.job_id, ()))
        if run.step > run.published_step and held:
            run.phase = "publishing"
            run.send(
                "publish",
                {
                    "db_url": self.store.url,
                    "job_id": run.job_id,
                    "policy_version": run.policy_version,
                    "out_dir": str(self.settings.drafter_versions_dir(run.job_id)),
                    "held_out": held,
                },
            )
            return
        await self._release(run, why)

    async def _release(self, run: _Run, why: str) -> None:
        """The round is over: free the device (moves state off an accelerator, checkpoints)."""
        run.phase = "releasing"
        run.preempt_reason = why
        run.send("preempt")

    # ---- worker messages (one consumer task, in order) -------------------------------------

    def _read_pipe(self, run: _Run) -> None:
        assert run.worker is not None
        conn = run.worker.conn
        stamped = 0.0
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                break
            except Exception:
                log.exception("bad message from drafter trainer", extra={"job_id": run.job_id})
                break
            now = run.last_heartbeat = time.monotonic()  # before a write that may block
            if kind == "heartbeat" and now - stamped >= 2.0:
                # Shown by `tltctl workers`; written here, off the loop, like a rollout worker's.
                stamped = now
                try:
                    self.store.heartbeat_worker(run.worker_id)
                except Exception:  # e.g. "database is locked": keep reading
                    log.warning("cannot record trainer heartbeat", exc_info=True)
            if kind != "heartbeat":
                self._post(run, kind, payload)
        self._post(run, "exit", None)

    def _post(self, run: _Run, kind: str, payload: Any) -> None:
        loop, inbox = self._loop, self._inbox
        if loop is not None and inbox is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, (run, kind, payload))
            except RuntimeError:
                pass  # the loop closed while we were reading

    async def _consume(self) -> None:
        assert self._inbox is not None
        while True:
            run, kind, payload = await self._inbox.get()
            try:
                await self._handle(run, kind, payload)
            except Exception:
                log.exception("drafter trainer message failed", extra={"kind": kind})

    async def _handle(self, run: _Run, kind: str, payload: Any) -> None:
        if kind == "step":
            run.step, run.loss = int(payload["step"]), float(payload["loss"])
        elif kind == "idle" and run.phase == "training":
            await self._end_round(run, f"round done at step {run.step} ({payload['reason']})")
        elif kind == "published":
            run.published_step = int(payload["train_steps"])
            status = str(payload["status"])
            log.info(
                "drafter version published",
                extra={"job_id": run.job_id, "version": payload["version"], "status": status},
            )
            self._kick()  # a promoted version is hot-swapped by the supervisor's next tick
            if run.phase == "publishing":
                await self._release(
                    run, f"round done: published version {payload['version']} ({status})"
                )
        elif kind == "device_free":
            await self._on_device_free(run, payload)
        elif kind == "checkpointed":
            run.checkpoint = str(payload.get("path", run.checkpoint))
        elif kind == "stopped":
            run.checkpoint = str(payload.get("path") or run.checkpoint)
            run.stopped.set()
        elif kind in ("error", "exit"):
            run.stopped.set()
            if run.phase not in ("stopping", "stopped") and not self._closed:
                await self._on_died(run, str(payload or "process exited"))

    async def _on_device_free(self, run: _Run, payload: dict) -> None:
        if run.phase not in ("preempting", "releasing"):
            return
        why = run.preempt_reason
        if run.phase == "preempting":
            why = self._note_preemption(run, int(payload.get("step", 0)))
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
        self._kick()

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

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._write_lock is not None
        async with self._write_lock:  # in order: READY is never overtaken by BUSY
            try:
                return await asyncio.to_thread(fn, *args)
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
