"""`tltd serve` as a real subprocess: start on port 0, serve, SIGTERM -> ordered shutdown, exit 0,
database consistent (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from tests.api.support import write_model_dir
from tltd.store.migrate import alembic_config, current_revision
from tltd_clients.client import TltClient
from tltd_clients.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]


class Daemon:
    def __init__(self, tmp_path: Path, db_url: str, *extra: str) -> None:
        self.port_file = tmp_path / "port"
        self.log_file = tmp_path / "tltd.log"
        # A clean environment: no TLTD_* from the developer's shell leaks into the test.
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        cmd = [
            sys.executable,
            "-m",
            "tltd",
            "serve",
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            "--data-dir",
            str(tmp_path / "data"),
            "--database-url",
            db_url,
            "--cpu-slots",
            "2",
            "--log-json",
            *extra,
        ]
        self._log = open(self.log_file, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"tltd did not start:\n{self.log_file.read_text()}")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())
        self.target = f"127.0.0.1:{self.port}"

    def logs(self) -> list[dict]:
        return [
            json.loads(line)
            for line in self.log_file.read_text().splitlines()
            if line.startswith("{")
        ]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _head() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


@pytest.mark.slow
def test_serve_and_graceful_shutdown(db_url, tmp_path):
    daemon = Daemon(tmp_path, db_url)
    try:
        with TltClient(daemon.target) as c:
            assert c.health() == "SERVING"
            stats = c.stats()
            assert stats.devices == 2 and stats.database in db_url
            assert [d.device_id for d in c.list_devices()] == ["cpu:0", "cpu:1"]
            job = c.create_job(str(write_model_dir(tmp_path / "model")), job_id="job")
            with pytest.raises(InvalidArgumentError, match="sampling.max_new_tokens"):
                list(c.generate(job.job_id, [[1, 2]]))
            assert c.health() == "SERVING"  # a rejected request does not hurt the daemon
        assert daemon.stop(signal.SIGTERM) == 0
    finally:
        daemon.kill()

    logs = daemon.logs()
    messages = [r["msg"] for r in logs]
    serving = next(r for r in logs if r["msg"] == "tltd serving")
    assert serving["address"] == daemon.target and serving["devices"] == 2
    assert messages.index("signal received") < messages.index("shutting down")
    assert messages[-1] == "tltd stopped"
    assert not [r for r in logs if r["level"] in ("error", "critical")]

    # The database is consistent and at the head revision after shutdown.
    assert current_revision(db_url) == _head()
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            assert conn.exec_driver_sql("SELECT job_id FROM jobs").scalars().all() == ["job"]
    finally:
        engine.dispose()


@pytest.mark.slow
def test_restart_keeps_state_and_sigint_also_stops(sqlite_url, tmp_path):
    first = Daemon(tmp_path, sqlite_url)
    try:
        with TltClient(first.target) as c:
            c.create_job(str(write_model_dir(tmp_path / "model")), job_id="job")
            c.cordon("cpu:1", "maintenance")
        assert first.stop(signal.SIGINT) == 0
    finally:
        first.kill()
    first.port_file.unlink()
    second = Daemon(tmp_path, sqlite_url)
    try:
        with TltClient(second.target) as c:
            assert c.get_job("job").job_id == "job"
            cordoned = {d.device_id: d.cordoned for d in c.list_devices()}
            assert cordoned == {"cpu:0": False, "cpu:1": True}  # the refresh kept the flag
        assert second.stop() == 0
    finally:
        second.kill()


def test_port_in_use_is_a_config_error(sqlite_url, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tltd",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                str(tmp_path),
                "--database-url",
                sqlite_url,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr


def test_unreachable_database_is_a_config_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
    url = "postgresql+psycopg://tltd:s3cret@127.0.0.1:1/nowhere"
    proc = subprocess.run(
        [sys.executable, "-m", "tltd", "serve", "--port", "0", "--database-url", url],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot open database postgresql+psycopg://tltd:***@127.0.0.1:1/nowhere" in proc.stderr
    assert "s3cret" not in proc.stderr and "Traceback" not in proc.stderr


def test_version_and_help():
    proc = subprocess.run(
        [sys.executable, "-m", "tltd", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "0.1.0" in proc.stdout
