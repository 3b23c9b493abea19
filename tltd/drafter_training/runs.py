"""One job's drafter-training worker process as the daemon tracks it, and its preemptions."""

from __future__ import annotations

import asyncio
import queue as threading_queue
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Protocol, TypeVar

from tltd.contract import drafter_messages as proto
from tltd.domain import Worker, WorkerKind, WorkerState

M = TypeVar("M")


class TrainerProcess(Protocol):
    """What the daemon uses of the trainer's process handle (`spawn.py` makes one)."""

    proc: BaseProcess
    conn: Connection

    def spawn(self) -> None: ...

    def wait_for(self, kind: type[M], timeout: float = ...) -> M: ...

    def kill(self) -> None: ...


# Phases in which the run holds its device (what the hook's `views()` reports to the scheduler).
HOLDING = ("starting", "training", "publishing")


@dataclass(frozen=True)
class Preemption:
    """One preemption: how long the device took to come back (request -> device free)."""

    job_id: str
    device_id: str
    reason: str
    latency_seconds: float
    step: int


@dataclass
class TrainerRun:
    """One job's drafter-training worker process and what the daemon knows of it."""

    job_id: str
    device_id: str
    torch_device: str
    policy_version: int
    # The loaded target's config.json (set at spawn): a new policy version with the same one
    # is loaded into the running trainer in place (`SetPolicy`), another needs a new process.
    policy_config: dict | None = None
    # warming|starting|training|publishing|releasing|preempting|idle|stopping|stopped
    # (warming: spawned ahead of its first round, holding no device; `training_warm_start`)
    phase: str = "starting"
    worker: TrainerProcess | None = None
    spawning: TrainerProcess | None = None  # while the launch waits for its Ready
    outbox: threading_queue.Queue | None = None
    step: int = 0
    loss: float = 0.0
    published_step: int = 0
    # The step the current round ends at: a preempted round resumes towards it, so a round
    # spread over several short idle windows (a rollout's tails) still ends and publishes.
    round_target: int = 0
    # A round was asked of this run and has not ended (its steps done, or no data left):
    # preempted meanwhile, it resumes on the next idle device without waiting the cadence.
    round_open: bool = True
    gave_way: bool = False  # preempted before its trainer was spawned (stopped, nothing lost)
    # Its last round ended with nothing to train on: only a new sample makes the next worth it.
    starved: bool = False
    # A Measure was sent and not answered yet: one given up for a preemption is asked again
    # when the run next gets a device, before any further training.
    measure_due: bool = False
    preempt_at: float | None = None
    preempt_reason: str = ""
    checkpoint: str = ""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    launch: asyncio.Task | None = None
    replaces: TrainerRun | None = None  # the trainer its launch stops first (another policy/device)
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

    @property
    def holding(self) -> bool:
        """Whether the run still holds its device (also while yielding it)."""
        return self.phase in (*HOLDING, "preempting", "releasing")

    def send(self, m: proto.ToTrainer) -> None:
        if self.outbox is not None:
            self.outbox.put(m)

    def processes(self) -> list[TrainerProcess]:
        """Every trainer process of this run: up, still loading, or the one its launch stops."""
        old = self.replaces.worker if self.replaces is not None else None
        return [w for w in (self.worker, self.spawning, old) if w is not None]

    def preemption(self, step: int) -> Preemption | None:
        """The preemption asked of this run, its device free now (None: none was asked)."""
        if self.preempt_at is None:
            return None
        latency = time.monotonic() - self.preempt_at
        return Preemption(self.job_id, self.device_id, self.preempt_reason, latency, step)

    def as_worker(self, state: WorkerState, reason: str, pid: int | None = None) -> Worker:
        """The trainer's row in the workers table."""
        if pid is None:
            pid = (self.worker.proc.pid or 0) if self.worker is not None else 0
        return Worker(
            worker_id=self.worker_id,
            kind=WorkerKind.DRAFTER_TRAINING,
            device_id=self.device_id,
            job_id=self.job_id,
            state=state,
            pid=pid,
            state_reason=reason,
        )
