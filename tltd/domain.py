"""Domain objects: plain dataclasses shared by services, store and scheduler (no ORM, no proto)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime


class Backend(enum.StrEnum):
    TORCH = "torch"
    SGLANG = "sglang"


class SpeculativeMode(enum.StrEnum):
    AUTO = "auto"
    OFF = "off"


class JobStatus(enum.StrEnum):
    ACTIVE = "active"
    CANCELLED = "cancelled"
    FAILED = "failed"


class RequestStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    FAILED = "failed"


class DrafterStatus(enum.StrEnum):
    CANDIDATE = "candidate"
    PROMOTED = "promoted"
    REJECTED = "rejected"
    RETIRED = "retired"


class DeviceKind(enum.StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class DeviceState(enum.StrEnum):
    IDLE = "idle"
    ROLLOUT = "rollout"
    TRAINING = "training"
    UNAVAILABLE = "unavailable"


class WorkerKind(enum.StrEnum):
    ROLLOUT = "rollout"
    DRAFTER_TRAINING = "drafter_training"


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class Role(enum.StrEnum):
    TRAINER = "trainer"
    ADMIN = "admin"


@dataclass(frozen=True)
class SpeculativeConfig:
    mode: SpeculativeMode = SpeculativeMode.AUTO
    batch_threshold: int = 32
    draft_lengths: tuple[int, ...] = (2, 4, 6)
    drafter: str = "auto"  # "auto" | "ngram" | "eagle"
    online_training: bool = True
    # An offline-fitted drafter checkpoint the job starts from (its drafter version 1); "" = none.
    initial_drafter_path: str = ""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Job:
    job_id: str
    model_path: str
    name: str = ""
    backend: Backend = Backend.TORCH
    priority: int = 0
    weight: float = 1.0
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    status: JobStatus = JobStatus.ACTIVE
    status_reason: str = ""
    policy_version: int = 0
    drafter_version: int = 0
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True)
class RolloutRequest:
    request_id: str
    job_id: str
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingParams
    speculative: SpeculativeMode = SpeculativeMode.AUTO
    status: RequestStatus = RequestStatus.QUEUED
    status_reason: str = ""
    samples_done: int = 0
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # Set by the store at acceptance (the job's current version); every sample runs on it.
    policy_version: int = 0

    @property
    def samples_total(self) -> int:
        return len(self.prompts) * self.sampling.n


@dataclass(frozen=True)
class SpeculativeStats:
    draft_steps: int = 0
    plain_steps: int = 0
    accepted_tokens: int = 0
    mean_accepted_length: float = 0.0


@dataclass(frozen=True)
class Sample:
    request_id: str
    prompt_index: int
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    policy_version: int = 0
    drafter_version: int = 0
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)
    partial: bool = False
    error: str = ""


@dataclass(frozen=True)
class PolicyVersion:
    job_id: str
    version: int
    source: str  # "initial" | "checkpoint" | "tensors" | "nccl"
    path: str
    note: str = ""
    created_at: datetime | None = None


@dataclass(frozen=True)
class DrafterVersion:
    job_id: str
    version: int
    policy_version: int
    path: str
    train_steps: int = 0
    loss: float = 0.0
    acceptance_length: float = 0.0
    status: DrafterStatus = DrafterStatus.CANDIDATE
    pinned: bool = False
    active: bool = False
    created_at: datetime | None = None


@dataclass(frozen=True)
class DeviceProcess:
    pid: int
    used_memory_bytes: int = 0
    ours: bool = False


@dataclass(frozen=True)
class Device:
    device_id: str  # "cuda:0" | "cpu:0"
    kind: DeviceKind
    index: int
    uuid: str = ""
    name: str = ""
    memory_total_bytes: int = 0
    memory_used_bytes: int = 0
    utilization: float = 0.0
    processes: tuple[DeviceProcess, ...] = ()
    foreign: bool = False
    cordoned: bool = False
    draining: bool = False
    state: DeviceState = DeviceState.IDLE
    state_reason: str = ""
    updated_at: datetime | None = None

    @property
    def schedulable(self) -> bool:
        """Whether new rollout work may go here: not foreign, cordoned or draining, and
        readable by the inventory (an UNAVAILABLE device runs nothing)."""
        return not (self.foreign or self.cordoned or self.draining) and (
            self.state is not DeviceState.UNAVAILABLE
        )


@dataclass(frozen=True)
class Worker:
    worker_id: str
    kind: WorkerKind
    device_id: str
    job_id: str = ""
    state: WorkerState = WorkerState.STARTING
    pid: int = 0
    state_reason: str = ""
    started_at: datetime | None = None
    last_heartbeat: datetime | None = None


@dataclass(frozen=True)
class Event:
    """An append-only record of a status transition (entity, old -> new, why)."""

    entity: str  # "job" | "request" | "device" | "worker" | "drafter"
    entity_id: str
    old_status: str
    new_status: str
    reason: str = ""
    at: datetime | None = None
    event_id: int | None = None


@dataclass(frozen=True)
class Stats:
    version: str
    uptime_seconds: float
    database: str
    devices: int
    devices_schedulable: int
    workers: int
    jobs_active: int
    requests_by_status: dict[str, int]
    samples_total: int
    tokens_generated: int
    mean_accepted_length: float
    draining: bool
