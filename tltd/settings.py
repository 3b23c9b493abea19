"""One frozen settings object, built once from a TOML file, TLTD_* environment and flags."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltd.errors import ConfigError


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
    # Devices
    cpu_slots: int = 1  # used where NVML is absent
    device_refresh_seconds: float = 10.0
    # Engine defaults
    default_backend: str = "torch"
    default_model_path: str = ""
    spec_batch_threshold: int = 32
    # Rollout workers (one process per device)
    worker_max_batch: int = 64  # samples one engine runs at once (the scheduler's capacity)
    worker_max_seq_len: int = 2048  # prompt + generated tokens per sample (KV cache size)
    worker_threads: int = 1  # torch threads per CPU worker
    worker_heartbeat_seconds: float = 0.5
    worker_heartbeat_timeout_seconds: float = 30.0  # silent this long while up -> killed
    worker_start_timeout_seconds: float = 300.0  # spawn or model load taking longer -> killed
    max_sample_attempts: int = 3  # workers lost while running one sample before it fails
    scheduler_tick_seconds: float = 0.5  # the supervisor also ticks on every event
    # Drafter training on idle devices (tltd.training); a job opts in with
    # speculative.online_training, this switch turns it off for the whole node.
    drafter_training: bool = True
    training_idle_grace_seconds: float = 2.0  # a device idle this long may train
    training_min_fresh_samples: int = 32  # new finished samples a job needs for a round
    training_cadence_seconds: float = 30.0  # minimum time between rounds of one job
    training_steps_per_round: int = 50  # optimizer steps; a version is published after each
    training_buffer_bytes: int = 64 << 20  # the trainer's sample buffer (token ids only)
    training_recent_samples: int = 2048  # kept by the daemon to refill a restarted trainer
    training_held_out_every: int = 5  # every n-th finished sample measures acceptance instead
    training_held_out_samples: int = 32  # the newest held-out samples a publish evaluates on
    training_start_timeout_seconds: float = 300.0
    drafter_keep_versions: int = 5  # GC keeps the newest n versions + pinned + active
    drafter_gc_seconds: float = 600.0
    # Limits
    max_prompts_per_request: int = 1024
    max_samples_per_request: int = 4096
    max_prompt_tokens: int = 8192
    max_new_tokens_limit: int = 32768
    # Lifecycle
    shutdown_grace_seconds: float = 30.0
    drain_grace_seconds: float = 30.0
    # A file whose appearance (a cloud preemption notice) starts the same shutdown as SIGTERM.
    preemption_notice_file: str = ""
    metrics_port: int = 0  # 0 = disabled
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

    def drafter_versions_dir(self, job_id: str) -> Path:
        """Where a job's drafter version checkpoints live (online ones and the initial one)."""
        return Path(self.data_dir) / "drafters" / job_id / "versions"

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(name: str, value: Any) -> Any:
    """Turn env/flag strings into the field's type; TOML values are already typed."""
    default = _FIELDS[name].default
    if name == "tokens":
        if isinstance(value, Mapping):
            return dict(value)
        # TLTD_TOKENS="tok1=admin,tok2=trainer"
        pairs = [p.split("=", 1) for p in str(value).split(",") if p.strip()]
        return {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, str):
        return value
    if isinstance(default, bool):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


def load_settings(
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults < TOML file < TLTD_* env < explicit overrides (flags), then validate."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
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
            values[key] = _coerce(key, value)
    for name in _FIELDS:
        env_name = f"TLTD_{name.upper()}"
        if env_name in env:
            try:
                values[name] = _coerce(name, env[env_name])
            except ValueError as exc:
                raise ConfigError(f"{env_name}: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, value)
    settings = Settings(**values)
    validate(settings)
    return settings


def validate(settings: Settings) -> None:
    """Refuse configurations that are unsafe or cannot work, saying why."""
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
    if settings.training_steps_per_round < 1 or settings.training_held_out_every < 2:
        raise ConfigError("training_steps_per_round must be >= 1, training_held_out_every >= 2")
    if settings.drafter_keep_versions < 1:
        raise ConfigError("drafter_keep_versions must be >= 1")
    if settings.max_sample_attempts < 1:
        raise ConfigError("max_sample_attempts must be >= 1")
    if settings.default_backend not in ("torch", "sglang"):
        raise ConfigError(
            f"default_backend must be 'torch' or 'sglang', got {settings.default_backend!r}"
        )
