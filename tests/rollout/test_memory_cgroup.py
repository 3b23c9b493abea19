"""Finding a process's memory cgroup from /proc (cgroup v1 and v2 layouts, as the kernel
writes them), and reading a group's OOM-kill count in either version's format. The real
cgroup filesystem is exercised by tests/reliability/test_fault_worker_oom.py (v1 there);
these cover the layouts that machine does not have."""

from __future__ import annotations

from pathlib import Path

import pytest

from tltd.errors import ConfigError
from tltd.memory_cgroup import WorkerGroup, memory_cgroup_of


def _proc(tmp_path: Path, mountinfo: str, cgroup: str) -> str:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    (proc / "42").mkdir()
    (proc / "42" / "cgroup").write_text(cgroup)
    return str(proc)


def test_cgroup_v1_memory_hierarchy(tmp_path):
    mnt = tmp_path / "memory"
    proc = _proc(
        tmp_path,
        f"32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        f"35 31 0:32 / {mnt} rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
        "5:devices:/\n4:memory:/process_api/abc\n0::/\n",
    )
    assert memory_cgroup_of(42, proc) == (1, mnt / "process_api" / "abc")


def test_cgroup_v1_mounted_from_a_subtree(tmp_path):
    """In a container the hierarchy is often mounted from the container's own group."""
    mnt = tmp_path / "memory"
    proc = _proc(
        tmp_path,
        f"35 31 0:32 /docker/c1 {mnt} rw - cgroup cgroup rw,memory\n",
        "4:memory:/docker/c1/tltd\n",
    )
    assert memory_cgroup_of(42, proc) == (1, mnt / "tltd")


def test_cgroup_v2_with_the_memory_controller(tmp_path):
    mnt = tmp_path / "cgroup"
    own = mnt / "system.slice" / "tltd.service"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    proc = _proc(
        tmp_path,
        f"30 23 0:26 / {mnt} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "0::/system.slice/tltd.service\n",
    )
    assert memory_cgroup_of(42, proc) == (2, own)


def test_no_memory_controller_is_refused_with_the_reason(tmp_path):
    mnt = tmp_path / "cgroup"
    (mnt / "a").mkdir(parents=True)
    (mnt / "a" / "cgroup.controllers").write_text("cpu pids\n")
    proc = _proc(tmp_path, f"30 23 0:26 / {mnt} rw - cgroup2 cgroup2 rw\n", "0::/a\n")
    with pytest.raises(ConfigError, match="no memory cgroup controller"):
        memory_cgroup_of(42, proc)


@pytest.mark.parametrize(
    "version, name, text",
    [
        (1, "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"),
        (2, "memory.events", "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n"),
    ],
)
def test_oom_kills_are_read_in_either_format(tmp_path, version, name, text):
    group = WorkerGroup(tmp_path, version, 1 << 20)
    assert group.oom_kills() == 0  # not there (yet): none
    (tmp_path / name).write_text(text)
    assert group.oom_kills() == 2
