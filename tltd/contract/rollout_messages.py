"""The typed messages between the daemon and a rollout worker process (pickled over a Pipe).

Backend-neutral on purpose: the torch and the SGLang worker speak the same protocol, so the
supervisor talks to either the same way. Commands take effect at the worker's next step
boundary, in the order sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tltd.domain import Sample, SamplingParams, SpeculativeConfig, SpeculativeMode

# ---- how to build an engine ----------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings a worker needs for a job (mirrors the job's speculative config)."""

    max_batch: int = 64
    max_seq_len: int = 2048
    spec_mode: str = "adaptive"  # "off" | "adaptive" | "fixed"
    gate: str = "measured"  # adaptive: "measured" (cost model + bandit) | "threshold"
    batch_threshold: int = 32  # the threshold gate's and the fixed mode's limit
    draft_lengths: tuple[int, ...] = (2, 4, 6)
    drafter: str = "auto"  # "auto" | "ngram" | "eagle" | "history"
    device: str = "cpu"
    seed: int = 0
    prefix_cache_bytes: int = 256 << 20  # a torch engine's kept session KV (0: none)
    cost_budget_s: float = 2.0  # the measured gate's cost timing at load (0: none)

    @classmethod
    def for_job(cls, spec: SpeculativeConfig, **kw: Any) -> EngineSpec:
        """A job's speculative config as engine settings (the one place they are mapped);
        `kw` sets the rest (batch, length, device)."""
        return cls(
            spec_mode="off" if spec.mode is SpeculativeMode.OFF else "adaptive",
            batch_threshold=spec.batch_threshold,
            draft_lengths=spec.draft_lengths,
            drafter=spec.drafter,
            **kw,
        )


# ---- daemon -> worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadModel:
    """(Re)build the engine for a job: its model at `path` is policy version `policy_version`."""

    job_id: str
    path: str
    policy_version: int
    engine: EngineSpec = field(default_factory=EngineSpec)
    # Send a SampleCheckpoint of each sample running this long, and again each time as long again
    # (0 = never).
    checkpoint_seconds: float = 0.0


@dataclass(frozen=True)
class LoadPolicy:
    """New weights of the same job (same architecture), loaded between steps."""

    path: str
    version: int


@dataclass(frozen=True)
class SetDrafter:
    """Hot-swap the learned drafter (`path` "" = none: n-gram only)."""

    path: str
    version: int


@dataclass(frozen=True)
class JoinBroadcast:
    """Join the trainer's torch.distributed group of the push that is to become policy version
    directory `path`, as ranks `rank` .. `rank + ranks - 1` of `world_size`, and receive its
    tensors beside the running engine (a torch worker into memory, an SGLang engine through
    its distributed weight update). A later LoadPolicy of `path` switches to them instead of
    reading the file."""

    path: str
    address: str  # the daemon's TCP store
    port: int
    group_name: str  # the group's keys in the store (`tltd_workers.rollout.broadcast`)
    rank: int
    world_size: int
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype code, shape), in order
    timeout_seconds: float
    backend: str = "gloo"
    ranks: int = 1  # an SGLang engine with tensor parallelism takes one rank per GPU


@dataclass(frozen=True)
class AddWork:
    """Run these samples of one prompt. `seq` increases per AddWork; heartbeats ack it."""

    seq: int
    request_id: str
    prompt_index: int
    sample_indices: tuple[int, ...]
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    speculative: bool = True
    # The job's earlier answers to this prompt, for the history drafter (sample id, tokens).
    history: tuple[tuple[tuple[str, int, int], tuple[int, ...]], ...] = ()
    # Samples of `sample_indices` stored unfinished (a drained node's tokens so far): a torch
    # worker goes on from their tokens; another backend runs them again from their seed.
    resume: tuple[Sample, ...] = ()
    # A step's token budget per sample (StepBound.max_tokens): a sample that emits this many
    # tokens here unfinished comes back paused (ABORTED); 0 = none. Torch engine only.
    pause_after: int = 0
    # A session's key: the sample's KV is kept after it ends and the session's next turn
    # prefills only its new tokens on the same worker ("" = not kept). Torch engine only.
    cache_key: str = ""
    # A session's first prompt (`tltd.domain.prompt_share_key`): its KV is kept under this key
    # at prefill, for the other sessions of that prompt to reuse ("" = none). Torch only.
    share_key: str = ""


@dataclass(frozen=True)
class Cancel:
    """Finish every sample of the request now as CANCELLED (tokens so far); with `pause`, as
    ABORTED: paused at a step bound, the daemon parks them and a later request goes on from
    their tokens."""

    request_id: str
    pause: bool = False


@dataclass(frozen=True)
class Freeze:
    """Stop (`frozen`) or restart stepping the engine: what it runs keeps its tokens, its KV
    cache and its place; new work queues in it; every other command still applies (a cancel
    returns the request's samples at once, a drain, a new policy). The worker answers with a
    heartbeat whose `frozen` says what it does now."""

    frozen: bool


@dataclass(frozen=True)
class Drain:
    """Keep working for at most `seconds`, then return what still runs as partial samples."""

    seconds: float


@dataclass(frozen=True)
class Shutdown:
    """Exit now (unfinished work is dropped: drain first to keep it)."""


# ---- worker -> daemon ----------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """Sent once the process is up and after every LoadModel / LoadPolicy / SetDrafter."""

    pid: int
    job_id: str = ""
    policy_version: int = 0
    drafter_version: int = 0
    policy_source: str = ""  # "broadcast": its policy weights came from a joined broadcast


@dataclass(frozen=True)
class Heartbeat:
    running_samples: int  # in the engine (running + waiting to be admitted)
    remaining_tokens: int  # predicted tokens still to decode for them (Engine.load)
    acked_seq: int  # the last AddWork.seq the engine has taken in
    idle_since: float | None  # wall clock (time.time()) the engine went empty; None = busy
    stats: dict[str, object] = field(default_factory=dict)  # engine counters (summary)
    # Freeze: True = not stepping now, False = stepping; None = its backend cannot freeze
    # (an SGLang engine runs its requests in processes of its own).
    frozen: bool | None = False


@dataclass(frozen=True)
class Finished:
    """One sample is done (stop, length, cancelled, failed, or aborted by a drain: partial)."""

    sample: Sample


@dataclass(frozen=True)
class SampleCheckpoint:
    """A running sample's tokens so far (ABORTED, partial): it goes on running. Stored so that
    a node taking its unit over after a loss continues from them."""

    sample: Sample


@dataclass(frozen=True)
class Drained:
    """The drain deadline passed: every unfinished sample was sent as partial."""

    partial: int


@dataclass(frozen=True)
class LoadFailed:
    """A LoadModel / LoadPolicy / SetDrafter could not be applied (the worker keeps running)."""

    job_id: str
    policy_version: int  # the version that failed: the drafter's when `drafter` is True
    message: str
    drafter: bool = False  # True: it was the drafter that failed to load


@dataclass(frozen=True)
class WorkerError:
    """Something failed. fatal=True: the worker exits after sending this."""

    message: str
    fatal: bool = False


ToWorker = (
    LoadModel
    | LoadPolicy
    | SetDrafter
    | JoinBroadcast
    | AddWork
    | Cancel
    | Freeze
    | Drain
    | Shutdown
)
# A worker may also send a list of them as one pipe message (a step's Finished samples).
FromWorker = Ready | Heartbeat | Finished | SampleCheckpoint | Drained | LoadFailed | WorkerError
