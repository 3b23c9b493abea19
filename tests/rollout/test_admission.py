"""Admission races with a real daemon (real workers): a request once stored always becomes live
and ends; one that can never run fails at once, saying why."""

from __future__ import annotations

import shutil
import time

import pytest

from clients.errors import FailedPreconditionError, UnavailableError
from tests.api.support import sampling
from tests.rollout.support import wait_until
from tests.rollout.test_rollouts import PROMPTS, Stream
from tltd.domain import FinishReason, RequestStatus
from tltd.errors import NotFound
from tltd.v1 import rollout_pb2

CANCELLED = rollout_pb2.FINISH_REASON_CANCELLED


def _slow(monkeypatch, store, name: str, seconds: float) -> None:
    """Widen an admission window: the store call `name` takes `seconds` longer."""
    real = getattr(store, name)

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(store, name, slow)


def _status(store, request_id: str) -> RequestStatus | None:
    try:
        return store.get_request(request_id).status
    except NotFound:
        return None


def test_caller_gone_during_admission_still_runs_the_request(sqlite_daemon, ckpt, monkeypatch):
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        _slow(monkeypatch, d.store, "create_request", 1.0)
        with pytest.raises(Exception, match="(?i)deadline"):
            list(c.generate("job", PROMPTS, sampling=sampling(n=2, max_new_tokens=4),
                            request_id="gone", timeout=0.3))  # fmt: skip
    # Stored after the caller left, and still handed to the workers: it completes.
    wait_until(lambda: _status(d.store, "gone") is RequestStatus.COMPLETED, what="completed")
    assert len(d.store.list_samples("gone")) == len(PROMPTS) * 2


def test_node_drain_during_admission_fails_the_request_at_once(sqlite_daemon, ckpt, monkeypatch):
    d = sqlite_daemon
    with d.client() as c, d.client() as c2:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        _slow(monkeypatch, d.store, "create_request", 1.0)
        stream = Stream(c, "job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=8),
                        request_id="late", timeout=20)  # fmt: skip
        time.sleep(0.3)  # accepted (past the draining check), not stored yet
        c2.drain(node=True)  # empty queue: the drain stops assigning at once
        got = stream.result(10)
    assert isinstance(stream.error, UnavailableError) and "drained" in str(stream.error)
    assert len(got) == 2 and all(s.partial and not s.token_ids for s in got)
    req = d.store.get_request("late")
    assert req.status is RequestStatus.FAILED and "node drained" in req.status_reason


def test_cancel_during_submit_is_not_lost(sqlite_daemon, ckpt, monkeypatch):
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    with d.client() as c, d.client() as c2:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        # submit reads the status, then the samples (slow), then makes the request live.
        _slow(monkeypatch, d.store, "list_samples", 0.8)
        stream = Stream(c, "job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=300),
                        request_id="x")  # fmt: skip
        wait_until(lambda: _status(d.store, "x") is not None, what="stored")
        time.sleep(0.1)  # submit is inside list_samples now: nothing live to cancel
        assert sup.queue.get("x") is None
        c2.cancel_request("x", reason="stop")
        got = stream.result(30)
    assert stream.error is None
    assert len(got) == 2 and all(s.finish_reason == CANCELLED for s in got)
    assert all(len(s.token_ids) < 300 for s in got)
    assert d.store.get_request("x").status is RequestStatus.CANCELLED
    assert sup.queue.get("x") is None


def test_request_on_a_version_that_failed_to_load_fails_at_once(sqlite_daemon, ckpt, tmp_path):
    d = sqlite_daemon
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        c.update_policy("job", str(bad))  # the idle workers preload it: LoadFailed
        bad_versions = d.supervisor.models.bad_versions
        wait_until(lambda: ("job", 1) in bad_versions, what="load failed")
        t0 = time.monotonic()
        why = "cannot load policy version 1 of job job: its last load failed; it is retried in"
        with pytest.raises(UnavailableError, match=why):
            list(c.generate("job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=4),
                            request_id="after", timeout=20))  # fmt: skip
        assert time.monotonic() - t0 < 5
    req = d.store.get_request("after")
    assert req.status is RequestStatus.FAILED and "policy version 1" in req.status_reason
    samples = d.store.list_samples("after")
    assert len(samples) == 2 and {s.finish_reason for s in samples} == {FinishReason.FAILED}


def test_no_schedulable_device_refuses_generate_until_uncordoned(sqlite_daemon, ckpt):
    """Devices still flagged draining by a node drain before a restart (the node itself is not
    draining): Generate is refused with the way out, and `uncordon` is that way out."""
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        params = sampling(n=2, max_new_tokens=4)
        done = list(c.generate("job", [[1, 2, 3]], sampling=params, request_id="done"))
        for dev in d.store.list_devices():
            d.store.set_device_flags(dev.device_id, draining=True, reason="node drained")
        with pytest.raises(FailedPreconditionError, match="no schedulable device.*uncordon"):
            list(c.generate("job", [[1, 2, 3]], sampling=sampling(max_new_tokens=4), timeout=10))
        # A retry of a stored request still attaches (a client reconnecting reads its samples).
        again = list(c.generate("job", [[1, 2, 3]], sampling=params, request_id="done"))
        assert [s.token_ids for s in again] == [s.token_ids for s in done]
        assert not c.uncordon("cpu:0").draining
        got = list(c.generate("job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=4)))
    assert len(got) == 2 and not any(s.partial for s in got)


def test_drain_grace_from_the_request_is_used(sqlite_store, tmp_path, ckpt):
    """`tltctl drain --node --grace 1` on a daemon whose default drain grace is 60 s."""
    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon

    settings = make_settings(tmp_path, cpu_slots=2, worker_max_batch=16, worker_max_seq_len=1024,
                             worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
                             drain_grace_seconds=60.0, drafter_training=False)  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        with d.client() as c, d.client() as c2:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            params = sampling(n=16, temperature=0.0, max_new_tokens=1000)
            stream = Stream(c, "job", PROMPTS * 2, sampling=params, request_id="big")
            wait_until(lambda: _status(d.store, "big") is RequestStatus.RUNNING, what="running")
            t0 = time.monotonic()
            c2.drain(node=True, grace_seconds=1)
            stream.result(30)
            took = time.monotonic() - t0
    finally:
        d.kill()
    assert isinstance(stream.error, UnavailableError) and "grace 1s" in str(stream.error)
    assert took < 8  # 1 s of grace, then the workers return what runs


def test_preemption_notice_file_drains_and_exits_0(sqlite_url, tmp_path, ckpt):
    from tests.rollout.support import ServeProcess

    notice = tmp_path / "preempted"
    d = ServeProcess(tmp_path, sqlite_url, shutdown_grace_seconds=4.0, drafter_training="false",
                     preemption_notice_file=str(notice))  # fmt: skip
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready("job")
            params = sampling(n=16, temperature=0.0, max_new_tokens=1000)
            stream = Stream(c, "job", PROMPTS * 2, sampling=params, request_id="big")
            wait_until(lambda: stream.samples or _running(c), what="running")
            notice.write_text("")
            code = d.wait(timeout=30)
            stream.result(10)
    finally:
        d.kill()
    assert code == 0
    assert "drained" in str(stream.error), (stream.error, len(stream.samples))
    messages = [r["msg"] for r in d.logs()]
    assert "preemption notice" in messages and messages[-1] == "tltd stopped"


def _running(c) -> bool:
    from clients.errors import NotFoundError
    from tltd.v1 import rollout_pb2

    try:
        return c.get_request("big").request.status == rollout_pb2.REQUEST_STATUS_RUNNING
    except NotFoundError:
        return False
