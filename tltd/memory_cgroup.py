"""Rollout workers in memory cgroups: a memory limit per worker process
(`worker_memory_limit_mb`), and an OOM kill told apart from other deaths.

The daemon makes `tltd-<pid>` under its own memory cgroup and, in it, one group per worker
process (its engine's subprocesses inherit it), with the limit. A worker that outgrows it is
killed by the kernel's OOM killer, as a process of a container with a memory limit is; the
group's `oom_kill` count (cgroup v1 `memory.oom_control`, cgroup v2 `memory.events`) says that
this is what ended it. Both cgroup versions work; under cgroup v2 the daemon's cgroup must be
able to enable the memory controller for its children (delegated to the daemon: systemd's
`Delegate=yes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from tltd.errors import ConfigError

log = logging.getLogger(__name__)

_NAME = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class WorkerGroup:
    """One worker process's memory cgroup."""

    path: Path
    version: int  # 1 or 2
    limit_bytes: int

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in this group so far (0 if unreadable)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            text = (self.path / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def limit(self) -> int:
        """Its memory limit in bytes, as the kernel has it now (an operator may change it)."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):  # gone, or "max"
            return self.limit_bytes

    def remove(self) -> bool:
        """Remove the group once its processes are gone; False while some remain."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


class MemoryCgroups:
    """The daemon's `tltd-<pid>` memory cgroup and its workers' groups."""

    def __init__(self, root: Path, version: int, limit_bytes: int) -> None:
        self.root, self.version, self.limit_bytes = root, version, limit_bytes

    @classmethod
    def create(cls, limit_mb: int, proc: str = "/proc") -> MemoryCgroups:
        """Make the daemon's group under its own memory cgroup; ConfigError saying why when
        memory cgroups cannot be used here (the limit was asked for: not silently dropped)."""
        try:
            version, own = memory_cgroup_of("self", proc)
        except ConfigError as exc:
            raise ConfigError(f"worker_memory_limit_mb: {exc}") from exc
        root = own / f"tltd-{os.getpid()}"
        try:
            if version == 2:
                _enable_memory_controller(own)
            root.mkdir(exist_ok=True)
            if version == 2:
                _enable_memory_controller(root)
        except OSError as exc:
            raise ConfigError(
                f"worker_memory_limit_mb: cannot create a memory cgroup under {own}: {exc}"
            ) from exc
        log.info(
            "rollout workers run in memory cgroups",
            extra={"cgroup": str(root), "cgroup_version": version, "limit_mb": limit_mb},
        )
        return cls(root, version, limit_mb << 20)

    def place(self, name: str, pid: int) -> WorkerGroup:
        """A fresh group with the limit for `name` (a worker id), holding `pid`."""
        path = self.root / _NAME.sub("_", name)
        group = WorkerGroup(path, self.version, self.limit_bytes)
        if path.exists() and not group.remove():  # a previous process of it still exiting
            path = self.root / f"{path.name}-{time.monotonic_ns()}"
            group = WorkerGroup(path, self.version, self.limit_bytes)
        path.mkdir()
        if self.version == 1:
            # Charges made before the move (the interpreter's start) move with the process
            # (a kernel without this knob keeps them where they were made).
            with contextlib.suppress(OSError):
                (path / "memory.move_charge_at_immigrate").write_text("3")
            (path / "memory.limit_in_bytes").write_text(str(self.limit_bytes))
        else:
            (path / "memory.max").write_text(str(self.limit_bytes))
            with contextlib.suppress(OSError):  # no swapping around the limit either
                (path / "memory.swap.max").write_text("0")
        (path / "cgroup.procs").write_text(str(pid))
        return group

    def close(self) -> None:
        """Remove the workers' groups (those whose processes are gone) and the daemon's."""
        try:
            children = [p for p in self.root.iterdir() if p.is_dir()]
        except OSError:
            return
        for child in children:
            WorkerGroup(child, self.version, 0).remove()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def memory_cgroup_of(pid: int | str = "self", proc: str = "/proc") -> tuple[int, Path]:
    """(cgroup version, directory of the memory cgroup of process `pid`); ConfigError if it
    has none (as seen from this process's mounts)."""
    try:
        mountinfo = Path(proc, "self/mountinfo").read_text().splitlines()
        membership = Path(proc, str(pid), "cgroup").read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the cgroups of process {pid}: {exc}") from exc
    v1 = v2 = None
    for line in mountinfo:
        fields, _, after = line.partition(" - ")
        parts, rest = fields.split(), after.split()
        if len(parts) < 5 or len(rest) < 3:
            continue
        if rest[0] == "cgroup" and "memory" in rest[2].split(","):
            v1 = (parts[3], Path(parts[4]))
        elif rest[0] == "cgroup2" and v2 is None:
            v2 = (parts[3], Path(parts[4]))
    for line in membership:
        hid, controllers, path = line.split(":", 2)
        if v1 is not None and "memory" in controllers.split(","):
            return 1, _under(v1, path)
        if v1 is None and v2 is not None and hid == "0":
            own = _under(v2, path)
            if "memory" in _read(own / "cgroup.controllers").split():
                return 2, own
    raise ConfigError(
        f"no memory cgroup controller for process {pid} (a cgroup v1 memory hierarchy, or "
        "cgroup v2 with the memory controller)"
    )


def _under(mount: tuple[str, Path], path: str) -> Path:
    """The directory of cgroup `path` in a hierarchy mounted from `mount[0]` at `mount[1]`."""
    root, point = mount
    rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
    return point if rel in (".", "") else point / rel


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _enable_memory_controller(group: Path) -> None:
    """cgroup v2: let `group`'s children have memory limits."""
    if "memory" not in _read(group / "cgroup.subtree_control").split():
        (group / "cgroup.subtree_control").write_text("+memory")
