"""The typed messages between the daemon and a drafter-training process (pickled over a Pipe),
and the spec the process is started with.

The trainer computes and reports; the daemon decides. In particular a `Measure` makes the
trainer save its drafter and measure held-out acceptance (its own and the active version's);
whether that becomes the active version is decided and recorded by the daemon
(`tltd.drafter_training.versions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ---- what a trainer process is started with ----------------------------------------------


@dataclass(frozen=True)
class TrainerConfig:
    """The optimizer and packing of a drafter trainer (`tltd_workers.drafter.trainer.Trainer`)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    items_per_micro: int = 4
    micro_per_step: int = 2
    row_len: int = 512  # packed row length (drafter positions); longer samples are windowed
    loss_chunk: int = 64  # positions per loss chunk (a stop request is checked between chunks)
    prefill_chunk: int = 64  # tokens per recompute forward (ditto)
    seed: int = 0
    prev_share: float = 0.5  # share of the previous rollout step's data in an epoch order


@dataclass(frozen=True)
class TrainerSpec:
    """One drafter-training process: the target it loads, where it checkpoints, what it trains
    with (`tltd_workers.drafter.trainer_process.main` runs it)."""

    model_path: str  # the target (policy) checkpoint, HF layout
    checkpoint_dir: str
    device: str = "cpu"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer_bytes: int = 256 << 20
    keep_hidden: bool = True
    hidden_dtype: str = "bfloat16"
    drafter_path: str | None = None  # start from this drafter (save_pretrained dir)
    drafter_seed: int = 0  # ... or from EagleDrafter.random_init(seed)
    start_step: int = 0  # the step count of `drafter_path` (a run continued on another node)
    resume: bool = True  # continue from checkpoint_dir/LATEST when there is one
    checkpoint_every: int = 0  # optimizer steps between async checkpoints (0: preempt/stop only)
    threads: int = 1
    heartbeat_seconds: float = 2.0
    # Added to the process's nice value: on a node whose cores the rollout workers and the
    # daemon also use, the OS gives the trainer only CPU time they leave (0: as the daemon).
    nice: int = 19


# ---- what is trained on ------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingSample:
    """One finished rollout sample: tokens = prompt + response, the response at
    `response_start`; `step` is the rollout step of the one-step offset (a policy version)."""

    token_ids: tuple[int, ...]
    response_start: int
    policy_version: int = 0
    step: int = 0
    hidden: Any = None  # [T, H] target features (torch), or None: recomputed by one prefill


@dataclass(frozen=True)
class ActiveDrafter:
    """The version a candidate must beat: re-measured from `path`; `recorded_acceptance` when
    its checkpoint is gone."""

    version: int
    path: str
    recorded_acceptance: float


# ---- daemon -> trainer -------------------------------------------------------------------


@dataclass(frozen=True)
class AddSamples:
    samples: tuple[TrainingSample, ...]


@dataclass(frozen=True)
class Train:
    """Train until `max_steps` optimizer steps in total; None: until preempted."""

    max_steps: int | None = None


@dataclass(frozen=True)
class Preempt:
    """Stop within one micro-step, free the device, report `DeviceFree`, then idle."""


@dataclass(frozen=True)
class WriteCheckpoint:
    """Write a checkpoint now (between steps, off the training thread)."""


@dataclass(frozen=True)
class Measure:
    """Save the drafter under `out_dir` and measure it and `active` on `held_out`."""

    held_out: tuple[TrainingSample, ...]
    policy_version: int
    out_dir: str
    active: ActiveDrafter | None = None
    k: int = 4  # draft chain length the acceptance is measured at


@dataclass(frozen=True)
class StopTrainer:
    """Write a checkpoint, wait for it, exit."""


@dataclass(frozen=True)
class SetPolicy:
    """Load the target weights of `policy_version` from `model_path` (an HF directory of the
    same architecture) into the loaded target, in place: the drafter, its optimizer and the
    buffer carry on. Sent between rounds, so a new policy every RL step costs a weight read,
    not a new process."""

    model_path: str
    policy_version: int


ToTrainer = AddSamples | Train | Preempt | WriteCheckpoint | Measure | StopTrainer | SetPolicy

# ---- trainer -> daemon -------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """One optimizer step's figures."""

    step: int  # optimizer steps applied so far (this one included)
    loss: float
    reg: float
    ce: float
    top1: float
    positions: int
    grad_norm: float
    lr: float
    item_ids: tuple[int, ...]  # items this step trained on
    skipped: tuple[int, ...] = ()  # ids of the order that had left the buffer (evicted)
    seconds: float = 0.0  # wall time of the step


@dataclass(frozen=True)
class TrainerReady:
    """The trainer is loaded: its step, the checkpoint it resumed from, its buffer's items."""

    step: int
    resumed_from: str | None
    items: int


@dataclass(frozen=True)
class Stepped:
    result: StepResult


@dataclass(frozen=True)
class Idle:
    reason: str  # "max_steps" | "no_data"
    step: int


@dataclass(frozen=True)
class DeviceFree:
    at: float  # monotonic, in the trainer's clock
    step: int
    was_training: bool


@dataclass(frozen=True)
class Checkpointed:
    step: int
    path: str = ""
    error: str = ""


@dataclass(frozen=True)
class Measured:
    """A saved candidate drafter and what it measured; the daemon records and decides."""

    path: str
    policy_version: int
    train_steps: int
    loss: float
    acceptance: float  # mean tokens per speculative step on the held-out samples
    baseline: float  # the same for the active version (1.0: no learned drafter)
    against: str  # what the baseline is, in words
    held_out: int
    k: int


@dataclass(frozen=True)
class Stopped:
    step: int
    path: str


@dataclass(frozen=True)
class Failed:
    """The trainer raised: its traceback (it exits after this)."""

    traceback: str


@dataclass(frozen=True)
class TrainerHeartbeat:
    """Sent every `heartbeat_seconds` from a thread: a long step or measure is not silence."""


FromTrainer = (
    TrainerReady
    | Stepped
    | Idle
    | DeviceFree
    | Checkpointed
    | Measured
    | Stopped
    | Failed
    | TrainerHeartbeat
)
