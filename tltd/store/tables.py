"""ORM rows: the SQL schema of the daemon's state (only the store imports these)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Deterministic constraint names so that Alembic can drop/alter them on every dialect
# (SQLite batch mode needs names to recreate tables).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID = String(128)  # job/request/worker ids are client-chosen strings
STATUS = String(32)  # enums are stored as their string values, never as native DB enums


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every dialect.

    PostgreSQL stores timestamptz; SQLite has no timezone support, so values are stored as
    naive UTC and made aware again on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the store only accepts aware datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# SQLite only auto-increments an INTEGER PRIMARY KEY, so BigInteger ids map to Integer there.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobRow(Base):
    __tablename__ = "jobs"

    job_id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    model_path: Mapped[str] = mapped_column(Text)
    backend: Mapped[str] = mapped_column(STATUS)
    # BIGINT: the API's uint32 goes beyond a signed SQL INTEGER.
    priority: Mapped[int] = mapped_column(BigInteger, default=0)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    spec_mode: Mapped[str] = mapped_column(STATUS)
    spec_batch_threshold: Mapped[int] = mapped_column(BigInteger)
    spec_draft_lengths: Mapped[list[Any]] = mapped_column(JSON)
    spec_drafter: Mapped[str] = mapped_column(STATUS)
    spec_online_training: Mapped[bool] = mapped_column(Boolean)
    spec_initial_drafter_path: Mapped[str] = mapped_column(Text, default="")
    policy_switch: Mapped[str] = mapped_column(STATUS, default="finish_on_start_version")
    status: Mapped[str] = mapped_column(STATUS, index=True)
    status_reason: Mapped[str] = mapped_column(Text, default="")
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    # A bounded Generate never sends a group older than this (versions); NULL = no bound.
    max_staleness: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class PolicyVersionRow(Base):
    __tablename__ = "policy_versions"

    job_id: Mapped[str] = mapped_column(
        ID, ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    source: Mapped[str] = mapped_column(STATUS)
    path: Mapped[str] = mapped_column(Text)
    note: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class RolloutRequestRow(Base):
    __tablename__ = "rollout_requests"

    request_id: Mapped[str] = mapped_column(ID, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        ID, ForeignKey("jobs.job_id", ondelete="CASCADE"), index=True
    )
    prompts: Mapped[list[Any]] = mapped_column(JSON)  # list of token-id lists
    n: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer)
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    stop_token_ids: Mapped[list[Any]] = mapped_column(JSON)
    seed: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    logprob_mode: Mapped[str] = mapped_column(STATUS, default="processed")
    return_provenance: Mapped[bool] = mapped_column(Boolean, default=False)
    top_logprobs: Mapped[int] = mapped_column(Integer, default=0)
    prompt_logprobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    speculative: Mapped[str] = mapped_column(STATUS)
    # The job's policy version when the request was accepted: every sample runs on it.
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    # GenerateRequest.bound: groups its stream sends (0 = unbounded), and whether groups
    # of the job's other bounded requests (not sent by them) count toward them.
    bound_groups: Mapped[int] = mapped_column(Integer, default=0)
    carried: Mapped[bool] = mapped_column(Boolean, default=False)
    # ... and whether its unfinished prompts park at the bound; its deadline (0 = none).
    bound_park: Mapped[bool] = mapped_column(Boolean, default=False)
    bound_deadline_ms: Mapped[int] = mapped_column(Integer, default=0)
    bound_tokens: Mapped[int] = mapped_column(Integer, default=0)  # a step's budget per sample
    status: Mapped[str] = mapped_column(STATUS, index=True)
    status_reason: Mapped[str] = mapped_column(Text, default="")
    samples_done: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SampleRow(Base):
    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("request_id", "prompt_index", "sample_index"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(
        ID, ForeignKey("rollout_requests.request_id", ondelete="CASCADE")
    )
    prompt_index: Mapped[int] = mapped_column(Integer)
    sample_index: Mapped[int] = mapped_column(Integer)
    # Token ids (little-endian int32) and logprobs (little-endian float64), packed: a
    # 4,096-token sample is 48 KB to copy instead of ~60 KB of JSON to encode and parse.
    token_ids_bin: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    logprobs_bin: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # The same as JSON: rows stored before the packed columns, and ids beyond int32.
    token_ids: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    logprobs: Mapped[list[Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # Kept beside token_ids because summing JSON array lengths is not portable SQL.
    num_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(STATUS)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    drafter_version: Mapped[int] = mapped_column(Integer, default=0)
    spec_draft_steps: Mapped[int] = mapped_column(Integer, default=0)
    spec_plain_steps: Mapped[int] = mapped_column(Integer, default=0)
    spec_accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    spec_mean_accepted_length: Mapped[float] = mapped_column(Float, default=0.0)
    spec_drafted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    spec_bonus_tokens: Mapped[int] = mapped_column(Integer, default=0)
    spec_residual_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Per-token [source, drafter, draft_length] when the request asked for it, else NULL.
    provenance: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    # [[first token index, policy version], ...] when more than one version produced it.
    policy_spans: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    # Per token [[ids...], [logprobs...]] when the request asked for top alternatives.
    top_logprobs: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    # {"logprobs": [...], "ranks": [...], "top": [[[ids], [logprobs]], ...]} when asked.
    prompt_logprobs: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    partial: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str] = mapped_column(Text, default="")
    # Drawn by the simulated engine, not computed by a model (Backend.SIM).
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SampleCheckpointRow(Base):
    """A running sample's tokens so far, stored while it runs: a node that takes its unit over
    after a loss goes on from them. The newest (longest) one per sample; not a result."""

    __tablename__ = "sample_checkpoints"

    request_id: Mapped[str] = mapped_column(
        ID, ForeignKey("rollout_requests.request_id", ondelete="CASCADE"), primary_key=True
    )
    prompt_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    sample_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    num_tokens: Mapped[int] = mapped_column(Integer)
    # Packed as in samples (NULL, with the values in `state`, for ids beyond int32).
    token_ids_bin: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    logprobs_bin: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # The rest of the sample's columns (versions, spans, counters) as `samples` holds them.
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class DrafterVersionRow(Base):
    __tablename__ = "drafter_versions"
    __table_args__ = (UniqueConstraint("job_id", "version"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ID, ForeignKey("jobs.job_id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    train_steps: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float] = mapped_column(Float, default=0.0)
    acceptance_length: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[str] = mapped_column(STATUS)
    status_reason: Mapped[str] = mapped_column(Text, default="")
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    # The node that wrote the checkpoint, and whether `path` is on storage every node reads
    # (`shared_dir`); otherwise only that node can load it.
    node_id: Mapped[str] = mapped_column(ID, default="")
    shared: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class DrafterLeaseRow(Base):
    """Who trains a job's drafter: one node at a time, under a lease read against the
    database's clock. `lease_epoch` grows with every acquisition (not with a renewal): the
    fencing token a publish carries. `cursor` is the last sample id training has consumed,
    whichever node produced the samples."""

    __tablename__ = "drafter_leases"

    job_id: Mapped[str] = mapped_column(
        ID, ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    owner_node: Mapped[str] = mapped_column(ID, default="")
    owner_epoch: Mapped[int] = mapped_column(BigInteger, default=0)  # the node's epoch
    lease_epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    cursor: Mapped[int] = mapped_column(BigInteger, default=0)
    published_version: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class JobPauseRow(Base):
    """A paused job: new requests of it wait at admission on every node until it is resumed
    (tltd.services.pause)."""

    __tablename__ = "job_pauses"
    job_id: Mapped[str] = mapped_column(
        ID, ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    mode: Mapped[str] = mapped_column(STATUS)
    paused_at: Mapped[datetime] = mapped_column(UTCDateTime())


class PushRow(Base):
    """An unfinished policy push staged on a node: what its staging file holds, so that the
    same update id resumes after a daemon restart (tltd.services.push)."""

    __tablename__ = "pushes"
    node_id: Mapped[str] = mapped_column(ID, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        ID, ForeignKey("jobs.job_id", ondelete="CASCADE"), primary_key=True
    )
    update_id: Mapped[str] = mapped_column(ID, primary_key=True)
    header: Mapped[dict[str, Any]] = mapped_column(JSON)  # tensors, note, base_version
    received: Mapped[dict[str, Any]] = mapped_column(JSON)  # tensor name -> bytes on disk
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class NodeRow(Base):
    """One daemon. DOWN is not stored: it is a heartbeat older than the threshold, read
    against the database's clock."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(ID, primary_key=True)
    address: Mapped[str] = mapped_column(String(256), default="")
    state: Mapped[str] = mapped_column(STATUS)  # "up" | "left" (a clean shutdown)
    # Incremented by every start (and by a return after missing heartbeats): the fencing
    # token every ownership-dependent write of the node carries.
    epoch: Mapped[int] = mapped_column(BigInteger)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    # Set by an operator through any node (`tltctl cordon|drain --node ID`); the node reads
    # them at its heartbeat (or at once, on a notification). A start clears them.
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    drain_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    drain_reason: Mapped[str] = mapped_column(Text, default="")
    drain_grace_seconds: Mapped[float] = mapped_column(Float, default=0.0)


class WorkUnitRow(Base):
    """One prompt of a rollout request: what a node claims, under a lease, to run."""

    __tablename__ = "work_units"
    __table_args__ = (
        Index("ix_work_units_state_created_at", "state", "created_at"),
        Index("ix_work_units_prompt_key", "prompt_key"),
    )

    request_id: Mapped[str] = mapped_column(
        ID, ForeignKey("rollout_requests.request_id", ondelete="CASCADE"), primary_key=True
    )
    prompt_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    samples: Mapped[int] = mapped_column(Integer)  # the request's n: the claim's size
    # sha256 of the prompt's token ids (rollout_requests.prompt_key): finds a prompt's earlier
    # answers. NULL for units stored before the column existed.
    prompt_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    priority: Mapped[int] = mapped_column(BigInteger, default=0)  # the job's: claimed first
    # "queued" | "leased" | "parked" (no node's: a carried request queues it) | "done" | "failed"
    state: Mapped[str] = mapped_column(STATUS)
    owner_node: Mapped[str | None] = mapped_column(ID, nullable=True, index=True)
    owner_epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    # A session's turn: the node that ran the previous turn (it holds the session's KV);
    # other nodes leave the unit to it for `session_affinity_seconds` after its creation.
    preferred_node: Mapped[str | None] = mapped_column(ID, nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims so far
    reason: Mapped[str] = mapped_column(Text, default="")
    # A bounded request's group (its samples, done) sent by the stream of this request id
    # (its own or a later one that took it as carried); "" = dropped as too stale; NULL = not
    # sent yet. Written once: a group is sent by one request only.
    delivered_to: Mapped[str | None] = mapped_column(ID, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class DeviceRow(Base):
    __tablename__ = "devices"

    # Device ids ("cpu:0", "cuda:0") repeat on every node: a device is (node, device).
    node_id: Mapped[str] = mapped_column(ID, primary_key=True)
    device_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(STATUS)
    # "index" is an SQL keyword; a plain column name avoids quoting surprises in raw SQL.
    device_index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str] = mapped_column(String(128), default="")
    name: Mapped[str] = mapped_column(String(256), default="")
    memory_total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    memory_used_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    utilization: Mapped[float] = mapped_column(Float, default=0.0)
    processes: Mapped[list[Any]] = mapped_column(JSON)  # [{"pid", "used_memory_bytes", "ours"}]
    foreign: Mapped[bool] = mapped_column(Boolean, default=False)
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    state: Mapped[str] = mapped_column(STATUS)
    state_reason: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class WorkerRow(Base):
    __tablename__ = "workers"

    node_id: Mapped[str] = mapped_column(ID, primary_key=True)
    worker_id: Mapped[str] = mapped_column(ID, primary_key=True)
    kind: Mapped[str] = mapped_column(STATUS)
    # No foreign keys to devices/jobs: a worker row outlives a vanished device or a GC'd job.
    device_id: Mapped[str] = mapped_column(String(64), index=True)
    job_id: Mapped[str] = mapped_column(ID, default="")
    state: Mapped[str] = mapped_column(STATUS, index=True)
    pid: Mapped[int] = mapped_column(Integer, default=0)
    state_reason: Mapped[str] = mapped_column(Text, default="")
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_heartbeat: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_entity_entity_id", "entity", "entity_id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    entity: Mapped[str] = mapped_column(STATUS)
    entity_id: Mapped[str] = mapped_column(String(256))
    old_status: Mapped[str] = mapped_column(String(64), default="")
    new_status: Mapped[str] = mapped_column(String(64), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    at: Mapped[datetime] = mapped_column(UTCDateTime())


class SessionRow(Base):
    """A multi-turn session of a job: its prompt and counters; its turns are rows of their own
    (session_turns)."""

    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(ID, primary_key=True)
    job_id: Mapped[str] = mapped_column(
        ID, ForeignKey("jobs.job_id", ondelete="CASCADE"), index=True
    )
    prompt_bin: Mapped[bytes] = mapped_column(LargeBinary)  # little-endian int32 token ids
    status: Mapped[str] = mapped_column(STATUS)
    num_turns: Mapped[int] = mapped_column(Integer, default=0)  # done
    num_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Turns given up (their request ended without a sample): the next attempt's request id.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # A request naming no earlier turn continues the latest one (SGLang's streaming session).
    streaming: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class SessionTurnRow(Base):
    """One turn of a session: the environment's tokens before it, then (once done) what the
    policy sampled, packed as samples are."""

    __tablename__ = "session_turns"

    session_id: Mapped[str] = mapped_column(
        ID, ForeignKey("sessions.session_id", ondelete="CASCADE"), primary_key=True
    )
    turn_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    request_id: Mapped[str] = mapped_column(ID)
    status: Mapped[str] = mapped_column(STATUS)
    input_bin: Mapped[bytes] = mapped_column(LargeBinary)
    # The caller's sampling (after the wire's defaults): a retry must send the same.
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    token_ids_bin: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    logprobs_bin: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(STATUS, nullable=True)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)
    # [[first token index, policy version], ...] when more than one version sampled it.
    policy_spans: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
