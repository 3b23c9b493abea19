"""Worker and device lifecycle on a real daemon: job switches, vacating, store hiccups,
recovery of device states, cordoned devices."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy.exc import OperationalError

from tests.api.support import make_settings, sampling
from tests.rollout.support import InProcessDaemon, pid_alive, wait_until
from tltd.devices import cpu_devices
from tltd.domain import DeviceState, WorkerState
from tltd.supervisor.worker_process import Phase, WorkerHandle


def _settings(tmp_path, **overrides):
    values = dict(
        cpu_slots=2,
        worker_max_batch=8,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        device_refresh_seconds=3600.0,
        drafter_training=False,
    )
    return make_settings(tmp_path, **(values | overrides))


def test_a_priority_job_gets_a_worker_while_a_busy_job_still_waits(sqlite_store, tmp_path, ckpt):
    other = shutil.copytree(ckpt, tmp_path / "other")
    d = InProcessDaemon(_settings(tmp_path), sqlite_store).start()
    done: dict[str, float] = {}
    a_done_at_b: list[int] = []
    t0 = 0.0

    def run(job: str, rid: str, prompts, n: int, max_new: int) -> None:
        with d.client() as c:
            s = sampling(n=n, temperature=0.0, max_new_tokens=max_new)
            list(c.generate(job, prompts, sampling=s, request_id=rid, timeout=120))
        done[rid] = time.monotonic() - t0
        if rid == "b":  # how far A had got when B finished
            a_done_at_b.append(sqlite_store.requests.get("a").samples_done)

    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="A")
            d.wait_workers_ready(2)
            t0 = time.monotonic()
            # A keeps both workers full with much more waiting work (256 samples, several
            # waves; without fair share B waits for all of them).
            a = threading.Thread(target=run, args=("A", "a", [[1, 2, 3], [4, 5]] * 16, 8, 200))
            a.start()
            wait_until(lambda: d.supervisor.assigned_samples > 0, what="A running")
            c.create_job(str(other), job_id="B", priority=10)
            b = threading.Thread(target=run, args=("B", "b", [[4, 5]], 1, 4))
            b.start()
            b.join(120)
            a.join(120)
    finally:
        d.kill()
    # Not timed: B (one short sample) is served while A still has work waiting for a worker.
    # Without fair share B gets a worker only once A's queue is empty, i.e. with at most
    # 2 workers x 8 samples of A's 256 left running.
    assert done["b"] < done["a"], done
    assert a_done_at_b and a_done_at_b[0] < 256 - 2 * 8, a_done_at_b


def _hang_and_take_device(d: InProcessDaemon, store) -> WorkerHandle:
    """Hang cpu:0's worker (SIGSTOP: it will not answer Shutdown), then hand its device to a
    foreign process; returns the handle once the supervisor has taken it out of service."""
    handle = d.supervisor.handles["rollout-cpu:0"]
    os.kill(handle.proc.pid, signal.SIGSTOP)
    devs = cpu_devices(2)
    devs[0] = replace(devs[0], foreign=True, state_reason="foreign process: pid 1")
    store.devices.upsert(devs)
    d.loop.call_soon_threadsafe(d.supervisor.kick)
    wait_until(lambda: not handle.alive, timeout=20, what="vacating")
    return handle


def _assert_stopped_before_restart(store, worker_id: str) -> None:
    """The old process was recorded stopped (its samples re-queued) before the new one
    started; store writes are asynchronous (in order), so wait for the new one's record."""

    def states() -> list[str]:
        return [e.new_status for e in store.history.list_events("worker", worker_id)]

    wait_until(lambda: states().count("starting") == 2, timeout=30, what="restart recorded")
    got = states()
    stopped = got.index("stopping")
    assert got[stopped : stopped + 3] == ["stopping", "stopped", "starting"], got


def test_vacating_a_hung_worker_kills_its_process(sqlite_store, tmp_path, ckpt):
    d = InProcessDaemon(_settings(tmp_path), sqlite_store).start()
    pid = 0
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        handle = _hang_and_take_device(d, sqlite_store)
        pid = handle.proc.pid
        wait_until(lambda: not pid_alive(pid), timeout=15, what="hung worker killed")
    finally:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        d.kill()


def test_vacating_a_hung_worker_does_not_stall_scheduling(
    sqlite_store, tmp_path, ckpt, monkeypatch
):
    # The hung worker gets far longer to exit than the requests below take: the order of
    # events is then the same on any machine.
    monkeypatch.setattr("tltd.supervisor.rollout_workers.EXIT_SECONDS", 120.0)
    d = InProcessDaemon(_settings(tmp_path), sqlite_store).start()
    pid = 0
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            handle = _hang_and_take_device(d, sqlite_store)
            pid = handle.proc.pid
            s = sampling(n=2, max_new_tokens=8)
            # The other device is served while the vacated worker still waits to exit.
            out = list(c.generate("job", [[1, 2, 3]], sampling=s, request_id="r1", timeout=60))
            assert len(out) == 2
            assert pid_alive(pid) and handle.phase is Phase.EXITING
            assert sqlite_store.workers.get("rollout-cpu:0").state is WorkerState.STOPPING
            # The device is free again, but its old process still lives: no second worker.
            sqlite_store.devices.upsert(cpu_devices(2))
            out = list(c.generate("job", [[4, 5]], sampling=s, request_id="r2", timeout=60))
            assert len(out) == 2
            assert handle.phase is Phase.EXITING and handle.proc.pid == pid and pid_alive(pid)
            os.kill(pid, signal.SIGKILL)  # gone: the vacate ends, and a new worker starts
            wait_until(lambda: handle.alive and handle.proc.pid != pid, timeout=30, what="restart")

        _assert_stopped_before_restart(sqlite_store, "rollout-cpu:0")
    finally:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        d.kill()


def test_a_backend_switch_waits_for_the_old_process_beside_the_tick(
    sqlite_store, tmp_path, ckpt, monkeypatch
):
    """Switching a worker to another backend stops its process; a hung one is waited for
    (then killed) outside the tick, so the other device keeps being served meanwhile."""
    import asyncio

    from tltd.domain import Backend

    monkeypatch.setattr("tltd.supervisor.rollout_workers.SWITCH_EXIT_SECONDS", 120.0)
    d = InProcessDaemon(_settings(tmp_path), sqlite_store).start()
    pid = 0
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            handle = d.supervisor.handles["rollout-cpu:0"]
            pid = handle.proc.pid
            os.kill(pid, signal.SIGSTOP)  # it will not answer Shutdown
            switch = d.supervisor.workers.switch_backend(handle, Backend.SGLANG)
            # Returns at once: the old process is joined beside the tick, not in it.
            asyncio.run_coroutine_threadsafe(switch, d.loop).result(timeout=10)
            assert pid_alive(pid) and handle.phase is Phase.EXITING
            s = sampling(n=2, max_new_tokens=8)
            out = list(c.generate("job", [[1, 2, 3]], sampling=s, request_id="r1", timeout=60))
            assert len(out) == 2 and handle.proc.pid == pid and pid_alive(pid)
            os.kill(pid, signal.SIGKILL)  # gone: the switch ends, a worker starts on sglang
            wait_until(lambda: handle.proc.pid != pid, timeout=30, what="restart")
            assert handle.backend is Backend.SGLANG

        _assert_stopped_before_restart(sqlite_store, "rollout-cpu:0")
    finally:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        d.kill()


def test_a_store_error_on_a_heartbeat_does_not_stop_reading_the_worker(
    sqlite_store, tmp_path, ckpt
):
    settings = _settings(tmp_path, cpu_slots=1, worker_heartbeat_timeout_seconds=30.0)
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(1)
            real, calls = sqlite_store.workers.heartbeat, []

            def flaky(worker_id):
                calls.append(worker_id)
                if len(calls) == 1:
                    raise OperationalError("UPDATE workers", {}, Exception("database is locked"))
                return real(worker_id)

            sqlite_store.workers.heartbeat = flaky
            wait_until(lambda: calls, timeout=10, what="heartbeat write")
            s = sampling(n=2, max_new_tokens=8)
            out = list(c.generate("job", [[1, 2, 3]], sampling=s, request_id="r", timeout=20))
            assert len(out) == 2
            assert any(t.name == "rollout-cpu:0-rx" for t in threading.enumerate())
    finally:
        d.kill()


def test_a_device_left_training_by_a_crashed_daemon_is_idle_again(sqlite_store, tmp_path):
    sqlite_store.devices.upsert(cpu_devices(2))
    sqlite_store.devices.set_state("cpu:0", DeviceState.TRAINING, "previous daemon (crashed)")
    d = InProcessDaemon(_settings(tmp_path), sqlite_store).start()
    try:
        assert sqlite_store.devices.get("cpu:0").state is DeviceState.IDLE
    finally:
        d.kill()


def test_a_cordoned_device_is_idle_once_its_work_ends(sqlite_store, tmp_path, ckpt):
    d = InProcessDaemon(_settings(tmp_path, cpu_slots=1), sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(1)
            s = sampling(n=4, max_new_tokens=64)
            stream = c.generate("job", [[5, 6, 7]], sampling=s, request_id="r", timeout=60)
            first = next(iter(stream))  # running on cpu:0 now
            sqlite_store.devices.set_flags("cpu:0", cordoned=True, reason="test")
            rest = list(stream)
            assert 1 + len(rest) == 4 and first.token_ids
            wait_until(
                lambda: sqlite_store.devices.get("cpu:0").state is DeviceState.IDLE,
                timeout=10,
                what="cordoned device recorded idle",
            )
    finally:
        d.kill()


def test_a_store_error_on_the_final_status_is_retried_before_the_stream_ends(
    sqlite_store, tmp_path, ckpt
):
    """The write that marks a request COMPLETED fails twice ("database is locked"): it is
    retried until it lands, and the stream ends only then, on the stored status. Other writes
    go on meanwhile (a second request completes)."""
    from tltd.domain import RequestStatus

    d = InProcessDaemon(_settings(tmp_path, cpu_slots=1), sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(1)
            # The unit's record is the write that ends the request (its last unit). A sample's
            # own transaction records it when it can (`sample_batches.store`): not here, so that the
            # node's write is the one that fails.
            sqlite_store.leases.end_unit_if_complete = lambda *args: None
            real, failures = sqlite_store.leases.finish_unit, []

            def flaky(request_id, *args, **kwargs):
                if request_id == "r" and len(failures) < 2:
                    failures.append(request_id)
                    raise OperationalError("UPDATE work_units", {}, Exception("locked"))
                return real(request_id, *args, **kwargs)

            sqlite_store.leases.finish_unit = flaky
            s = sampling(n=2, max_new_tokens=8)
            out = list(c.generate("job", [[1, 2, 3]], sampling=s, request_id="r", timeout=30))
            assert len(out) == 2 and len(failures) == 2
            assert sqlite_store.requests.get("r").status is RequestStatus.COMPLETED
            assert d.supervisor.queue.get("r") is None
            out = list(c.generate("job", [[4, 5]], sampling=s, request_id="r2", timeout=30))
            assert len(out) == 2
            assert sqlite_store.requests.get("r2").status is RequestStatus.COMPLETED
    finally:
        d.kill()


def test_a_load_that_kills_the_worker_fails_its_requests_and_is_held_back(
    sqlite_store, tmp_path, ckpt, monkeypatch
):
    """A load that ends the process (OOM kill, native crash) is a load failure: its version is
    held back and its requests fail saying so, and the restart backoff keeps growing (the
    fresh process's first Ready, before any load, must not reset it: else a crash loop for
    ever)."""
    from tests.rollout import crashing_worker
    from tests.rollout.test_rollouts import Stream
    from tltd.domain import FinishReason, RequestStatus
    from tltd_clients.errors import FailedPreconditionError

    monkeypatch.setattr(
        "tltd.worker_code.rollout_entry", lambda backend: (crashing_worker.main, True)
    )
    d = InProcessDaemon(_settings(tmp_path, cpu_slots=1), sqlite_store).start()
    sup = d.supervisor
    pid = 0
    try:
        handle = sup.handles["rollout-cpu:0"]
        wait_until(lambda: handle.phase is Phase.READY, what="worker up (no model)")
        pid = handle.proc.pid
        os.kill(pid, signal.SIGSTOP)  # the LoadModel waits in its pipe while r1 goes live
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            wait_until(lambda: handle.policy_load == "job", what="LoadModel sent")
            stream = Stream(c, "job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=4),
                            request_id="r1", timeout=60)  # fmt: skip
            wait_until(lambda: sup.queue.get("r1") is not None, what="r1 live")
            os.kill(pid, signal.SIGCONT)  # it loads: os._exit(137)
            got = stream.result(60)
            died = "cannot load policy version 0 of job job: the worker process died while"
            assert len(got) == 2 and all(s.error.startswith(died) for s in got), got
            req = sqlite_store.requests.get("r1")
            assert req.status is RequestStatus.FAILED and "exit code 137" in req.status_reason
            assert {s.finish_reason for s in sqlite_store.samples.list("r1")} == {
                FinishReason.FAILED
            }
            assert ("job", 0) in sup.models.bad_versions
            # The fresh process is up (Ready, nothing loaded: the version is held back), and
            # its Ready did not forgive the crash.
            wait_until(lambda: handle.generation == 2 and handle.answered, what="restarted")
            assert handle.failures == 1 and not handle.job_id and handle.policy_load == ""
            with pytest.raises(FailedPreconditionError, match="its last load failed"):
                list(c.generate("job", [[1, 2, 3]], sampling=sampling(max_new_tokens=4),
                                timeout=20))  # fmt: skip
    finally:
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        d.kill()
