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
from tltd.periodic import build_scheduler, our_pids, refresh_devices, with_descendants


def test_refresh_devices_body(store):
    devices = refresh_devices(store, None, cpu_slots=3)
    assert [d.device_id for d in devices] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.device_id for d in store.list_devices()] == ["cpu:0", "cpu:1", "cpu:2"]
    store.set_device_flags("cpu:1", cordoned=True, reason="test")
    refresh_devices(store, None, cpu_slots=3)
    assert store.get_device("cpu:1").cordoned  # operator flags survive a refresh
    assert os.getpid() in our_pids(store)


def test_schedule_declaration(sqlite_store, tmp_path):
    settings = make_settings(tmp_path, device_refresh_seconds=7.5)
    scheduler = build_scheduler(settings, sqlite_store, None)
    jobs = {j.id: j for j in scheduler.get_jobs()}
    assert set(jobs) == {"device-refresh"}
    job = jobs["device-refresh"]
    assert isinstance(job.trigger, IntervalTrigger)
    assert job.trigger.interval.total_seconds() == 7.5
    assert job.max_instances == 1 and job.coalesce is True
    assert job.func is refresh_devices


def test_scheduler_runs_the_refresh(sqlite_store, tmp_path):
    settings = make_settings(tmp_path, device_refresh_seconds=0.05, cpu_slots=2)

    async def main():
        scheduler = build_scheduler(settings, sqlite_store, None)
        scheduler.start()
        try:
            for _ in range(200):  # condition wait, not a timed assertion
                if sqlite_store.list_devices():
                    break
                await asyncio.sleep(0.05)
        finally:
            scheduler.shutdown(wait=True)

    asyncio.run(main())
    assert [d.device_id for d in sqlite_store.list_devices()] == ["cpu:0", "cpu:1"]


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
        store.upsert_worker(
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
