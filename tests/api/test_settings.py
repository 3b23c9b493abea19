"""Settings: TOML < TLTD_* env < flags, and refusing unsafe listening configurations."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tltd.cli import main as tltd_main
from tltd.errors import ConfigError
from tltd.settings import load_settings


def test_precedence_file_env_flags(tmp_path):
    cfg = tmp_path / "tltd.toml"
    cfg.write_text(
        'port = 6000\ncpu_slots = 3\nlog_level = "DEBUG"\ndata_dir = "/from/file"\n'
        '[tokens]\nt1 = "admin"\n'
    )
    env = {"TLTD_PORT": "7000", "TLTD_CPU_SLOTS": "4", "TLTD_LOG_JSON": "true"}
    s = load_settings(cfg, env=env, overrides={"port": 8000, "data_dir": None})
    assert s.port == 8000  # flag beats env beats file
    assert s.cpu_slots == 4  # env beats file
    assert s.log_level == "DEBUG" and s.data_dir == "/from/file"  # file beats default
    assert s.log_json is True and dict(s.tokens) == {"t1": "admin"}
    assert load_settings(None, env={}).port == 50051  # defaults
    # TLTD_CONFIG names the file when no --config is given.
    assert load_settings(None, env={"TLTD_CONFIG": str(cfg)}).port == 6000
    assert load_settings(None, env={"TLTD_TOKENS": "a=admin, b=trainer"}).tokens == {
        "a": "admin",
        "b": "trainer",
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"host": "0.0.0.0"}, "auth tokens are required"),
        ({"host": "0.0.0.0", "tokens": {"t": "admin"}}, "without TLS"),
        ({"tokens": {"t": "root"}}, "role"),
        ({"tls_cert": "/c.pem"}, "together"),
        ({"tls_client_ca": "/ca.pem"}, "mTLS"),
        ({"cpu_slots": -1}, "cpu_slots"),
        ({"default_backend": "vllm"}, "default_backend"),
        ({"spec_gate": "always"}, "spec_gate"),
        ({"session_placement": "random"}, "session_placement must be one of sticky, hash"),
        ({"bogus": 1}, "unknown setting"),
    ],
)
def test_refuses_unsafe_or_broken_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(None, env={}, overrides=overrides)


def test_session_placement_reaches_the_scheduler():
    from tltd.daemon import scheduler_config

    assert load_settings(None, env={}).session_placement == "sticky"
    for value in ("sticky", "hash", "round_robin"):
        s = load_settings(None, env={"TLTD_SESSION_PLACEMENT": value})
        assert scheduler_config(s).session_placement == value
    with pytest.raises(ConfigError, match="TLTD_SESSION_PLACEMENT|session_placement"):
        load_settings(None, env={"TLTD_SESSION_PLACEMENT": "Sticky"})


def test_beyond_loopback_with_tokens_and_tls_is_allowed():
    s = load_settings(
        None,
        env={},
        overrides={"host": "0.0.0.0", "tokens": {"t": "admin"}, "tls_cert": "/c", "tls_key": "/k"},
    )
    assert not s.is_loopback and s.address == "0.0.0.0:50051"


def test_bad_config_file_and_env(tmp_path):
    (tmp_path / "bad.toml").write_text("port = [")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_settings(tmp_path / "bad.toml", env={})
    with pytest.raises(ConfigError, match="TLTD_PORT"):
        load_settings(None, env={"TLTD_PORT": "eighty"})


def test_serve_config_error_exits_2(tmp_path, monkeypatch):
    for var in ("TLTD_TOKENS", "TLTD_CONFIG", "TLTD_HOST"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(
        tltd_main, ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "configuration error" in result.output and "tokens are required" in result.output
    result = CliRunner().invoke(
        tltd_main, ["serve", "--log-level", "LOUD", "--data-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and "log level" in result.output


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("worker_max_batch = 1.5", r"worker_max_batch in .*expected an integer, got 1\.5"),
        ("cpu_slots = true", "cpu_slots in .*expected an integer, got True"),
        ("port = [1]", r"port in .*expected an integer, got \[1\]"),
        ('tokens = "abc"', "tokens in .*expected 'token=role"),
        ('log_json = "yes please"', "log_json in .*expected a boolean"),
        ("log_level = 3", "log_level in .*expected a string"),
        ('shutdown_grace_seconds = "soon"', "shutdown_grace_seconds in .*finite number"),
        ("shutdown_grace_seconds = nan", "shutdown_grace_seconds in .*finite number"),
    ],
)
def test_config_file_values_are_type_checked(tmp_path, toml, message):
    cfg = tmp_path / "tltd.toml"
    cfg.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=message):
        load_settings(cfg, env={})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TLTD_LOG_JSON": "ture"}, "TLTD_LOG_JSON: expected a boolean"),
        ({"TLTD_DRAFTER_TRAINING": "flase"}, "TLTD_DRAFTER_TRAINING: expected a boolean"),
        ({"TLTD_TOKENS": "abc"}, "TLTD_TOKENS: expected 'token=role"),
        ({"TLTD_PORT": "99999"}, r"port must be a port \(0-65535\), got 99999 \(from TLTD_PORT\)"),
        ({"TLTD_METRICS_PORT": "-5"}, "metrics_port must be >= 0.*TLTD_METRICS_PORT"),
        ({"TLTD_SHUTDOWN_GRACE_SECONDS": "-1"}, "shutdown_grace_seconds must be >= 0"),
        ({"TLTD_WORKER_HEARTBEAT_SECONDS": "0"}, "worker_heartbeat_seconds must be > 0"),
        ({"TLTD_DEVICE_REFRESH_SECONDS": "0"}, "device_refresh_seconds must be > 0"),
        ({"TLTD_WORKER_COST_BUDGET_SECONDS": "-1"}, "worker_cost_budget_seconds must be >= 0"),
        (
            {"TLTD_TRAINING_HEARTBEAT_TIMEOUT_SECONDS": "0"},
            "training_heartbeat_timeout_seconds must be > 0",
        ),
        ({"TLTD_MAX_PROMPT_TOKENS": "0"}, "max_prompt_tokens must be > 0"),
        ({"TLTD_TRAINING_ROW_LEN": "0"}, "training_row_len must be > 0"),
        (
            {"TLTD_TRAINING_HEARTBEAT_TIMEOUT_SECONDS": "1"},
            r"training_heartbeat_timeout_seconds must be at least 3 x worker_heartbeat_seconds",
        ),
        (
            {"TLTD_WORKER_HEARTBEAT_SECONDS": "20"},  # the 30 s timeouts now too short
            r"worker_heartbeat_timeout_seconds must be at least 3 x .*\(60s\)",
        ),
    ],
)
def test_env_values_are_type_and_range_checked(env, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(None, env=env)


def test_valid_spellings_still_load(tmp_path):
    s = load_settings(
        None,
        env={"TLTD_LOG_JSON": "Off", "TLTD_DRAFTER_TRAINING": "1", "TLTD_PORT": "65535"},
        overrides={"data_dir": tmp_path, "shutdown_grace_seconds": 0, "metrics_port": 0},
    )
    assert (s.log_json, s.drafter_training, s.port) == (False, True, 65535)
    assert s.data_dir == str(tmp_path) and s.shutdown_grace_seconds == 0.0
    assert isinstance(s.shutdown_grace_seconds, float)


def test_serve_bad_values_exit_2_without_a_traceback(tmp_path, monkeypatch):
    for var in ("TLTD_TOKENS", "TLTD_CONFIG", "TLTD_HOST", "TLTD_PORT", "TLTD_METRICS_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "tltd.toml"
    cfg.write_text('tokens = "abc"\n')
    for args in (["--config", str(cfg)], ["--metrics-port", "70000"], ["--port", "-1"]):
        result = CliRunner().invoke(tltd_main, ["serve", "--data-dir", str(tmp_path), *args])
        assert result.exit_code == 2, result.output
        assert "configuration error" in result.output and "Traceback" not in result.output
