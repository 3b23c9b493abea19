"""A rollout worker killed by the kernel's OOM killer: its requests run again, each request id
completes exactly once.

The daemon (`tltd serve`, one CPU rollout worker) runs with `worker_memory_limit_mb`: the
worker process is in a memory cgroup of its own. Once the worker has warmed up, the test
lowers that group's limit to what the worker uses plus a margin, the way an operator would
give it less memory, and sends real work that needs more: a prompt batch whose prefill
(4 prompts of 2,000 tokens: attention over the whole prompt) takes about 190 MiB more than
a warm worker holds. Nothing is faked: the kernel kills the process for exceeding its limit
(confirmed by the kernel log, and by the group's `oom_kill` count, which the daemon reads to
name the cause). The supervisor starts a fresh worker, in a fresh group with the configured
limit, and the lost samples run again there.

Skipped where memory cgroups cannot be written (not root, no memory controller); under CI that
fails instead. The groups
are removed afterwards.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import threading
import time
from pathlib import Path

from tests.ci import skip_unless_ci
from tests.reliability.trainers import Trainer, account
from tests.rollout.support import ServeProcess
from tltd.errors import ConfigError
from tltd.memory_cgroup import MemoryCgroups, memory_cgroup_of
from tltd.v1 import rollout_pb2
from tltd_clients.client import TltClient

CONFIGURED_MB = 2048  # the daemon's worker_memory_limit_mb: ample for the test's model
MARGIN = 32 << 20  # over the warm worker's usage: its light requests fit, the heavy one not
HEAVY_PROMPTS, HEAVY_TOKENS = 4, 2000  # the model's context is 2,048 positions


def _cgroups_writable() -> str | None:
    """Why memory cgroups cannot be used here, or None."""
    try:
        MemoryCgroups.create(64).close()
    except ConfigError as exc:
        return str(exc)
    return None


def _usage(group: Path, version: int) -> int:
    name = "memory.usage_in_bytes" if version == 1 else "memory.current"
    return int((group / name).read_text())


def _set_limit(group: Path, version: int, limit: int) -> None:
    (group / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(limit))


def _limit(group: Path, version: int) -> int:
    return int((group / ("memory.limit_in_bytes" if version == 1 else "memory.max")).read_text())


def _kernel_log() -> str:
    if shutil.which("dmesg") is None:
        return ""
    done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30)
    return done.stdout if done.returncode == 0 else ""


def _worker(c: TltClient):
    [w] = [w for w in c.list_workers() if w.kind == "rollout"]
    return w


def _remove_groups(daemon_pid: int) -> None:
    """The daemon was killed (no shutdown of its own): remove its workers' groups and its
    own once their processes are gone."""
    try:
        _, own = memory_cgroup_of("self")
    except ConfigError:
        return
    root = own / f"tltd-{daemon_pid}"
    if not root.exists():
        return
    deadline = time.monotonic() + 30
    for child in [p for p in root.iterdir() if p.is_dir()]:
        while time.monotonic() < deadline:
            pids = (child / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:  # a worker outliving its daemon (it exits on the pipe's EOF)
                subprocess.run(["kill", "-9", pid], check=False)
            time.sleep(0.2)
        child.rmdir()
    root.rmdir()


def test_a_worker_killed_by_the_oom_killer_has_its_requests_run_again(tmp_path, ckpt, figures):
    why = _cgroups_writable()
    if why:
        skip_unless_ci(f"memory cgroups not writable here: {why}")
    d = ServeProcess(
        tmp_path, f"sqlite:///{tmp_path / 'tltd.db'}", cpu_slots=1, start_timeout=180,
        worker_max_batch=8, worker_max_seq_len=2100, drafter_training="false",
        worker_memory_limit_mb=str(CONFIGURED_MB),
    )  # fmt: skip
    try:
        with TltClient(d.target, timeout=120) as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready("job", n=1, timeout=180)
            first = _worker(c)
        version, group = memory_cgroup_of(first.pid)
        # The daemon put the worker in a group of its own, with the configured limit.
        assert group.name == "rollout-cpu_0" and group.parent.name == f"tltd-{d.proc.pid}"
        assert _limit(group, version) == CONFIGURED_MB << 20

        trainer = Trainer(d.target, "job", inflight=2, prompts=2, n=4, max_new_tokens=16)
        with TltClient(d.target, timeout=120) as c:  # warm: a request through the engine
            trainer.run_one(c, random.Random(0))
        warm = _usage(group, version)
        _set_limit(group, version, warm + MARGIN)
        trainer.start()
        rng = random.Random(1)
        heavy = [[rng.randrange(1, 48) for _ in range(HEAVY_TOKENS)] for _ in range(HEAVY_PROMPTS)]
        sampling = rollout_pb2.SamplingParams(n=1, max_new_tokens=4, temperature=1.0, seed=7)
        ended: list = []
        with TltClient(d.target, timeout=120) as c:
            sent = threading.Thread(
                target=lambda: ended.append(trainer.send(c, heavy, sampling)), daemon=True
            )
            sent.start()
            sent.join(600)
        assert ended, "the heavy request did not end"
        time.sleep(2.0)  # light requests go on through the restart
        trainer.stop(timeout=300)
        with TltClient(d.target, timeout=120) as c:
            accounting = account(c, trainer)
            after = _worker(c)
        new_version, new_group = memory_cgroup_of(after.pid)
        new_limit = _limit(new_group, new_version)
    finally:
        d.kill()
        _remove_groups(d.proc.pid)

    gone = [r for r in d.logs() if r.get("msg") == "rollout worker gone"]
    kernel = _kernel_log()  # "" where it cannot be read (then the daemon's word stands)
    oom_lines = [line for line in kernel.splitlines() if f"Killed process {first.pid} (" in line]
    figures.update(
        warm_usage_mib=round(warm / 2**20, 1),
        limit_mib=round((warm + MARGIN) / 2**20, 1),
        worker_exits=[(r.get("cause"), r.get("reason")) for r in gone],
        kernel_log=oom_lines,
        **accounting.figures(),
    )
    # The kernel's OOM killer ended the first worker, and the daemon says so.
    assert [r.get("cause") for r in gone] == ["oom_kill"], gone
    assert gone[0]["reason"].startswith("killed by the OOM killer: over its memory limit of ")
    if kernel:
        assert oom_lines, f"no OOM kill of pid {first.pid} in the kernel log"
    # A fresh worker, in a fresh group with the configured limit, ran the lost samples.
    assert after.pid != first.pid and after.state in ("ready", "busy")
    assert new_limit == CONFIGURED_MB << 20
    # Every request id completed, each sample exactly once, the heavy one included.
    [heavy_out] = ended
    assert heavy_out.expected == HEAVY_PROMPTS and len(heavy_out.samples) == HEAVY_PROMPTS
    assert not accounting.incomplete, accounting.figures()
    accounting.check_nothing_lost()
