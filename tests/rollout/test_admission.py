"""Admission races with a real daemon (real workers): a request once stored always becomes live
and ends; one that can never run fails at once, saying why."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace

import pytest

from tests.api.support import sampling
from tests.rollout.support import direct_outputs, wait_until
from tests.rollout.test_rollouts import PROMPTS, Stream, _by_key
from tltd.devices import cpu_devices
from tltd.domain import DeviceProcess, DeviceState, FinishReason, RequestStatus, SamplingParams
from tltd.errors import NotFound
from tltd.periodic import refresh_devices
from tltd.v1 import rollout_pb2
from tltd_clients.errors import FailedPreconditionError, UnavailableError

CANCELLED = rollout_pb2.FINISH_REASON_CANCELLED


def _slow(monkeypatch, repo, name: str, seconds: float) -> None:
    """Widen an admission window: the repository call `name` takes `seconds` longer."""
    real = getattr(repo, name)

    def slow(*args):
        time.sleep(seconds)
        return real(*args)

    monkeypatch.setattr(repo, name, slow)


def _held(monkeypatch, repo, name: str) -> tuple[threading.Event, threading.Event]:
    """Hold an admission inside the repository call `name`: (entered, release); the call waits for
    `release` (at most 30 s) once `entered` is set."""
    real = getattr(repo, name)
    entered, release = threading.Event(), threading.Event()

    def held(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    monkeypatch.setattr(repo, name, held)
    return entered, release


def _status(store, request_id: str) -> RequestStatus | None:
    try:
        return store.requests.get(request_id).status
    except NotFound:
        return None


def test_caller_gone_during_admission_still_runs_the_request(sqlite_daemon, ckpt, monkeypatch):
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        _slow(monkeypatch, d.store.requests, "admit", 1.0)
        with pytest.raises(Exception, match="(?i)deadline"):
            list(c.generate("job", PROMPTS, sampling=sampling(n=2, max_new_tokens=4),
                            request_id="gone", timeout=0.3))  # fmt: skip
    # Stored after the caller left, and still handed to the workers: it completes.
    wait_until(lambda: _status(d.store, "gone") is RequestStatus.COMPLETED, what="completed")
    assert len(d.store.samples.list("gone")) == len(PROMPTS) * 2


def test_node_drain_during_admission_fails_the_request_at_once(sqlite_daemon, ckpt, monkeypatch):
    d = sqlite_daemon
    with d.client() as c, d.client() as c2:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        storing, release = _held(monkeypatch, d.store.requests, "admit")
        try:
            stream = Stream(c, "job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=8),
                            request_id="late", timeout=20)  # fmt: skip
            assert storing.wait(20)  # accepted (past the draining check), not stored yet
            c2.drain(node=True)  # empty queue: the drain stops assigning at once
        finally:
            release.set()
        got = stream.result(10)
    assert isinstance(stream.error, UnavailableError) and "drained" in str(stream.error)
    assert len(got) == 2 and all(s.partial and not s.token_ids for s in got)
    req = d.store.requests.get("late")
    assert req.status is RequestStatus.FAILED and "node drained" in req.status_reason


def test_cancel_during_submit_is_not_lost(sqlite_daemon, ckpt, monkeypatch):
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    with d.client() as c, d.client() as c2:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        # The request is stored (committed), and made live only after this returns: held
        # until the cancel has been answered, so the cancel finds nothing live to stop.
        real = d.store.requests.admit
        cancelled = threading.Event()

        def stored_then_held(req, *args):
            got = real(req, *args)
            cancelled.wait(30)
            return got

        monkeypatch.setattr(d.store.requests, "admit", stored_then_held)
        stream = Stream(c, "job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=300),
                        request_id="x")  # fmt: skip
        wait_until(lambda: _status(d.store, "x") is not None, what="stored")
        assert sup.queue.get("x") is None
        try:
            c2.cancel_request("x", reason="stop")
        finally:
            cancelled.set()
        got = stream.result(30)
    assert stream.error is None
    assert len(got) == 2 and all(s.finish_reason == CANCELLED for s in got)
    assert all(len(s.token_ids) < 300 for s in got)
    assert d.store.requests.get("x").status is RequestStatus.CANCELLED
    assert sup.queue.get("x") is None


def test_request_on_a_version_that_failed_to_load_fails_at_once(sqlite_daemon, ckpt, tmp_path):
    d = sqlite_daemon
    bad = shutil.copytree(ckpt, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        # UpdatePolicy refuses such a checkpoint; a recorded version's files can still go bad
        # (overwritten or deleted on the node), which the store's version stands for here.
        d.store.policies.add("job", "checkpoint", str(bad))
        d.supervisor.kick_threadsafe()  # the idle workers preload it: LoadFailed
        bad_versions = d.supervisor.models.bad_versions
        wait_until(lambda: ("job", 1) in bad_versions, what="load failed")
        t0 = time.monotonic()
        why = "cannot load policy version 1 of job job: its last load failed; it is retried in"
        with pytest.raises(FailedPreconditionError, match=why):
            list(c.generate("job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=4),
                            request_id="after", timeout=20))  # fmt: skip
        assert time.monotonic() - t0 < 5
    req = d.store.requests.get("after")
    assert req.status is RequestStatus.FAILED and "policy version 1" in req.status_reason
    samples = d.store.samples.list("after")
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
        for dev in d.store.devices.list():
            d.store.devices.set_flags(dev.device_id, draining=True, reason="node drained")
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


def test_a_retry_attaches_during_a_node_drain(sqlite_store, tmp_path, ckpt):
    """While the node drains (its work goes on through the grace), a trainer re-attaching
    with a stored request_id gets that work's samples; a new request is still refused."""
    import os
    import signal

    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon

    settings = make_settings(tmp_path, cpu_slots=1, worker_max_batch=16, worker_max_seq_len=1024,
                             worker_heartbeat_seconds=0.2, worker_heartbeat_timeout_seconds=120.0,
                             device_refresh_seconds=3600.0, drain_grace_seconds=60.0,
                             drafter_training=False)  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store).start()
    pid = 0
    try:
        with d.client() as c, d.client() as c2:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(1)
            params = sampling(n=2, temperature=0.0, max_new_tokens=300)
            first = Stream(c, "job", PROMPTS[:1], sampling=params, request_id="r")
            wait_until(lambda: d.supervisor.queue.inflight("rollout-cpu:0") > 0, what="running")
            pid = d.supervisor.handles["rollout-cpu:0"].proc.pid
            os.kill(pid, signal.SIGSTOP)  # the work cannot end before the re-attach
            c2.drain(node=True, grace_seconds=60)
            with pytest.raises(UnavailableError, match="draining"):
                list(c2.generate("job", PROMPTS[:1], sampling=params, request_id="new"))
            again = Stream(c2, "job", PROMPTS[:1], sampling=params, request_id="r")
            wait_until(
                lambda: len(d.supervisor.requests._subs.get("r", ())) == 2 or not again.is_alive(),
                what="re-attached",
            )
            os.kill(pid, signal.SIGCONT)
            got, got_again = first.result(60), again.result(60)
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        d.kill()
    assert again.error is None and first.error is None
    assert _by_key(got_again) == _by_key(got) and len(got) == 2
    assert _status(sqlite_store, "r") is RequestStatus.COMPLETED


def test_preemption_notice_file_drains_and_exits_0(migrated_sqlite_url, tmp_path, ckpt):
    from tests.rollout.support import ServeProcess

    notice = tmp_path / "preempted"
    d = ServeProcess(tmp_path, migrated_sqlite_url, shutdown_grace_seconds=4.0,
                     drafter_training="false", preemption_notice_file=str(notice))  # fmt: skip
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
    from tltd.v1 import rollout_pb2
    from tltd_clients.errors import NotFoundError

    try:
        return c.get_request("big").request.status == rollout_pb2.REQUEST_STATUS_RUNNING
    except NotFoundError:
        return False


def _foreign(devices, pid: int = 4242):
    """The inventory as discovery reports it once another user's process holds each device."""
    held = (DeviceProcess(pid, 1 << 30),)
    why = f"foreign process: pid {pid} (1024 MiB)"
    return [replace(d, processes=held, foreign=True, state_reason=why) for d in devices]


def test_devices_held_by_foreign_processes_refuse_generate_as_retryable(sqlite_daemon, ckpt):
    """Every device taken by someone else's process: a new Generate is refused UNAVAILABLE
    (the devices come back by themselves), while a retry of a stored request still attaches,
    to a finished one as to one whose work waits for the devices."""
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    greedy = dict(n=2, temperature=0.0, max_new_tokens=900)
    with d.client() as c, d.client() as c2:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        done = list(c.generate("job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=4),
                               request_id="done"))  # fmt: skip
        running = Stream(c2, "job", PROMPTS[:2], sampling=sampling(**greedy), request_id="long")
        wait_until(lambda: sum(map(sup.queue.inflight, sup.handles)) > 0, what="long running")
        # Device discovery reports a foreign process on both CPU slots (the seam the
        # inventory writes through); the supervisor vacates them.
        d.store.devices.upsert(_foreign(cpu_devices(2)))
        sup.kick_threadsafe()
        wait_until(lambda: not any(s.alive for s in sup.handles.values()), what="vacated")

        taken = "no schedulable device: the free ones are taken by foreign processes"
        with pytest.raises(UnavailableError, match=taken) as info:
            list(c.generate("job", [[1, 2, 3]], sampling=sampling(max_new_tokens=4),
                            request_id="refused", timeout=10))  # fmt: skip
        assert "(cpu:0 foreign, cpu:1 foreign)" in str(info.value)
        assert _status(d.store, "refused") is None  # refused before anything was stored
        # A finished request's retry reads its samples.
        again = list(c.generate("job", [[1, 2, 3]], sampling=sampling(n=2, max_new_tokens=4),
                                request_id="done"))  # fmt: skip
        assert _by_key(again) == _by_key(done)
        # An open one's retry attaches too: it waits with the request, not refused.
        retry = Stream(c, "job", PROMPTS[:2], sampling=sampling(**greedy), request_id="long")
        time.sleep(0.5)
        assert retry.is_alive() and retry.error is None
        assert _status(d.store, "long") not in (RequestStatus.COMPLETED, RequestStatus.FAILED)

        # One device cordoned, the other still foreign: still retryable (the foreign one frees).
        c.cordon("cpu:0", "bad fan")
        with pytest.raises(UnavailableError, match=r"taken by foreign.*cpu:0 cordoned\+foreign"):
            list(c.generate("job", [[1, 2, 3]], sampling=sampling(max_new_tokens=4), timeout=10))
        c.uncordon("cpu:0")

        # The foreign processes leave: the next inventory refresh (the periodic job's body)
        # makes the devices ours again, workers come back and the waiting work finishes.
        refresh_devices(d.store, None, 2)
        sup.kick_threadsafe()
        got_first, got_retry = running.result(), retry.result()
        assert running.error is None and retry.error is None
        after = list(c.generate("job", [[1, 2, 3]], sampling=sampling(max_new_tokens=4)))
    expected = direct_outputs(ckpt, PROMPTS[:2], SamplingParams(**greedy))
    assert _by_key(got_first) == _by_key(got_retry) == expected
    assert d.store.requests.get("long").status is RequestStatus.COMPLETED
    assert len(after) == 1 and not after[0].partial


def test_gpus_held_by_foreign_processes_at_the_hardware_boundary(sqlite_store, tmp_path, ckpt):
    """The same through device discovery (a fake NVML): GPUs running someone else's processes
    get no workers, and Generate says so (UNAVAILABLE); a GPU NVML cannot read runs nothing
    either, so it does not make Generate wait forever; only cordoned and draining devices
    call for `tltctl uncordon` (FAILED_PRECONDITION)."""
    import pynvml

    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon
    from tests.store.test_devices import FakeNvml, _gpu

    nvml = FakeNvml([_gpu(0, procs=[(4242, 1 << 30)]), _gpu(1, procs=[(4343, 1 << 30)])])
    settings = make_settings(tmp_path, cpu_slots=2, worker_heartbeat_seconds=0.2,
                             device_refresh_seconds=3600.0, drafter_training=False)  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store, nvml=nvml).start()
    params = sampling(max_new_tokens=4)
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            devices = {dev.device_id: dev for dev in c.list_devices()}
            assert sorted(devices) == ["cuda:0", "cuda:1"]
            assert all("foreign process: pid 4" in dev.state_reason for dev in devices.values())
            taken = r"taken by foreign processes or unavailable \(cuda:0 foreign, cuda:1 foreign\)"
            with pytest.raises(UnavailableError, match=taken):
                list(c.generate("job", [[1, 2, 3]], sampling=params, timeout=10))

            # GPU 1 falls off the bus: NVML cannot read it, the inventory marks it unavailable
            # (and no longer foreign). Nothing can run on either GPU: still refused.
            nvml.gpus[1] = {"error": pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)}
            refresh_devices(d.store, nvml, settings.cpu_slots)
            lost = d.store.devices.get("cuda:1")
            assert lost.state is DeviceState.UNAVAILABLE and not lost.foreign
            with pytest.raises(UnavailableError, match=r"\(cuda:0 foreign, cuda:1 unavailable\)"):
                list(c.generate("job", [[1, 2, 3]], sampling=params, timeout=10))

            # Cordoned and drained: only an operator brings them back.
            c.cordon("cuda:0", "ECC errors")
            c.drain("cuda:1")
            drained = r"all cordoned or draining \(cuda:0 cordoned\+foreign, cuda:1 draining\+una"
            with pytest.raises(FailedPreconditionError, match=drained + ".*uncordon"):
                list(c.generate("job", [[1, 2, 3]], sampling=params, timeout=10))
        assert not any(s.alive for s in d.supervisor.handles.values())  # none was ever started
        assert d.store.requests.list(None, None, 100) == []  # nothing was queued for nobody
    finally:
        d.kill()


def test_a_retry_after_a_policy_update_runs_on_the_version_recorded_at_acceptance(
    sqlite_daemon, ckpt, ckpt2, monkeypatch
):
    """Stated semantics (README, `RolloutService.generate`): a request runs on the policy
    version current when it was accepted. Here the first call's deadline passed while its
    admission was held between storing the request (on v0) and submitting it, the trainer
    pushed v1, then retried the same id (the node's unit claims may make the stored request
    live before the retry does: either way it runs on v0)."""
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    params = sampling(n=2, temperature=0.0, max_new_tokens=12, seed=3)
    real_create, gate, calls = d.store.requests.admit, threading.Event(), []

    def create_then_hold(req, *args):
        out = real_create(req, *args)
        calls.append(f"stored v{out.request.policy_version}")
        if len(calls) == 1:
            assert gate.wait(60), "the test never released the first admission"
            calls.append("first admission resumed")
        return out

    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        monkeypatch.setattr(d.store.requests, "admit", create_then_hold)
        with pytest.raises(Exception, match="(?i)deadline"):
            list(c.generate("job", PROMPTS[:2], sampling=params, request_id="r", timeout=0.3))
        assert calls == ["stored v0"]
        assert c.update_policy("job", str(ckpt2)).version == 1
        retry = Stream(c, "job", PROMPTS[:2], sampling=params, request_id="r", timeout=60)
        # The retry's own admission stored it (the node's unit claims can make a stored
        # request live without it: wait for both).
        wait_until(
            lambda: len(calls) >= 2 and sup.queue.get("r") is not None,
            what="the retry stored the request and it is live",
        )
        gate.set()
        got = retry.result()
        wait_until(lambda: "first admission resumed" in calls, what="first admission done")
        # Finished, a retry reads the same samples; a new request runs on v1.
        again = list(c.generate("job", PROMPTS[:2], sampling=params, request_id="r"))
        new = list(c.generate("job", PROMPTS[:2], sampling=params, request_id="new"))
    assert retry.error is None
    assert calls[:3] == ["stored v0", "stored v0", "first admission resumed"]
    assert {s.policy_version for s in got} == {0}
    same = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=3)
    assert _by_key(got) == _by_key(again) == direct_outputs(ckpt, PROMPTS[:2], same)
    assert d.store.requests.get("r").policy_version == 0
    assert {s.policy_version for s in d.store.samples.list("r")} == {0}
    assert {s.policy_version for s in new} == {1}
    assert _by_key(new) == direct_outputs(ckpt2, PROMPTS[:2], same)


def test_a_node_with_no_device_at_all_refuses_generate(sqlite_store, tmp_path, ckpt):
    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon

    settings = make_settings(tmp_path, cpu_slots=0, device_refresh_seconds=3600.0,
                             drafter_training=False)  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store).start()  # no NVML, no CPU slot
    try:
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            with pytest.raises(FailedPreconditionError, match="no device found.*cpu_slots is 0"):
                list(c.generate("job", [[1, 2, 3]], sampling=sampling(max_new_tokens=4),
                                timeout=10))  # fmt: skip
    finally:
        d.kill()
