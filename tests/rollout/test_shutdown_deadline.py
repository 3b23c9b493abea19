"""The shutdown has one deadline, the end of shutdown_grace_seconds: a worker that does not
answer, a node drain with a longer grace, a drafter trainer still loading do not extend it."""

from __future__ import annotations

import os
import signal
import threading
import time

from tests.api.support import make_settings, sampling
from tests.rollout.support import InProcessDaemon, ServeProcess, wait_until
from tests.rollout.test_lifecycle import RUNNING, _status
from tests.rollout.test_rollouts import PROMPTS, Stream
from tltd.domain import RequestStatus, WorkerState
from tltd.store import Store

GRACE = 2.0
# What a shutdown may take beyond the grace (killing what is left, recording it, exiting) on a
# loaded machine. Each test's slow part takes 30 s or more, so a shutdown that waited for it
# would miss this bound by far more than the machine's noise.
SLACK = 10.0
SLOW = 30.0
LONG = dict(n=16, temperature=0.0, max_new_tokens=1000)


def test_sigterm_with_a_hung_worker_ends_at_the_grace(migrated_sqlite_url, tmp_path, ckpt):
    d = ServeProcess(
        tmp_path, migrated_sqlite_url, shutdown_grace_seconds=GRACE, drafter_training="false"
    )
    workers = []
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            workers = d.wait_workers_ready("job")
            stream = Stream(c, "job", PROMPTS * 2, sampling=sampling(**LONG), request_id="big")
            wait_until(lambda: _status(c, "big") == RUNNING, what="running")
            time.sleep(0.3)
            os.kill(workers[0].pid, signal.SIGSTOP)  # hung in a step: never answers Drain
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            # A daemon that waited for the hung worker would never end: given SLOW more.
            code = d.wait(timeout=GRACE + SLACK + SLOW)
            took = time.monotonic() - t0
            stream.result(10)
    finally:
        for w in workers:
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        d.kill()
    assert code == 0 and took < GRACE + SLACK, took
    assert "drained" in str(stream.error)
    store = Store(migrated_sqlite_url)
    try:
        assert store.requests.get("big").status is RequestStatus.FAILED
        assert all(w.state is WorkerState.STOPPED for w in store.workers.list())
    finally:
        store.close()


def test_sigterm_during_a_long_node_drain_keeps_the_shutdown_grace(
    migrated_sqlite_url, tmp_path, ckpt
):
    d = ServeProcess(tmp_path, migrated_sqlite_url, shutdown_grace_seconds=GRACE,
                     drain_grace_seconds=3 * SLOW, drafter_training="false")  # fmt: skip
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready("job")
            stream = Stream(c, "job", PROMPTS * 4, sampling=sampling(**LONG), request_id="big")
            wait_until(lambda: _status(c, "big") == RUNNING, what="running")
            c.drain(node=True)  # 90 s of drain grace
            time.sleep(0.5)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            code = d.wait(timeout=GRACE + SLACK + SLOW)
            took = time.monotonic() - t0
            stream.result(10)
    finally:
        d.kill()
    assert code == 0 and took < GRACE + SLACK, took
    assert "node drained" in str(stream.error)


def test_shutdown_does_not_wait_for_a_trainer_still_loading(
    sqlite_store, tmp_path, ckpt, monkeypatch
):
    import tltd.drafter_training.process as dw
    from tltd.contract.drafter_messages import TrainerReady

    real_wait_for = dw.TrainerProcess.wait_for
    loaded = threading.Event()  # set when the test ends: no thread outlives it

    def slow_ready(self, kind, timeout=60.0):  # a big target loading onto a GPU
        if kind is TrainerReady:
            loaded.wait(SLOW)
        return real_wait_for(self, kind, timeout)

    monkeypatch.setattr(dw.TrainerProcess, "wait_for", slow_ready)
    settings = make_settings(tmp_path, cpu_slots=2, worker_max_batch=8, worker_max_seq_len=1024,
                             worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
                             shutdown_grace_seconds=GRACE)  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        d.call(d.daemon.training.start("cpu:1", "job"))
        time.sleep(0.5)
        t0 = time.monotonic()
        d.call(d.daemon.shutdown(), timeout=GRACE + SLACK + SLOW)
        took = time.monotonic() - t0
        d.daemon = None
    finally:
        loaded.set()
        d.kill()
    assert took < GRACE + SLACK, took
    trainer = sqlite_store.workers.get("drafter-job")
    assert trainer.state is WorkerState.STOPPED and "killed while starting" in trainer.state_reason


def _drain_settings(tmp_path):
    return make_settings(tmp_path, cpu_slots=2, worker_max_batch=8, worker_max_seq_len=1024,
                         worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
                         shutdown_grace_seconds=GRACE, drafter_training=False)  # fmt: skip


def test_a_request_that_cannot_be_closed_does_not_keep_the_drain_from_the_others(
    sqlite_store, tmp_path, ckpt, monkeypatch
):
    from tltd.supervisor.live_requests import LiveRequests

    real = LiveRequests.finish_unstarted

    async def failing_for_a(self, live, keys, reason, error):
        if live.request_id == "a" and error.startswith("drained"):
            raise RuntimeError("store down")
        return await real(self, live, keys, reason, error)

    monkeypatch.setattr(LiveRequests, "finish_unstarted", failing_for_a)
    d = InProcessDaemon(_drain_settings(tmp_path), sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            streams = {
                rid: Stream(c, "job", PROMPTS * 2, sampling=sampling(**LONG), request_id=rid)
                for rid in ("a", "b")
            }
            # Generous: on a loaded machine the workers' start-up cost timing alone can take
            # a good part of 30 s before any sample runs.
            wait_until(lambda: _status(c, "b") == RUNNING, timeout=120, what="running")
            d.call(d.daemon.shutdown(), timeout=GRACE + 60)
            d.daemon = None
            streams["b"].result(30)
    finally:
        d.kill()
    assert "drained" in str(streams["b"].error)  # closed by the drain, not cut by the stop
    assert sqlite_store.requests.get("b").status is RequestStatus.FAILED


def test_a_failing_drain_still_stops_the_workers(sqlite_store, tmp_path, ckpt, monkeypatch):
    from tltd.supervisor.drain import NodeDrain

    async def broken_drain(self):
        raise RuntimeError("drain bug")

    monkeypatch.setattr(NodeDrain, "_run", broken_drain)
    d = InProcessDaemon(_drain_settings(tmp_path), sqlite_store).start()
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        d.call(d.daemon.shutdown(), timeout=GRACE + 60)  # must not raise, skipping the stop
        d.daemon = None
    finally:
        d.kill()
    workers = sqlite_store.workers.list()
    assert workers and all(w.state is WorkerState.STOPPED for w in workers)
