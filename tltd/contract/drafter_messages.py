"""The typed messages between the daemon and a drafter-training process (pickled over a Pipe).

The trainer computes and reports; the daemon decides. In particular a `Measure` makes the
trainer save its drafter and measure held-out acceptance (its own and the active version's);
whether that becomes the active version is decided and recorded by the daemon
(`tltd.drafter_training.versions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
class Stop:
    """Write a checkpoint, wait for it, exit."""


@dataclass(frozen=True)
class SetPolicy:
    """Load the target weights of `policy_version` from `model_path` (an HF directory of the
    same architecture) into the loaded target, in place: the drafter, its optimizer and the
    buffer carry on. Sent between rounds, so a new policy every RL step costs a weight read,
    not a new process."""

    model_path: str
    policy_version: int


ToTrainer = AddSamples | Train | Preempt | WriteCheckpoint | Measure | Stop | SetPolicy

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
class Ready:
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
class Heartbeat:
    """Sent every `heartbeat_seconds` from a thread: a long step or measure is not silence."""


FromTrainer = (
    Ready | Stepped | Idle | DeviceFree | Checkpointed | Measured | Stopped | Failed | Heartbeat
)
