"""Periodic jobs: declared in one place with explicit triggers; bodies are plain functions."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from apscheduler.triggers.interval import IntervalTrigger

from tests.api.support import make_settings
from tltd.devices import discover
from tltd.domain import Worker, WorkerKind, WorkerState
from tltd.periodic import (
    NoticeWatch,
    build_scheduler,
    check_preemption_notice,
    our_pids,
    prune_history,
    refresh_devices,
    with_descendants,
)


def test_refresh_devices_body(store):
    devices = refresh_devices(store, None, cpu_slots=3)
    assert [d.device_id for d in devices] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.device_id for d in store.devices.list()] == ["cpu:0", "cpu:1", "cpu:2"]
    store.devices.set_flags("cpu:1", cordoned=True, reason="test")
    refresh_devices(store, None, cpu_slots=3)
    assert store.devices.get("cpu:1").cordoned  # operator flags survive a refresh
    assert os.getpid() in our_pids(store)


def test_schedule_declaration(sqlite_store, tmp_path):
    settings = make_settings(tmp_path, device_refresh_seconds=7.5)
    scheduler = build_scheduler(settings, sqlite_store, None)
    jobs = {j.id: j for j in scheduler.get_jobs()}
    assert set(jobs) == {"device-refresh", "history-gc"}
    job = jobs["device-refresh"]
    assert isinstance(job.trigger, IntervalTrigger)
    assert job.trigger.interval.total_seconds() == 7.5
    assert job.func is refresh_devices
    gc = jobs["history-gc"]
    assert gc.func is prune_history and gc.args == (sqlite_store, 168.0)
    assert gc.trigger.interval.total_seconds() == 3600.0
    keep_all = make_settings(tmp_path, history_retention_hours=0)
    assert {j.id for j in build_scheduler(keep_all, sqlite_store, None).get_jobs()} == {
        "device-refresh"
    }

    async def started() -> dict[str, tuple[int, bool]]:
        scheduler.start(paused=True)  # the job defaults apply as a scheduler starts
        try:
            return {j.id: (j.max_instances, j.coalesce) for j in scheduler.get_jobs()}
        finally:
            scheduler.shutdown(wait=False)

    # One instance at a time, missed runs coalesced into one: for every job.
    assert asyncio.run(started()) == {"device-refresh": (1, True), "history-gc": (1, True)}


def test_scheduler_runs_the_refresh(sqlite_store, tmp_path):
    settings = make_settings(tmp_path, device_refresh_seconds=0.05, cpu_slots=2)

    async def main():
        scheduler = build_scheduler(settings, sqlite_store, None)
        scheduler.start()
        try:
            for _ in range(200):  # condition wait, not a timed assertion
                if sqlite_store.devices.list():
                    break
                await asyncio.sleep(0.05)
        finally:
            scheduler.shutdown(wait=True)

    asyncio.run(main())
    assert [d.device_id for d in sqlite_store.devices.list()] == ["cpu:0", "cpu:1"]


class _OneGpu:
    """NVML with one GPU used by one process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def init(self): ...
    def shutdown(self): ...
    def device_count(self):
        return 1

    def uuid(self, i):
        return "GPU-0"

    def name(self, i):
        return "H100"

    def memory(self, i):
        return (80 << 30, 40 << 30)

    def utilization(self, i):
        return 0.9

    def processes(self, i):
        return [(self.pid, 40 << 30)]


def test_a_gpu_used_by_a_child_of_our_worker_is_not_foreign(store):
    # The worker's own child holds the GPU (SGLang's scheduler subprocess does).
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
        "print(p.pid, flush=True); time.sleep(30)"
    )
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    engine_pid = int(worker.stdout.readline())
    try:
        store.workers.upsert(
            Worker(
                "rollout-cuda:0", WorkerKind.ROLLOUT, "cuda:0", "", WorkerState.READY, worker.pid
            )
        )
        assert not discover(_OneGpu(engine_pid), 0, our_pids(store))[0].foreign
        # Only descendants count: the worker's parent (this process) is not one of them.
        assert with_descendants({worker.pid}) == {worker.pid, engine_pid}
    finally:
        os.kill(engine_pid, signal.SIGKILL)
        worker.kill()
        worker.wait()


def test_a_notice_file_older_than_the_daemon_is_ignored_until_rewritten(tmp_path, caplog):
    notice = tmp_path / "preempted"
    notice.write_text("")  # left by the preemption that stopped the previous daemon
    os.utime(notice, (1_000.0, 1_000.0))
    watch = NoticeWatch(str(notice), started_at=5_000.0)
    calls = []
    with caplog.at_level("WARNING", logger="tltd.periodic"):
        for _ in range(3):
            assert not check_preemption_notice(watch, lambda: calls.append(1))
    assert calls == []
    stale = [r for r in caplog.records if "stale preemption notice" in r.getMessage()]
    assert len(stale) == 1 and stale[0].path == str(notice)  # warned once, naming the path

    os.utime(notice, (1_001.0, 1_001.0))  # rewritten (even with an old clock): a notice
    assert check_preemption_notice(watch, lambda: calls.append(1)) and calls == [1]


def test_a_stale_notice_file_removed_and_created_again_is_a_notice(tmp_path):
    notice = tmp_path / "preempted"
    watch = NoticeWatch(str(notice), started_at=5_000.0)
    calls = []
    assert not check_preemption_notice(watch, lambda: calls.append(1))  # none yet
    notice.write_text("")
    os.utime(notice, (1_000.0, 1_000.0))  # e.g. moved in with its old mtime kept
    assert check_preemption_notice(watch, lambda: calls.append(1)) and calls == [1]

    stale = NoticeWatch(str(notice), started_at=5_000.0)
    assert not check_preemption_notice(stale, lambda: calls.append(2))
    notice.unlink()
    assert not check_preemption_notice(stale, lambda: calls.append(2))
    notice.write_text("")
    os.utime(notice, (1_000.0, 1_000.0))  # the same old mtime, but a new file
    assert check_preemption_notice(stale, lambda: calls.append(2)) and calls == [1, 2]


def test_a_notice_file_written_after_the_start_is_a_notice(tmp_path):
    notice = tmp_path / "preempted"
    notice.write_text("")
    watch = NoticeWatch(str(notice), started_at=notice.stat().st_mtime - 60)
    calls = []
    assert check_preemption_notice(watch, lambda: calls.append(1)) and calls == [1]


def test_the_notice_watch_is_declared_with_the_daemons_start(sqlite_store, tmp_path):
    path = str(tmp_path / "preempted")
    settings = make_settings(tmp_path, preemption_notice_file=path)
    scheduler = build_scheduler(
        settings, sqlite_store, None, on_preemption_notice=lambda: None, started_at=123.0
    )
    job = {j.id: j for j in scheduler.get_jobs()}["preemption-notice"]
    assert job.func is check_preemption_notice
    assert job.args[0] == NoticeWatch(path, 123.0)


def test_an_unreadable_stale_notice_file_is_not_taken_for_absent(tmp_path, monkeypatch, caplog):
    notice = tmp_path / "preempted"
    notice.write_text("")
    os.utime(notice, (1_000.0, 1_000.0))
    watch = NoticeWatch(str(notice), started_at=5_000.0)
    calls = []
    assert not check_preemption_notice(watch, lambda: calls.append(1))  # stale
    real_stat = os.stat

    def flaky_stat(path, *args, **kwargs):
        if str(path) == str(notice):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    with monkeypatch.context() as m:  # e.g. an NFS mount answering EACCES/ESTALE for a while
        m.setattr(os, "stat", flaky_stat)
        with caplog.at_level("WARNING", logger="tltd.periodic"):
            for _ in range(3):
                assert not check_preemption_notice(watch, lambda: calls.append(1))
    assert sum("cannot read the preemption notice" in r.getMessage() for r in caplog.records) == 1
    # Readable again, unchanged: still the stale file, not a new notice.
    assert not check_preemption_notice(watch, lambda: calls.append(1)) and calls == []
