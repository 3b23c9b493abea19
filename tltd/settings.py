"""One frozen settings object, built once from a TOML file, TLTD_* environment and flags."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltd.contract.sim import parse_sim
from tltd.domain import SESSION_PLACEMENTS
from tltd.errors import ConfigError


def default_node_id() -> str:
    """The host name: one daemon per node."""
    return socket.gethostname() or "localhost"


@dataclass(frozen=True)
class Settings:
    # Network
    host: str = "127.0.0.1"
    port: int = 50051
    # Auth: token -> role ("trainer" | "admin"). Required when listening beyond loopback.
    tokens: Mapping[str, str] = field(default_factory=dict)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set -> mTLS (clients must present a cert signed by this CA)
    # State
    data_dir: str = "var/tltd"
    database_url: str = ""  # empty -> sqlite file under data_dir
    # A directory every node of one database reads and writes (NFS, a shared volume): drafter
    # versions and pushed policy weights are written there, so that any node loads a drafter
    # another one trained or a version another one received. Empty: under data_dir, readable
    # by the node that wrote them only (other nodes run the job without such a drafter, and
    # cannot load such a policy version).
    shared_dir: str = ""
    # Devices
    cpu_slots: int = 1  # used where NVML is absent
    device_refresh_seconds: float = 10.0
    # Engine defaults
    default_backend: str = "torch"
    # The function ("module:function") SGLang workers build their engine with: sglang.Engine
    # by default; another for a wrapped engine (the tests name a fake engine here).
    sglang_engine_factory: str = "tltd_workers.sglang.engine:make_engine"
    # The simulated engine (backend "sim": samples drawn, not computed, for capacity planning;
    # `tltd.contract.sim.parse_sim`): "" refuses every job that asks for it; "zero" costs
    # nothing; e.g. "step_ms=6.3,kv_ns=21,median=1500" sleeps a GPU-like step time. Never
    # the default backend: a job must ask for it.
    sim_engine: str = ""
    default_model_path: str = ""
    spec_batch_threshold: int = 32
    # Torch workers' SD gate: "measured" (step costs timed on the device + bandit) or
    # "threshold" (SD while the running batch <= the job's batch_threshold; for ablations).
    spec_gate: str = "measured"
    # Rollout workers (one process per device)
    worker_max_batch: int = 64  # samples one engine runs at once (the scheduler's capacity)
    # prompt + generated tokens per sample (KV cache size): a ~256-token prompt plus the
    # 2,048-token cap reasoning rollouts commonly use
    worker_max_seq_len: int = 2304
    worker_threads: int = 1  # torch threads per CPU worker
    # Torch workers append what their engine did per step (batch, arm, drafts kept, sample
    # lengths, step times) to <dir>/<worker id>.jsonl, for benchmarks/sim_rollout.py to replay
    # under another device's costs; "" = off. Recording does not change what the engine does.
    engine_trace_dir: str = ""
    # KV of sessions' finished turns a torch worker keeps for their next turn (MiB; 0 = none)
    worker_prefix_cache_mb: int = 256
    # A torch worker's first load times its forwards per batch size for the measured gate's
    # cost model, within this budget (batches it does not reach are timed online; 0 = none).
    worker_cost_budget_seconds: float = 2.0
    # Where a session's turn runs (`tltd.scheduler`): "sticky" (the worker with its KV unless
    # that one is much busier), "hash" (by session id, whatever the load), "round_robin".
    session_placement: str = "sticky"
    # Several nodes, "sticky": a session's turn waits this long for the node that ran its
    # previous turn (it holds the KV) before another node with room takes it.
    session_affinity_seconds: float = 1.0
    worker_heartbeat_seconds: float = 0.5
    worker_heartbeat_timeout_seconds: float = 30.0  # silent this long while up -> killed
    worker_start_timeout_seconds: float = 300.0  # spawn or model load taking longer -> killed
    # Memory limit of each rollout worker process (and its engine's subprocesses), in MiB, in
    # a memory cgroup of its own (tltd.memory_cgroup); 0 = none. Over it, the kernel's OOM
    # killer ends the worker: recorded as such, its samples re-run on a fresh process.
    worker_memory_limit_mb: int = 0
    max_sample_attempts: int = 3  # workers lost while running one sample before it fails
    # A torch worker stores the tokens so far of a sample running this long (then again each
    # time as long again): a node that takes the sample over after a loss goes on from them
    # (0 = never: it runs again from its seed).
    sample_checkpoint_seconds: float = 10.0
    scheduler_tick_seconds: float = 0.5  # the supervisor also ticks on every event
    # Drafter training on idle devices (tltd.drafter_training); a job opts in with
    # speculative.online_training, this switch turns it off for the whole node.
    drafter_training: bool = True
    training_idle_grace_seconds: float = 2.0  # a device idle this long may train
    training_min_fresh_samples: int = 32  # new finished samples a job needs for a round
    training_cadence_seconds: float = 30.0  # minimum time between rounds of one job
    # When a job's drafter may train: "idle" on any idle device; "rollout" only while that
    # job's rollout is in flight on this node (work waiting or running), yielding when its
    # last sample is done. "rollout" is for a node whose cores or GPUs the RL trainer uses
    # between rollouts (colocated): TLT's spot trainer, which fills the rollout's tail and
    # leaves the update to the trainer; there rounds follow each other in the tail on any
    # fresh sample (no cadence, no minimum).
    training_window: str = "idle"
    training_steps_per_round: int = 50  # optimizer steps; a version is published after each
    # Spawn a job's trainer at its first finished sample and keep it idle until its first
    # round, so that round trains from the start of an idle window instead of loading torch,
    # the target and the drafter through it (seconds: a rollout's whole tail on a small node).
    # It holds that memory from then on. Single node, CPU devices only.
    training_warm_start: bool = False
    training_buffer_bytes: int = 64 << 20  # the trainer's sample buffer (token ids only)
    # Drafter positions per packed training row; a longer sample trains as several windows,
    # each attending to at most this many positions. All windows of a micro-step's samples
    # go through one forward: its activation memory grows with their total length.
    training_row_len: int = 512
    training_recent_samples: int = 2048  # kept by the daemon to refill a restarted trainer
    training_held_out_every: int = 5  # every n-th finished sample measures acceptance instead
    training_held_out_samples: int = 32  # the newest held-out samples a publish evaluates on
    training_start_timeout_seconds: float = 300.0
    # A trainer heartbeats every worker_heartbeat_seconds; silent this long while up -> killed.
    training_heartbeat_timeout_seconds: float = 30.0
    # Several nodes (PostgreSQL): one node trains a job's drafter at a time under a lease this
    # long, renewed every third of it while its trainer lives; a lapsed lease is taken over.
    drafter_lease_seconds: float = 30.0
    drafter_keep_versions: int = 5  # GC keeps the newest n versions + pinned + active
    drafter_gc_seconds: float = 600.0
    # Pushed policy weights (PushPolicy): a push no stream has sent into for this long is
    # dropped with its staging file (a trainer that died mid-push leaves nothing behind).
    push_idle_seconds: float = 600.0
    push_gc_seconds: float = 60.0
    # The weights of pushed versions beyond the newest n of a job are deleted when a push is
    # recorded (each is a whole model on the daemon's disk); 0 = keep them all.
    push_keep_versions: int = 3
    # A policy broadcast (OpenBroadcast) is also received by the job's live torch workers, as
    # ranks of the trainer's group: each holds the new weights in memory (one more copy of the
    # model, until the version is recorded) and switches without reading the daemon's file.
    broadcast_to_workers: bool = True
    # Ended requests (with their samples) and events older than this are deleted; 0 = never.
    history_retention_hours: float = 168.0
    history_gc_seconds: float = 3600.0
    # Several nodes on one PostgreSQL database (docs/reliability.md). node_id: empty -> the
    # host name. A node whose heartbeat is older than node_down_seconds is DOWN; a unit's
    # lease lasts lease_seconds (renewed every third of it) by the database's clock.
    node_id: str = ""
    node_heartbeat_seconds: float = 1.0
    node_down_seconds: float = 10.0
    lease_seconds: float = 10.0
    claim_interval_seconds: float = 0.5  # how often a node with free capacity claims work
    stream_poll_seconds: float = 0.5  # a Generate stream reads the store this often
    # A bounded Generate (asynchronous RL) looks for groups done elsewhere this often.
    bound_poll_seconds: float = 0.1
    # Limits
    max_prompts_per_request: int = 1024
    max_samples_per_request: int = 4096
    max_prompt_tokens: int = 8192
    max_new_tokens_limit: int = 32768
    # Lifecycle
    shutdown_grace_seconds: float = 30.0
    drain_grace_seconds: float = 30.0
    # A file whose appearance (a cloud preemption notice) starts the same shutdown as SIGTERM.
    # One already there and older than the daemon (a past preemption's) is ignored, with a
    # warning, until it is rewritten or removed and created again.
    preemption_notice_file: str = ""
    metrics_port: int = 0  # 0 = disabled
    # The HTTP door (docs/http.md): OpenAI- and SGLang-compatible endpoints on `host`, with the
    # same tokens and TLS as the gRPC port. Off unless enabled; port 0 = any free port.
    http_enabled: bool = False
    http_port: int = 8000
    log_level: str = "INFO"
    log_json: bool = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{Path(self.data_dir) / 'tltd.db'}"

    @property
    def drafters_root(self) -> Path:
        """Where drafter versions live: under shared_dir when set, else under data_dir."""
        return Path(self.shared_dir or self.data_dir) / "drafters"

    @property
    def pushes_root(self) -> Path:
        """Where pushed policy versions are staged and kept: under shared_dir when set (every
        node loads them; staging per node, on the same filesystem so that a version appears
        by one rename), else under data_dir (only this node's workers can load them)."""
        if self.shared_dir:
            return Path(self.shared_dir).resolve()
        return Path(self.data_dir).resolve()

    def drafter_versions_dir(self, job_id: str) -> Path:
        """Where a job's drafter version checkpoints live (online ones and the initial one)."""
        return self.drafters_root / job_id / "versions"

    @property
    def resolved_node_id(self) -> str:
        return self.node_id or default_node_id()

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# Numbers must be >= 0; these must be > 0 (0 would mean a busy loop, an instant timeout or
# refusing every request), ports at most 65535.
_POSITIVE = frozenset(
    (
        "device_refresh_seconds",
        "worker_threads",
        "worker_heartbeat_seconds",
        "worker_heartbeat_timeout_seconds",
        "worker_start_timeout_seconds",
        "scheduler_tick_seconds",
        "training_buffer_bytes",
        "training_row_len",
        "training_start_timeout_seconds",
        "training_heartbeat_timeout_seconds",
        "drafter_gc_seconds",
        "history_gc_seconds",
        "push_idle_seconds",
        "push_gc_seconds",
        "node_heartbeat_seconds",
        "node_down_seconds",
        "lease_seconds",
        "drafter_lease_seconds",
        "claim_interval_seconds",
        "stream_poll_seconds",
        "bound_poll_seconds",
        "max_prompts_per_request",
        "max_samples_per_request",
        "max_prompt_tokens",
        "max_new_tokens_limit",
    )
)
_PORTS = frozenset(("port", "metrics_port", "http_port"))


def _coerce(name: str, value: Any) -> Any:
    """The value (a TOML value, an env string or a flag) as the field's type; ValueError saying
    what was expected otherwise (TOML values are typed, but not necessarily rightly)."""
    default = _FIELDS[name].default
    if name == "tokens":
        if isinstance(value, Mapping):
            tokens = dict(value)
        elif isinstance(value, str):  # TLTD_TOKENS="tok1=admin,tok2=trainer"
            pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError(f"expected 'token=role,...', got {value!r}")
            tokens = {k.strip(): v.strip() for k, v in pairs}
        else:
            raise ValueError(f"expected a table of token = role, got {value!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()):
            raise ValueError("expected string tokens and roles")
        return tokens
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected a boolean (true/false), got {value!r}")
    if isinstance(default, int):
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(default, float):
        number = None
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        if number is None or not math.isfinite(number):
            raise ValueError(f"expected a finite number, got {value!r}")
        return number
    if isinstance(default, str):
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
    return value


def load_settings(
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults < TOML file < TLTD_* env < explicit overrides (flags), then validate."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}  # field -> where its value came from, for error messages
    path = config_file or env.get("TLTD_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        for key, value in data.items():
            if key not in _FIELDS:
                raise ConfigError(f"unknown setting {key!r} in {path}")
            values[key] = _checked(key, value, f"{key} in {path}")
            sources[key] = str(path)
    for name in _FIELDS:
        env_name = f"TLTD_{name.upper()}"
        if env_name in env:
            values[name] = _checked(name, env[env_name], env_name)
            sources[name] = env_name
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _checked(key, value, key)
        sources[key] = "command line"
    settings = Settings(**values)
    validate(settings, sources)
    return settings


def _checked(name: str, value: Any, where: str) -> Any:
    try:
        return _coerce(name, value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_ranges(settings: Settings, sources: Mapping[str, str]) -> None:
    for name, f in _FIELDS.items():
        if not isinstance(f.default, int | float) or isinstance(f.default, bool):
            continue
        value = getattr(settings, name)
        where = f" (from {sources[name]})" if name in sources else ""
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}{where}")
        positive = name in _POSITIVE
        if value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise ConfigError(f"{name} must be {bound}, got {value!r}{where}")
        if name in _PORTS and value > 65535:
            raise ConfigError(f"{name} must be a port (0-65535), got {value!r}{where}")


# Settings that take one of a few words.
_CHOICES = {
    "training_window": ("idle", "rollout"),
    "spec_gate": ("measured", "threshold"),
    "session_placement": SESSION_PLACEMENTS,
    "default_backend": ("torch", "sglang"),
}


def validate(settings: Settings, sources: Mapping[str, str] | None = None) -> None:
    """Refuse configurations that are unsafe or cannot work, saying why (and, given
    `sources`, where the value came from)."""
    _check_ranges(settings, sources or {})
    for token, role in settings.tokens.items():
        if role not in ("trainer", "admin"):
            raise ConfigError(f"token role must be 'trainer' or 'admin', got {role!r}")
        if not token:
            raise ConfigError("empty auth token")
    if not settings.is_loopback and not settings.tokens:
        raise ConfigError(
            f"refusing to listen on {settings.host}: beyond loopback, auth tokens are required "
            "(set `tokens` in the config file or TLTD_TOKENS='token=admin,...')"
        )
    if not settings.is_loopback and not settings.tls_cert:
        raise ConfigError(
            f"refusing to listen on {settings.host} without TLS: bearer tokens would travel in "
            "clear text (set tls_cert and tls_key)"
        )
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigError("tls_cert and tls_key must be set together")
    if settings.tls_client_ca and not settings.tls_cert:
        raise ConfigError("tls_client_ca (mTLS) needs tls_cert and tls_key")
    if settings.cpu_slots < 0:
        raise ConfigError("cpu_slots must be >= 0")
    if settings.worker_max_batch < 1 or settings.worker_max_seq_len < 2:
        raise ConfigError("worker_max_batch must be >= 1 and worker_max_seq_len >= 2")
    if settings.worker_prefix_cache_mb < 0:
        raise ConfigError("worker_prefix_cache_mb must be >= 0")
    if not settings.worker_cost_budget_seconds >= 0:  # NaN fails too
        raise ConfigError("worker_cost_budget_seconds must be >= 0")
    if settings.training_steps_per_round < 1 or settings.training_held_out_every < 2:
        raise ConfigError("training_steps_per_round must be >= 1, training_held_out_every >= 2")
    beat = settings.worker_heartbeat_seconds
    for name in ("worker_heartbeat_timeout_seconds", "training_heartbeat_timeout_seconds"):
        if getattr(settings, name) < 3 * beat:  # a late beat or two must not get one killed
            raise ConfigError(
                f"{name} must be at least 3 x worker_heartbeat_seconds ({3 * beat:g}s)"
            )
    if settings.node_down_seconds < 3 * settings.node_heartbeat_seconds:
        raise ConfigError("node_down_seconds must be at least 3 x node_heartbeat_seconds")
    if len(settings.node_id) > 128:
        raise ConfigError("node_id must be at most 128 characters")
    if settings.drafter_keep_versions < 1:
        raise ConfigError("drafter_keep_versions must be >= 1")
    if settings.max_sample_attempts < 1:
        raise ConfigError("max_sample_attempts must be >= 1")
    for name, allowed in _CHOICES.items():
        if (value := getattr(settings, name)) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    _check_sim_engine(settings.sim_engine)


def _check_sim_engine(value: str) -> None:
    """The simulated engine's setting parses (`tltd.contract.sim`); "" = none allowed."""
    if value:
        try:
            parse_sim(value)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
