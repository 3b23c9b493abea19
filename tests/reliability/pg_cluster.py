"""A throwaway PostgreSQL cluster (initdb + pg_ctl in a temp dir, on a free port), so a test
can restart its database without touching the server other tests share."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _bindir() -> Path | None:
    """The server binaries of whatever PostgreSQL is installed (what `.ci/run` starts): where
    `pg_config` says, else the newest Debian-layout version directory."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and (Path(out.stdout.strip()) / "initdb").exists():
            return Path(out.stdout.strip())
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: [int(x) for x in p.parts[-3].split(".") if x.isdigit()],
    )
    return versions[-1].parent if versions else None


BIN = _bindir()


def available() -> str | None:
    """Why a cluster cannot be made here, or None."""
    if BIN is None:
        return (
            "no PostgreSQL server binaries (initdb) where pg_config --bindir says, nor under "
            "/usr/lib/postgresql/*/bin"
        )
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser (initdb refuses root)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tltd-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        assert BIN is not None, available()
        cmd = [str(BIN / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"),
                  "-w", "start")  # fmt: skip

    def stop(self) -> None:
        """A fast shutdown: every connection is terminated, the server stays down."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        """What `pg_ctlcluster ... restart` does: a fast shutdown (every connection is
        terminated, open transactions roll back), then a start."""
        # -l again: without it the new server would log to (and hold open) our stdout pipe.
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-l", str(self.dir / "log"),
                  "-w", "restart")  # fmt: skip

    def close(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
