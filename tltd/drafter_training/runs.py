"""One job's drafter-training worker process as the daemon tracks it: its phase (an enum with its
allowed transitions), the round it runs, the lease it runs under, and its preemptions."""

from __future__ import annotations

import asyncio
import enum
import queue as threading_queue
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tltd.contract import drafter_messages as proto
from tltd.domain import Worker, WorkerKind, WorkerState

if TYPE_CHECKING:
    from tltd.drafter_training.process import TrainerProcess


class TrainerPhase(enum.Enum):
    """Where a drafter trainer is in its life; `TRANSITIONS` says which step may follow which."""

    WARMING = "warming"  # spawned ahead of its first round, holding no device (warm start)
    STARTING = "starting"  # its process spawning or loading, on the device it was given
    TRAINING = "training"  # a round's optimizer steps
    PUBLISHING = "publishing"  # the round's candidate saved and measured (Measure sent)
    RELEASING = "releasing"  # the round is over: giving its device back (Preempt sent)
    PREEMPTING = "preempting"  # rollout wants the device: giving it back now
    IDLE = "idle"  # up, holding no device, its state in memory for the next round
    STOPPING = "stopping"  # asked to checkpoint and exit; its exit is expected
    STOPPED = "stopped"  # gone (stopped, failed, killed, or never spawned)


# Phases in which the run holds its device (what the hook's `views()` reports to the scheduler).
HOLDING = (TrainerPhase.STARTING, TrainerPhase.TRAINING, TrainerPhase.PUBLISHING)
_YIELDING = (TrainerPhase.PREEMPTING, TrainerPhase.RELEASING)
# Every phase may end in STOPPED (a failure, a kill, a close past its deadline).
TRANSITIONS: dict[TrainerPhase, tuple[TrainerPhase, ...]] = {
    TrainerPhase.WARMING: (TrainerPhase.IDLE, TrainerPhase.STOPPED),
    # A round whose measurement was given up goes from its start straight to publishing.
    TrainerPhase.STARTING: (
        TrainerPhase.TRAINING,
        TrainerPhase.PUBLISHING,
        TrainerPhase.RELEASING,
        TrainerPhase.PREEMPTING,
        TrainerPhase.STOPPING,
        TrainerPhase.STOPPED,
    ),
    TrainerPhase.TRAINING: (
        TrainerPhase.PUBLISHING,
        TrainerPhase.RELEASING,
        TrainerPhase.PREEMPTING,
        TrainerPhase.STOPPING,
        TrainerPhase.STOPPED,
    ),
    TrainerPhase.PUBLISHING: (
        TrainerPhase.RELEASING,
        TrainerPhase.PREEMPTING,
        TrainerPhase.STOPPING,
        TrainerPhase.STOPPED,
    ),
    TrainerPhase.RELEASING: (TrainerPhase.IDLE, TrainerPhase.STOPPING, TrainerPhase.STOPPED),
    TrainerPhase.PREEMPTING: (TrainerPhase.IDLE, TrainerPhase.STOPPING, TrainerPhase.STOPPED),
    TrainerPhase.IDLE: (
        TrainerPhase.TRAINING,
        TrainerPhase.PUBLISHING,
        TrainerPhase.RELEASING,
        TrainerPhase.STOPPING,
        TrainerPhase.STOPPED,
    ),
    # A second stop of a stopping trainer (a lost lease, then a close) waits as the first.
    TrainerPhase.STOPPING: (TrainerPhase.STOPPING, TrainerPhase.STOPPED),
    TrainerPhase.STOPPED: (TrainerPhase.STOPPED,),
}


@dataclass(frozen=True)
class Preemption:
    """One preemption: how long the device took to come back (request -> device free)."""

    job_id: str
    device_id: str
    reason: str
    latency_seconds: float
    step: int


@dataclass
class Round:
    """The round asked of a run: where it ends, and what is still owed of it."""

    # The step it ends at: a preempted round resumes towards it, so a round spread over several
    # short idle windows (a rollout's tails) still ends and publishes.
    target: int = 0
    # Asked and not ended (its steps done, or no data left): preempted meanwhile, it resumes on
    # the next idle device without waiting the cadence.
    open: bool = True
    # A Measure was sent and not answered yet: one given up for a preemption is asked again
    # when the run next gets a device, before any further training.
    measure_due: bool = False
    published_step: int = 0  # the step of the last candidate measured
    gave_way: bool = False  # preempted before its trainer was spawned (stopped, nothing lost)
    # It ended with nothing to train on: only a new sample makes the next worth it.
    starved: bool = False


@dataclass
class LeaseTerms:
    """Several nodes: the drafter lease a trainer runs under (epoch 0: one node)."""

    epoch: int = 0
    taken_over: bool = False  # it came from another node: start from its last version
    start_version: int = 0  # the drafter version a new trainer starts from (0: the active one)
    measured_to: int = 0  # the last sample id read before the publish was asked


@dataclass
class TrainerRun:
    """One job's drafter-training worker process and what the daemon knows of it."""

    job_id: str
    device_id: str
    torch_device: str
    policy_version: int
    phase: TrainerPhase = TrainerPhase.STARTING
    # The loaded target's config.json (set at spawn): a new policy version with the same one
    # is loaded into the running trainer in place (`SetPolicy`), another needs a new process.
    policy_config: dict | None = None
    round: Round = field(default_factory=Round)
    lease: LeaseTerms = field(default_factory=LeaseTerms)
    step: int = 0
    loss: float = 0.0
    worker: TrainerProcess | None = None
    spawning: TrainerProcess | None = None  # while the launch waits for its Ready
    outbox: threading_queue.Queue | None = None
    launch: asyncio.Task | None = None
    replaces: TrainerRun | None = None  # the trainer its launch stops first (another policy/device)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    checkpoint: str = ""
    preempt_at: float | None = None
    preempt_reason: str = ""
    last_heartbeat: float = 0.0  # monotonic, of any message (set by the pipe reader thread)

    def to(self, phase: TrainerPhase) -> None:
        """The one place a trainer's phase changes."""
        if phase not in TRANSITIONS[self.phase]:
            raise AssertionError(f"{self.worker_id}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    @property
    def worker_id(self) -> str:
        return f"drafter-{self.job_id}"

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.phase not in (
            TrainerPhase.STOPPING,
            TrainerPhase.STOPPED,
        )

    @property
    def holding(self) -> bool:
        """Whether the run still holds its device (also while yielding it)."""
        return self.phase in HOLDING or self.phase in _YIELDING

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
