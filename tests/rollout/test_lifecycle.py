"""A real `tltd serve` process: kill -9 mid-batch then restart, SIGTERM drain."""

from __future__ import annotations

import shutil
import signal
import time

import pytest

from tests.api.support import sampling
from tests.rollout.support import ServeProcess, direct_outputs, pid_alive, wait_until
from tests.rollout.test_rollouts import PROMPTS, Stream, _by_key
from tltd.domain import FinishReason, RequestStatus, SamplingParams, WorkerState
from tltd.store import Store
from tltd.v1 import common_pb2, rollout_pb2
from tltd_clients.errors import FailedPreconditionError, NotFoundError, UnavailableError

LONG = dict(n=4, temperature=0.0, max_new_tokens=800)
RUNNING = rollout_pb2.REQUEST_STATUS_RUNNING


def _status(c, request_id: str) -> int | None:
    try:
        return c.get_request(request_id).request.status
    except NotFoundError:
        return None  # not stored yet


@pytest.mark.slow
def test_daemon_kill9_mid_batch_then_restart(db_url, tmp_path, ckpt):
    """Every accepted request either completes after the restart or fails with a reason."""
    other = shutil.copytree(ckpt, tmp_path / "other-model")
    a = ServeProcess(tmp_path, db_url, "a")
    try:
        with a.client() as c:
            c.create_job(str(ckpt), job_id="job")  # the only job: both workers load it
            pids = [w.pid for w in a.wait_workers_ready("job")]
            # Created once both hold "job" (a worker keeps its job while no work waits): a
            # worker ready between two creations would have taken "other" for good.
            c.create_job(str(other), job_id="other")
            s1 = Stream(c, "job", PROMPTS[:4], sampling=sampling(**LONG), request_id="r1")
            s2 = Stream(c, "job", PROMPTS[4:], sampling=sampling(**LONG), request_id="r2")
            wait_until(lambda: _status(c, "r1") == RUNNING, what="r1 running")
            # Waits until a worker is free of job's work: still queued at the crash.
            s3 = Stream(
                c, "other", PROMPTS[:1], sampling=sampling(n=2, max_new_tokens=4), request_id="r3"
            )
            wait_until(lambda: _status(c, "r3") is not None, what="r3 stored")
            a.proc.send_signal(signal.SIGKILL)
            a.wait()
            for s in (s1, s2, s3):
                s.result(30)
                assert isinstance(s.error, UnavailableError), s.error  # connection lost
        # The workers notice their daemon is gone and exit (no orphans holding devices).
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=20, what="workers exit")
    finally:
        a.kill()

    shutil.move(other, tmp_path / "other-model-gone")  # r3's model can no longer be loaded
    b = ServeProcess(tmp_path, db_url, "b")
    try:
        with b.client() as c:
            # The trainer retries with the same ids: it gets every sample, generated once.
            r1 = list(c.generate("job", PROMPTS[:4], sampling=sampling(**LONG), request_id="r1"))
            r2 = list(c.generate("job", PROMPTS[4:], sampling=sampling(**LONG), request_id="r2"))
            with pytest.raises(FailedPreconditionError, match="cannot load policy version 0"):
                list(
                    c.generate(
                        "other",
                        PROMPTS[:1],
                        sampling=sampling(n=2, max_new_tokens=4),
                        request_id="r3",
                    )
                )
            statuses = {r: c.get_request(r).request for r in ("r1", "r2", "r3")}
        b.proc.send_signal(signal.SIGTERM)
        assert b.wait() == 0
    finally:
        b.kill()
    assert _by_key(r1) == direct_outputs(ckpt, PROMPTS[:4], SamplingParams(**LONG))
    assert _by_key(r2) == direct_outputs(ckpt, PROMPTS[4:], SamplingParams(**LONG))
    assert statuses["r1"].status == statuses["r2"].status == rollout_pb2.REQUEST_STATUS_COMPLETED
    assert statuses["r3"].status == rollout_pb2.REQUEST_STATUS_FAILED
    assert "cannot load" in statuses["r3"].status_reason
    store = Store(db_url)
    try:
        events = store.history.list_events("request", "r1")
        assert any("daemon restarted" in e.reason for e in events)
        workers = store.workers.list()
        assert all(w.state is WorkerState.STOPPED for w in workers)
    finally:
        store.close()


@pytest.mark.slow
def test_sigterm_drains_within_the_grace_and_exits_0(migrated_sqlite_url, tmp_path, ckpt):
    grace = 2.0
    d = ServeProcess(tmp_path, migrated_sqlite_url, shutdown_grace_seconds=grace)
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready("job")
            # Far more work than the grace: 20 prompts x 16 samples x 1000 tokens takes tens of
            # seconds even on an idle machine, so the drain must cut it short.
            params = dict(n=16, temperature=0.0, max_new_tokens=1000)
            long = Stream(c, "job", PROMPTS * 2, sampling=sampling(**params), request_id="big")
            wait_until(
                lambda: _status(c, "big") == RUNNING,
                what="running",
            )
            time.sleep(0.3)
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            code = d.wait(timeout=grace + 30)
            took = time.monotonic() - t0
            got = long.result(10)
    finally:
        d.kill()
    assert code == 0
    assert took < grace + 8  # the grace plus process/worker teardown, not the whole batch
    # The stream got every sample (finished ones and the partial rest), then UNAVAILABLE.
    assert isinstance(long.error, UnavailableError) and "drained" in str(long.error)
    total = len(PROMPTS) * 2 * params["n"]
    assert len(got) == total and len(_by_key(got)) == total
    partial = [s for s in got if s.partial]
    assert partial and all(s.finish_reason == rollout_pb2.FINISH_REASON_ABORTED for s in partial)
    assert any(0 < len(s.token_ids) < 1000 for s in partial)  # tokens so far
    store = Store(migrated_sqlite_url)
    try:
        req = store.requests.get("big")
        assert req.status is RequestStatus.FAILED and "drained" in req.status_reason
        stored = store.samples.list("big")
        assert len(stored) == total
        assert {s.finish_reason for s in stored if s.partial} == {FinishReason.ABORTED}
        assert all(w.state is WorkerState.STOPPED for w in store.workers.list())
    finally:
        store.close()
    messages = [r["msg"] for r in d.logs()]
    assert messages[-1] == "tltd stopped"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_whole_process_group_still_drains(migrated_sqlite_url, tmp_path, ckpt, sig):
    """Ctrl-C in a terminal (SIGINT) and systemd's stop with KillMode=control-group (SIGTERM)
    signal the daemon and every worker at once: the workers leave the stop to the daemon, so
    the drain still returns the tokens so far, and no worker process is left behind."""
    import os

    d = ServeProcess(tmp_path, migrated_sqlite_url, shutdown_grace_seconds=2.0)
    try:
        with d.client() as c:
            # SD off: 64 identical greedy siblings are what the history and n-gram drafters
            # copy best, and with them the request could end before the signal.
            off = common_pb2.SpeculativeConfig(mode=common_pb2.SPECULATIVE_MODE_OFF)
            c.create_job(str(ckpt), job_id="job", speculative=off)
            pids = [w.pid for w in d.wait_workers_ready("job")]
            params = dict(n=64, temperature=0.0, max_new_tokens=1000)
            long = Stream(c, "job", PROMPTS[:4], sampling=sampling(**params), request_id="big")
            wait_until(lambda: _status(c, "big") == RUNNING, what="running")
            time.sleep(0.3)
            os.killpg(d.proc.pid, sig)  # ServeProcess runs in its own session
            code = d.wait(timeout=40)
            got = long.result(10)
    finally:
        d.kill()
    assert code == 0
    assert isinstance(long.error, UnavailableError) and "drained" in str(long.error)
    assert len(got) == 4 * params["n"]
    partial = [s for s in got if s.partial]
    assert partial and all(s.finish_reason == rollout_pb2.FINISH_REASON_ABORTED for s in partial)
    assert any(0 < len(s.token_ids) < 1000 for s in partial)  # tokens so far, not lost workers
    store = Store(migrated_sqlite_url)
    try:
        assert all(w.state is WorkerState.STOPPED for w in store.workers.list())
    finally:
        store.close()
    assert not any(pid_alive(p) for p in pids)
