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
        ({"bogus": 1}, "unknown setting"),
    ],
)
def test_refuses_unsafe_or_broken_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(None, env={}, overrides=overrides)


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
