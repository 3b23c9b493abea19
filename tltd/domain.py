"""Domain objects: plain dataclasses shared by services, store and scheduler (no ORM, no proto)."""

from __future__ import annotations

import enum
import functools
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import ClassVar


@functools.cache
def field_names(cls: type, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A dataclass's field names less `skip`, looked up once (`fields()` builds a tuple at
    every call; the converters run once per sample)."""
    return tuple(f.name for f in fields(cls) if f.name not in skip)


class Backend(enum.StrEnum):
    TORCH = "torch"
    SGLANG = "sglang"
    # No model runs: samples are drawn, not computed (capacity planning; settings.sim_engine).
    SIM = "sim"


class SpeculativeMode(enum.StrEnum):
    AUTO = "auto"
    OFF = "off"


class PolicySwitch(enum.StrEnum):
    """What a running request does when its job gets a new policy version."""

    FINISH_ON_START_VERSION = "finish_on_start_version"  # its samples stay on their version
    NEXT_STEP = "next_step"  # workers load it between decode steps; samples continue on it


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


# A request is open until it ends; nothing rewrites an ended request's status.
OPEN_STATUSES = (RequestStatus.QUEUED, RequestStatus.RUNNING)
ENDED_STATUSES = (RequestStatus.COMPLETED, RequestStatus.CANCELLED, RequestStatus.FAILED)
# How the reason of a request FAILED by a node that drained (or shut down) alone begins: the
# node's answer is final, but another daemon may run it (a client re-sends it there).
DRAINED_REASON = "drained: "


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    FAILED = "failed"


class LogprobMode(enum.StrEnum):
    """Which log-probability a sample returns per token (docs/sd-statistics.md)."""

    PROCESSED = "processed"  # under the distribution sampled from (temperature, top-k, top-p)
    RAW = "raw"  # log_softmax of the raw logits: the unprocessed policy


class TokenSource(enum.StrEnum):
    """Where an output token came from."""

    PLAIN = "plain"  # drawn from p with no draft: the prefill token and plain steps
    ACCEPTED = "accepted"  # a draft token the target accepted
    RESIDUAL = "residual"  # the target's own token where a draft was rejected
    BONUS = "bonus"  # drawn from p after every draft of the step was accepted


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


class NodeStatus(enum.StrEnum):
    UP = "up"
    DOWN = "down"  # its heartbeat is older than the threshold (not stored: read from the age)
    LEFT = "left"  # shut down cleanly


class Role(enum.StrEnum):
    TRAINER = "trainer"
    ADMIN = "admin"


# Drafters that need no learned model: a job drafting with one of these alone has no EAGLE
# drafter to load or train.
MODEL_FREE_DRAFTERS = ("ngram", "history")


@dataclass(frozen=True)
class SpeculativeConfig:
    mode: SpeculativeMode = SpeculativeMode.AUTO
    batch_threshold: int = 32
    draft_lengths: tuple[int, ...] = (2, 4, 6)
    drafter: str = "auto"  # "auto" | "ngram" | "eagle" | "history"
    online_training: bool = True
    # An offline-fitted drafter checkpoint the job starts from (its drafter version 1); "" = none.
    initial_drafter_path: str = ""

    @property
    def drafts_from_history(self) -> bool:
        """Whether the job's workers draft from its prompts' earlier answers (read from the
        store when a prompt is claimed)."""
        return self.mode is not SpeculativeMode.OFF and self.drafter in ("auto", "history")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprob_mode: LogprobMode = LogprobMode.PROCESSED
    return_provenance: bool = False  # fill Sample.provenance
    # The this-many most likely tokens at every output position (Sample.top_logprobs); 0: none.
    top_logprobs: int = 0
    # Logprobs of the prompt's tokens after the first, each with this many most likely tokens
    # (Sample.prompt_logprobs; 0: the prompt token's alone); None: not computed.
    prompt_logprobs: int | None = None


# The most alternatives per position a request may ask for: SGLang's cap, above TRL's 100
# (get_sequence_logprobs' default; vLLM's own default cap, 20, makes TRL ask for a raise).
MAX_TOP_LOGPROBS = 128


@dataclass(frozen=True)
class TopLogprobs:
    """One position's most likely tokens, most likely first, with their logprobs (in the
    distribution the sample's logprobs refer to: SamplingParams.logprob_mode)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's tokens scored by the target: entry i is prompt position i + 1 (position 0
    has no context), its logprob given the tokens before it, its rank in that distribution
    (1 = most likely) and the top alternatives there (empty when none were asked for)."""

    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[TopLogprobs, ...] = ()


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
    policy_switch: PolicySwitch = PolicySwitch.FINISH_ON_START_VERSION
    # A bounded Generate never sends a group with a token more than this many policy versions
    # older than the job's current one; None = no bound.
    max_staleness: int | None = None
    bounded: BoundedStats | None = None  # read for GetJob only


@dataclass(frozen=True)
class BoundedStats:
    """A job's bounded requests so far (`tltd.store.deliveries`; the proto's BoundedStats)."""

    groups_sent: int = 0
    groups_dropped_stale: int = 0
    prompts_parked: int = 0
    prompts_open: int = 0
    samples_sent: int = 0
    samples_multi_version: int = 0
    max_version_spread: int = 0


@dataclass(frozen=True)
class NewJob:
    """What a caller asks for; None / 0 mean "the daemon's default" (the job service resolves
    them)."""

    job_id: str = ""
    model_path: str = ""
    name: str = ""
    backend: Backend | None = None
    priority: int = 0
    weight: float = 0.0  # 0 -> 1.0
    speculative: SpeculativeConfig | None = None  # batch_threshold 0 -> settings default
    policy_switch: PolicySwitch | None = None  # None -> FINISH_ON_START_VERSION
    max_staleness: int | None = None  # None = no bound


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
    # Asynchronous RL (GenerateRequest.bound): a stream of whole groups that ends after this
    # many (0 = unbounded: every sample, the usual stream); with `carried`, the groups of the
    # job's other bounded requests that no stream sent come first.
    bound_groups: int = 0
    carried: bool = False
    # At the bound, the unfinished prompts are parked (paused, their tokens stored) until the
    # job's next carried request, instead of running on; the stream ends at `bound_deadline_ms`
    # after acceptance (0 = none) even with fewer groups.
    bound_park: bool = False
    bound_deadline_ms: int = 0
    # A step's token budget per sample (0 = none): a sample that emits this many tokens in
    # this step unfinished pauses, and its prompt parks once its other samples are done or
    # paused, for the job's next carried request to go on from (torch backend).
    bound_tokens: int = 0
    # A session's turn: the node that holds the session's KV (it ran the previous turn). Its
    # units wait for that node a while (`Settings.session_affinity_seconds`); stored on them,
    # not on the request ("" once read back).
    preferred_node: str = ""

    @property
    def samples_total(self) -> int:
        return len(self.prompts) * self.sampling.n


@dataclass(frozen=True)
class RequestProgress:
    """What a Generate stream reads of its request while it follows it: not the prompts (the
    request's largest column: a 512-prompt request's are ~100k ids of JSON to decode)."""

    status: RequestStatus
    status_reason: str
    samples_total: int

    @classmethod
    def of(cls, req: RolloutRequest) -> RequestProgress:
        return cls(req.status, req.status_reason, req.samples_total)


@dataclass(frozen=True)
class SpeculativeStats:
    """A sample's SD counters, per row: a verify pass in which it had no draft is a plain step.

    The first token comes from the prefill and is in no step count: a sample has
    1 + plain_steps + accepted_tokens + residual_tokens + bonus_tokens tokens (0 if none).
    """

    draft_steps: int = 0  # decode steps in which it verified >= 1 draft token
    plain_steps: int = 0  # decode steps that gave it one token without a draft
    accepted_tokens: int = 0
    mean_accepted_length: float = 0.0  # (accepted_tokens + draft_steps) / draft_steps
    drafted_tokens: int = 0  # draft tokens verified
    bonus_tokens: int = 0  # drawn from p after a fully accepted chain
    residual_tokens: int = 0  # the target's own token where a draft was rejected

    @property
    def sd_step_share(self) -> float:
        """Share of this sample's decode steps that verified a draft (0 without steps)."""
        steps = self.draft_steps + self.plain_steps
        return self.draft_steps / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass(frozen=True)
class TokenProvenance:
    """Where one output token came from, and the step that produced it."""

    source: TokenSource
    drafter: str = ""  # "ngram" | "eagle"; "" for a plain token
    draft_length: int = 0  # drafts verified for this sample in that step; 0 for a plain token


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
    # One entry per token when the request asked for it (sampling.return_provenance), else None.
    provenance: tuple[TokenProvenance, ...] | None = None
    # (first token index, policy version) per version that produced its tokens, when it is more
    # than one (PolicySwitch.NEXT_STEP); () = every token came from `policy_version`.
    policy_spans: tuple[tuple[int, int], ...] = ()
    # One entry per token when the request asked (sampling.top_logprobs > 0), else None.
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    # Its prompt's logprobs when the request asked (sampling.prompt_logprobs), else None.
    prompt_logprobs: PromptLogprobs | None = None
    # The prompt, for a sample sent by a later request than its own (a carried group); () =
    # the request's own prompt `prompt_index`. Not stored: the request holds it.
    prompt_token_ids: tuple[int, ...] = ()
    # Drawn by the simulated engine (Backend.SIM): its tokens and logprobs mean nothing.
    simulated: bool = False
    # Prompt positions the worker restored from kept KV instead of computing them (a session's
    # earlier turn, or its prompt prefilled for another session). Not stored.
    reused_tokens: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PolicyVersion:
    job_id: str
    version: int
    source: str  # "initial" | "checkpoint" | "push" | "nccl"
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
    node_id: str = ""  # the node that wrote the checkpoint ("": the single node)
    shared: bool = False  # `path` is on storage every node reads (settings.shared_dir)

    def readable_on(self, node_id: str) -> bool:
        """Whether `node_id` can load the checkpoint: shared storage, or its own."""
        return self.shared or self.node_id in ("", node_id)


@dataclass(frozen=True)
class DrafterLease:
    """This node's hold on training a job's drafter. `lease_epoch` is the fencing token a
    publish carries; `taken_from` is the node that held it before when that was another one
    (training continues from the last published version, not from a local checkpoint)."""

    job_id: str
    lease_epoch: int
    cursor: int  # the last sample id consumed
    published_version: int  # the last version published under any lease (0: none)
    taken_from: str = ""


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
class Node:
    """One daemon on the shared database."""

    node_id: str
    address: str
    status: NodeStatus
    epoch: int  # incremented by every start: the node's fencing token
    heartbeat_age_seconds: float  # by the database's clock
    heartbeat_at: datetime | None = None
    started_at: datetime | None = None
    cordoned: bool = False  # claims no new work (an operator's request through any node)
    draining: bool = False  # a drain was requested (through any node)


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


# ---- pushed policy weights ---------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a pushed policy, as stored: safetensors name, dtype and shape."""

    # The torch dtype (its attribute name) of each safetensors dtype code a push may carry.
    TORCH_DTYPES: ClassVar[dict[str, str]] = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
    }

    name: str
    dtype: str  # "F32", "BF16", "F16", "F64"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PushHeader:
    """What a push of policy weights will carry; every stream of the push starts with it."""

    job_id: str
    update_id: str
    tensors: tuple[TensorSpec, ...]
    note: str = ""
    base_version: int | None = None  # delta chunks are XORed onto this version's tensors


@dataclass(frozen=True)
class TensorChunk:
    """Bytes [offset, offset + length) of one tensor: raw, or zstd(new XOR base) when delta;
    crc32c is of the new bytes either way."""

    name: str
    offset: int
    length: int
    data: bytes | memoryview  # a view of the received message (tltd.api.push_wire)
    delta: bool
    crc32c: int


@dataclass(frozen=True)
class PushStatus:
    """What the daemon holds of a push: verified bytes per tensor; version once recorded."""

    job_id: str
    update_id: str
    received: tuple[tuple[str, int, int], ...]  # (name, bytes received, bytes total)
    version: int = 0

    @property
    def bytes_received(self) -> int:
        return sum(r for _, r, _ in self.received)

    @property
    def bytes_total(self) -> int:
        return sum(t for _, _, t in self.received)


@dataclass(frozen=True)
class WorkerGroupKeys:
    """The workers' own group of a policy broadcast on the daemon's store (an nccl broadcast)."""

    prefix: str
    world_size: int
    backend: str


@dataclass(frozen=True)
class OpenedBroadcast:
    """Where a trainer joins a policy broadcast the daemon opened (the daemon's TCP store)."""

    address: str
    port: int
    prefix: str  # the daemon's group (gloo)
    world_size: int
    workers: WorkerGroupKeys | None = None


# ---- multi-turn sessions (token in / token out) ------------------------------------------------


class SessionStatus(enum.StrEnum):
    OPEN = "open"
    CLOSED = "closed"


class TurnStatus(enum.StrEnum):
    RUNNING = "running"  # its rollout request runs (or waits for the caller's retry)
    DONE = "done"


# A session id leaves room for the turn's request id (`turn_request_id`) within 128 characters.
MAX_SESSION_ID = 96
# Sessions a group opens at most, and a group id's length that leaves room for ".<index>".
MAX_GROUP_SESSIONS = 256
MAX_GROUP_ID = MAX_SESSION_ID - 4
# Where a session's turns run: the rules of `tltd.scheduler.session_worker`.
SESSION_PLACEMENTS = ("sticky", "hash", "round_robin")


def turn_request_id(session_id: str, turn_index: int, attempt: int) -> str:
    """The rollout request that runs a turn: fixed by the session, the turn and how many turns
    of the session were given up before (a given-up turn's request has ended; its next attempt
    needs a new one). A retry of the turn finds the same request and attaches to it."""
    return f"session:{session_id}:{turn_index}:{attempt}"


def turn_of(request_id: str) -> tuple[str, int] | None:
    """The session and the turn index a turn's request runs (`turn_request_id`); None for
    another request."""
    if not request_id.startswith("session:"):
        return None
    parts = request_id[len("session:") :].rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return parts[0], int(parts[1])


def turn_session_id(request_id: str) -> str:
    """The session whose turn the request runs (`turn_request_id`); "" for another request.
    A worker keeps a session's KV under it for the next turn (a hint: the engine reuses KV
    only where the tokens match)."""
    turn = turn_of(request_id)
    return turn[0] if turn is not None else ""


def prompt_share_key(job_id: str, prompt: Sequence[int]) -> str:
    """The key of a first turn's prompt: the sessions of one prompt (a group) share its
    prefill on a worker that keeps its KV under this key. '#' starts no session id, so it
    never names a session's own KV."""
    data = array("q", prompt).tobytes() + job_id.encode()
    return "#" + hashlib.blake2b(data, digest_size=16).hexdigest()


def group_session_id(group_id: str, index: int) -> str:
    """The `index`-th session of a group opened in one call (OpenSessionGroup)."""
    return f"{group_id}.{index}"


@dataclass(frozen=True)
class SessionTurn:
    """One turn: the environment's tokens sent before it (loss mask 0) and what the policy
    sampled (loss mask 1), with the behaviour logprobs and which version sampled which token."""

    session_id: str
    turn_index: int
    input_token_ids: tuple[int, ...]
    sampling: SamplingParams
    request_id: str
    status: TurnStatus = TurnStatus.RUNNING
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish_reason: FinishReason | None = None  # None while it runs
    policy_version: int = 0
    # As Sample.policy_spans: () = every token from `policy_version`.
    policy_spans: tuple[tuple[int, int], ...] = ()

    def token_versions(self) -> tuple[int, ...]:
        """The policy version that sampled each of `token_ids` (the spans expanded)."""
        spans = self.policy_spans or ((0, self.policy_version),)
        out: list[int] = []
        for i, (first, version) in enumerate(spans):
            end = spans[i + 1][0] if i + 1 < len(spans) else len(self.token_ids)
            out += [version] * (end - first)
        return tuple(out)


@dataclass(frozen=True)
class Trajectory:
    """A session's whole sequence as one training sample; the tuples are parallel."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 = sampled by the policy, 0 = prompt or environment
    logprobs: tuple[float, ...]  # behaviour logprob of a sampled token; 0.0 where mask is 0
    policy_versions: tuple[int, ...]  # the version that sampled it; -1 where mask is 0
    prompt_length: int


@dataclass(frozen=True)
class AgentSession:
    """A multi-turn session of one job: its prompt and its turns (done ones, then the running
    one if any). `attempts` counts turns given up (their request ended without a sample)."""

    session_id: str
    job_id: str
    prompt_token_ids: tuple[int, ...]
    status: SessionStatus = SessionStatus.OPEN
    num_turns: int = 0  # turns done
    num_tokens: int = 0  # the trajectory's length
    attempts: int = 0
    turns: tuple[SessionTurn, ...] = ()
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # Opened by SGLang's /open_session: its first request gives the prompt (empty until
    # then); `streaming`: a request naming no earlier turn continues the latest one.
    streaming: bool = False

    @property
    def running_turn(self) -> SessionTurn | None:
        last = self.turns[-1] if self.turns else None
        return last if last is not None and last.status is TurnStatus.RUNNING else None

    def context_before(self, turn_index: int) -> tuple[int, ...]:
        """The tokens the model saw before turn `turn_index`'s inputs: the prompt and every
        done turn before it (their inputs and sampled tokens)."""
        out = list(self.prompt_token_ids)
        for turn in self.turns:
            if turn.turn_index < turn_index and turn.status is TurnStatus.DONE:
                out += [*turn.input_token_ids, *turn.token_ids]
        return tuple(out)

    def trajectory(self) -> Trajectory:
        """The prompt, then each done turn's inputs (mask 0) and sampled tokens (mask 1)."""
        ids, mask = list(self.prompt_token_ids), [0] * len(self.prompt_token_ids)
        logprobs, versions = [0.0] * len(ids), [-1] * len(ids)
        for turn in self.turns:
            if turn.status is not TurnStatus.DONE:
                continue
            n_in, n_out = len(turn.input_token_ids), len(turn.token_ids)
            ids += [*turn.input_token_ids, *turn.token_ids]
            mask += [0] * n_in + [1] * n_out
            logprobs += [0.0] * n_in + list(turn.logprobs)
            versions += [-1] * n_in + list(turn.token_versions())
        return Trajectory(
            tuple(ids), tuple(mask), tuple(logprobs), tuple(versions), len(self.prompt_token_ids)
        )


@dataclass(frozen=True)
class SessionSummary:
    """A session as listed: its counters and the turn running now, if any (-1: none)."""

    session_id: str
    job_id: str
    status: SessionStatus
    num_turns: int
    num_tokens: int
    running_turn: int
    created_at: datetime | None = None
    updated_at: datetime | None = None
    # Known to the node that answers, from its memory (`tltd.supervisor.session_pins`): the
    # worker holding the session's KV now ("" = none here) and what its turns reused there.
    worker_id: str = ""
    node_id: str = ""
    reuse_hits: int = 0  # turns that reused kept KV
    reused_tokens: int = 0  # prompt positions those turns restored instead of computing
