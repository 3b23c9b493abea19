"""Real rollouts through the daemon: gRPC in, real worker processes, samples streamed back."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.api.support import sampling
from tests.rollout.support import InProcessDaemon, direct_outputs, wait_until
from tltd.domain import (
    DeviceState,
    DrafterStatus,
    DrafterVersion,
    FinishReason,
    Job,
    RequestStatus,
    RolloutRequest,
    Sample,
    SamplingParams,
)
from tltd.supervisor.worker_process import Phase
from tltd.v1 import common_pb2, rollout_pb2
from tltd_clients.errors import AlreadyExistsError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [3, 1, 4, 1, 5]]
FR = rollout_pb2.FinishReason


def _by_key(samples) -> dict:
    return {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples}


def _settled(sup) -> bool:
    """Every worker's last heartbeat covers all work sent to it and it runs nothing."""
    return all(
        s.heartbeat is not None
        and s.heartbeat.acked_seq == s.seq
        and s.heartbeat.running_samples == 0
        for s in sup.handles.values()
        if s.alive
    )


class Stream(threading.Thread):
    """Consume a Generate stream in the background (samples, then the error if any)."""

    def __init__(self, client, *args, **kw) -> None:
        super().__init__(daemon=True)
        self.client, self.args, self.kw = client, args, kw
        self.samples: list = []
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            for s in self.client.generate(*self.args, **self.kw):
                self.samples.append(s)
        except Exception as exc:
            self.error = exc

    def result(self, timeout: float = 120.0) -> list:
        self.join(timeout)
        assert not self.is_alive(), "stream did not end"
        return self.samples


def test_batch_streams_back_complete_and_lossless(daemon, ckpt):
    params = dict(n=3, temperature=0.0, max_new_tokens=12)
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        daemon.wait_workers_ready(2)
        got = list(c.generate("job", PROMPTS, sampling=sampling(**params), request_id="b-1"))
        req = c.get_request("b-1", include_samples=True)
        workers = c.list_workers()
    assert len(got) == len(PROMPTS) * 3
    assert _by_key(got) == direct_outputs(ckpt, PROMPTS, SamplingParams(**params))
    assert all(not s.partial and s.policy_version == 0 for s in got)
    assert all(len(s.logprobs) == len(s.token_ids) for s in got)
    assert req.request.status == rollout_pb2.REQUEST_STATUS_COMPLETED
    assert req.request.samples_done == 15 and len(req.samples) == 15
    # Both devices worked (the n samples of the batch spread) and are reported.
    assert sorted(w.worker_id for w in workers) == ["rollout-cpu:0", "rollout-cpu:1"]
    assert all(w.kind == "rollout" and w.pid and w.job_id == "job" for w in workers)
    wait_until(lambda: _settled(daemon.supervisor), what="heartbeats caught up")
    prefills = [st["prefills"] for st in daemon.supervisor.worker_stats().values()]
    assert len(prefills) == 2 and all(p > 0 for p in prefills)
    # Device states follow the work: rollout while it ran, idle from the moment it ended.
    wait_until(
        lambda: {dv.state for dv in daemon.store.devices.list()} == {DeviceState.IDLE},
        what="devices idle",
    )
    for dev in ("cpu:0", "cpu:1"):
        states = [e.new_status for e in daemon.store.history.list_events("device", dev)]
        assert "rollout" in states and states[-1] == "idle"


def test_samples_ready_together_go_in_one_message_when_the_call_asks(sqlite_daemon, ckpt):
    """`batch_samples`: a worker step's samples in one GenerateResponse (`samples`); without
    it, one message per sample (`sample`), as a client that predates the field expects."""
    params = dict(n=8, temperature=0.0, max_new_tokens=4)
    with sqlite_daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        sqlite_daemon.wait_workers_ready(2)

        def call(rid: str, batch: bool) -> list:
            req = rollout_pb2.GenerateRequest(
                job_id="job", request_id=rid, prompts=[rollout_pb2.Prompt(token_ids=PROMPTS[0])],
                sampling=sampling(**params), batch_samples=batch,
            )  # fmt: skip
            return list(c.rollouts.Generate(req, timeout=120))

        batched, single = call("batched", True), call("single", False)
    # Greedy: the 8 samples finish in the same step of each worker they went to.
    assert 1 <= len(batched) <= 2
    assert all(not m.HasField("sample") and len(m.samples) >= 1 for m in batched)
    assert len(single) == 8 and all(m.HasField("sample") and not m.samples for m in single)
    got = [s for m in batched for s in m.samples]
    assert len(_by_key(got)) == 8
    assert _by_key(got) == _by_key(m.sample for m in single)
    assert all(len(s.logprobs) == len(s.token_ids) == 4 for s in got)


def test_seeded_sampling_is_reproducible_across_workers(sqlite_daemon, ckpt):
    """Sampled (T=1) samples spread over two workers equal the engine's for the same seed."""
    params = dict(n=4, temperature=1.0, max_new_tokens=10, seed=5)
    with sqlite_daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        sqlite_daemon.wait_workers_ready(2)
        off = common_pb2.SPECULATIVE_MODE_OFF
        got = list(c.generate("job", PROMPTS[:3], sampling=sampling(**params), speculative=off))
    expected = direct_outputs(ckpt, PROMPTS[:3], SamplingParams(**params), speculative=False)
    assert _by_key(got) == expected


def test_worker_killed_mid_batch_the_batch_still_completes(sqlite_daemon, ckpt):
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    params = dict(n=4, temperature=0.0, max_new_tokens=600)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        stream = Stream(c, "job", PROMPTS[:4], sampling=sampling(**params), request_id="k-1")
        wait_until(lambda: sup.queue.inflight("rollout-cpu:0") > 0, what="work on cpu:0")
        victim = sup.handles["rollout-cpu:0"].proc.pid
        os.kill(victim, signal.SIGKILL)
        got = stream.result()
        assert stream.error is None
        d.wait_workers_ready(2)  # the restarted worker (the batch may have finished first)
        workers = {w.worker_id: w for w in c.list_workers()}
    assert len(got) == 16 and len(_by_key(got)) == 16
    # Re-run samples reproduce the same tokens: the batch is identical to the engine's.
    assert _by_key(got) == direct_outputs(ckpt, PROMPTS[:4], SamplingParams(**params))
    assert sup.assigned_samples > 16  # the lost samples ran again
    restarted = workers["rollout-cpu:0"]
    assert restarted.pid != victim and restarted.state in ("ready", "busy")
    events = d.store.history.list_events("worker", "rollout-cpu:0")
    assert any(e.new_status == "failed" and "exit code" in e.reason for e in events)
    assert any(e.old_status == "failed" and e.new_status == "starting" for e in events)


def test_retry_attaches_to_the_same_work(sqlite_daemon, ckpt):
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    params = dict(n=4, temperature=0.0, max_new_tokens=400)
    with d.client() as c1, d.client() as c2:
        c1.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        first = Stream(c1, "job", PROMPTS[:3], sampling=sampling(**params), request_id="idem")
        wait_until(lambda: sup.assigned_samples == 12, what="all samples assigned")
        # A retry (e.g. the trainer lost its connection) while the work runs.
        second = list(
            c2.generate("job", PROMPTS[:3], sampling=sampling(**params), request_id="idem")
        )
        assert len(first.result()) == 12 and first.error is None
        # ...and once it is done: the stored samples, nothing runs.
        third = list(
            c2.generate("job", PROMPTS[:3], sampling=sampling(**params), request_id="idem")
        )
        with pytest.raises(AlreadyExistsError, match="request_id"):
            list(c2.generate("job", PROMPTS[:2], sampling=sampling(**params), request_id="idem"))
    assert _by_key(second) == _by_key(first.samples) == _by_key(third)
    assert len(second) == len(third) == 12
    assert sup.assigned_samples == 12  # no sample ran twice
    wait_until(lambda: _settled(sup), what="heartbeats caught up")
    assert sum(st["prefills"] for st in sup.worker_stats().values()) <= 6  # 3 prompts, 2 workers
    assert len(d.store.samples.list("idem")) == 12


def test_cancel_stops_the_work_promptly(sqlite_daemon, ckpt):
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    params = dict(n=4, temperature=0.0, max_new_tokens=1000)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        stream = Stream(c, "job", PROMPTS, sampling=sampling(**params), request_id="c-1")
        wait_until(lambda: sup.assigned_samples > 0, what="work assigned")
        time.sleep(0.2)
        cancelled = c.cancel_request("c-1", reason="trainer moved on")
        got = stream.result(timeout=30)
        req = c.get_request("c-1")
    assert cancelled.status == rollout_pb2.REQUEST_STATUS_CANCELLED
    assert stream.error is None  # the stream ends normally, every sample accounted for
    assert len(got) == 20 and {s.finish_reason for s in got} == {FR.FINISH_REASON_CANCELLED}
    assert all(s.partial and len(s.token_ids) < 1000 for s in got)
    assert req.request.status == rollout_pb2.REQUEST_STATUS_CANCELLED
    assert "trainer moved on" in req.request.status_reason
    wait_until(lambda: all(sup.queue.inflight(w) == 0 for w in sup.handles), what="workers free")
    assert len(sup.queue) == 0


def test_policy_update_mid_stream_old_requests_finish_on_their_version(sqlite_daemon, ckpt, ckpt2):
    """Stated semantics: a request runs on the policy version current when it was accepted;
    new requests run on the new version; every sample says which version produced it."""
    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    old = dict(n=2, temperature=0.0, max_new_tokens=500)
    new = dict(n=2, temperature=0.0, max_new_tokens=20)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        a = Stream(c, "job", PROMPTS[:2], sampling=sampling(**old), request_id="old")
        wait_until(lambda: sup.assigned_samples == 4, what="old request running")
        assert c.update_policy("job", str(ckpt2)).version == 1
        b = Stream(c, "job", PROMPTS[2:4], sampling=sampling(**new), request_id="new")
        got_a, got_b = a.result(), b.result()
        assert a.error is None and b.error is None
        assert c.get_job("job").policy_version == 1
    assert {s.policy_version for s in got_a} == {0}
    assert {s.policy_version for s in got_b} == {1}
    # The tokens prove which weights made them, not just the label.
    assert _by_key(got_a) == direct_outputs(ckpt, PROMPTS[:2], SamplingParams(**old))
    expected_b = direct_outputs(ckpt2, PROMPTS[2:4], SamplingParams(**new))
    assert _by_key(got_b) == expected_b
    assert all(s.policy_version == 1 for s in sup.handles.values())
    stored = d.store.samples.list("new")
    assert {s.policy_version for s in stored} == {1}


def test_request_recovered_after_a_crash_runs_on_the_version_it_was_accepted_on(
    sqlite_store, settings, ckpt, ckpt2
):
    """A request accepted on v0 that had no finished sample when the daemon died (what a
    kill -9 leaves: the rows, no process) runs on v0 after the restart, though the trainer
    pushed v1 in between."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=1)
    store = sqlite_store
    store.jobs.create(Job(job_id="job", model_path=str(ckpt)))
    store.requests.create(RolloutRequest("r", "job", tuple(map(tuple, PROMPTS[:2])), params))
    store.requests.set_status("r", RequestStatus.RUNNING, "on a worker when the daemon died")
    store.policies.add("job", "checkpoint", str(ckpt2))
    d = InProcessDaemon(settings, store).start()
    try:
        wait_until(
            lambda: store.requests.get("r").status is RequestStatus.COMPLETED,
            timeout=60,
            what="recovered request completed",
        )
    finally:
        d.kill()
    got = store.samples.list("r")
    assert {s.policy_version for s in got} == {0}
    assert _by_key(got) == direct_outputs(ckpt, PROMPTS[:2], params)


def test_an_open_request_of_a_cancelled_job_is_cancelled_after_a_restart(
    sqlite_store, settings, ckpt
):
    """A crash in the middle of CancelJob leaves a request open under the cancelled job: the
    restart ends it CANCELLED with the job's reason, its missing samples stored partial."""
    from tltd.domain import FinishReason, JobStatus, Sample

    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=1)
    store = sqlite_store
    store.jobs.create(Job(job_id="job", model_path=str(ckpt)))
    store.requests.create(RolloutRequest("r", "job", (tuple(PROMPTS[0]),), params))
    store.requests.set_status("r", RequestStatus.RUNNING, "on a worker when the daemon died")
    store.samples.add(Sample("r", 0, 1, (7, 8), (-0.5, -0.5), FinishReason.LENGTH))
    store.jobs.set_status("job", JobStatus.CANCELLED, "trainer gone")
    d = InProcessDaemon(settings, store).start()
    d.kill()
    req = store.requests.get("r")
    assert (req.status, req.status_reason) == (
        RequestStatus.CANCELLED,
        "job cancelled: trainer gone",
    )
    got = {(s.prompt_index, s.sample_index): s for s in store.samples.list("r")}
    assert not got[(0, 1)].partial and got[(0, 1)].token_ids == (7, 8)
    assert got[(0, 0)].partial and got[(0, 0)].finish_reason is FinishReason.CANCELLED


def test_a_retry_after_a_restart_gets_the_resumed_sample_not_the_partial_one(
    sqlite_store, settings, ckpt
):
    """A drain stored (0, 0) partial (ABORTED, its first tokens) and the daemon died before
    failing the request: after the restart (0, 0) goes on from its stored tokens. A trainer
    re-attaching meanwhile gets the stored complete (0, 1) at once, then the complete (0, 0)
    when it finishes, never the partial."""
    from dataclasses import replace

    from tltd.devices import cpu_devices
    from tltd.domain import FinishReason, Sample

    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, seed=1)
    store = sqlite_store
    store.jobs.create(Job(job_id="job", model_path=str(ckpt)))
    store.requests.create(RolloutRequest("r", "job", (tuple(PROMPTS[0]),), params))
    store.requests.set_status("r", RequestStatus.RUNNING, "on a worker when the daemon died")
    store.samples.add(Sample("r", 0, 1, (7, 8), (-0.5, -0.5), FinishReason.LENGTH))
    whole = direct_outputs(ckpt, PROMPTS[:1], params)[(0, 0)]
    store.samples.add(
        Sample("r", 0, 0, whole[:3], (-0.1,) * 3, FinishReason.ABORTED, partial=True,
               error="drained")
    )  # fmt: skip
    # Nothing runs until the test says so: the re-attach lands before (0, 0) is re-run.
    store.devices.upsert(cpu_devices(1))
    store.devices.set_flags("cpu:0", cordoned=True, reason="test")
    d = InProcessDaemon(replace(settings, cpu_slots=1), store).start()
    try:
        with d.client() as c:
            s = sampling(n=2, temperature=0.0, max_new_tokens=12, seed=1)
            stream = iter(c.generate("job", PROMPTS[:1], sampling=s, request_id="r", timeout=60))
            first = next(stream)
            assert (first.prompt_index, first.sample_index) == (0, 1) and not first.partial
            # A stream that asks for partial samples gets the stored one at once.
            asked = iter(
                c.generate("job", PROMPTS[:1], sampling=s, request_id="r", timeout=60,
                           return_partial=True)
            )  # fmt: skip
            early = [next(asked), next(asked)]
            assert [(x.sample_index, x.partial) for x in early] == [(1, False), (0, True)]
            assert early[1].finish_reason == rollout_pb2.FINISH_REASON_ABORTED
            c.uncordon("cpu:0")
            d.supervisor.kick_threadsafe()
            got = [first, *stream]
            late = list(asked)
    finally:
        d.kill()
    assert sorted((x.prompt_index, x.sample_index) for x in got) == [(0, 0), (0, 1)]
    assert not any(x.partial for x in got)
    # Then the complete (0, 0), which the partial one's tokens begin.
    assert [(x.sample_index, x.partial) for x in late] == [(0, False)]
    assert list(late[0].token_ids) == [x.token_ids for x in got if x.sample_index == 0][0]
    resumed = next(x for x in got if x.sample_index == 0)
    assert tuple(resumed.token_ids) == whole  # greedy: as if it had never stopped
    assert list(resumed.logprobs[:3]) == pytest.approx([-0.1] * 3)  # stored: carried over
    assert store.requests.get("r").status is RequestStatus.COMPLETED


def test_foreign_device_is_vacated_and_its_work_moves(sqlite_daemon, ckpt):
    from tltd.domain import Device, DeviceKind, DeviceProcess

    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    params = dict(n=4, temperature=0.0, max_new_tokens=600)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        stream = Stream(c, "job", PROMPTS[:2], sampling=sampling(**params), request_id="f-1")
        wait_until(lambda: sup.queue.inflight("rollout-cpu:1") > 0, what="work on cpu:1")
        # The inventory reports a foreign process on cpu:1 (as device discovery would).
        d.store.devices.upsert(
            [
                Device("cpu:0", DeviceKind.CPU, 0),
                Device(
                    "cpu:1",
                    DeviceKind.CPU,
                    1,
                    processes=(DeviceProcess(4242, 1 << 30),),
                    foreign=True,
                    state_reason="foreign pid 4242",
                ),
            ]
        )
        sup.kick_threadsafe()
        got = stream.result()
        workers = {w.worker_id: w for w in c.list_workers()}
    assert stream.error is None and len(got) == 8
    assert _by_key(got) == direct_outputs(ckpt, PROMPTS[:2], SamplingParams(**params))
    assert workers["rollout-cpu:1"].state == "stopped"
    assert "foreign" in workers["rollout-cpu:1"].state_reason
    assert not sup.handles["rollout-cpu:1"].alive


def test_silent_worker_is_reaped_and_its_work_requeued(sqlite_store, tmp_path, ckpt):
    """A worker that stops heartbeating (SIGSTOP: alive but hung) is killed by the periodic
    reaper after the timeout; its samples run again elsewhere."""
    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon

    settings = make_settings(
        tmp_path,
        cpu_slots=2,
        worker_max_batch=16,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        worker_heartbeat_timeout_seconds=1.5,
        device_refresh_seconds=3600.0,
    )
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        sup = d.supervisor
        params = dict(n=4, temperature=0.0, max_new_tokens=800)
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            stream = Stream(c, "job", PROMPTS[:2], sampling=sampling(**params), request_id="h")
            wait_until(lambda: sup.queue.inflight("rollout-cpu:1") > 0, what="work on cpu:1")
            hung = sup.handles["rollout-cpu:1"].proc.pid
            os.kill(hung, signal.SIGSTOP)
            got = stream.result()
        assert stream.error is None and len(got) == 8
        assert _by_key(got) == direct_outputs(ckpt, PROMPTS[:2], SamplingParams(**params))
        events = d.store.history.list_events("worker", "rollout-cpu:1")
        assert any(e.new_status == "failed" and "no heartbeat" in e.reason for e in events)
    finally:
        d.kill()


def test_node_drain_returns_partial_samples_and_fails_the_request(sqlite_store, tmp_path, ckpt):
    """`tltctl drain --node`: no new rollouts; after drain_grace_seconds what still runs comes
    back partial and the request fails with the reason; the daemon keeps serving reads."""
    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon
    from tltd_clients.errors import UnavailableError

    settings = make_settings(
        tmp_path,
        cpu_slots=2,
        worker_max_batch=16,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        # No grace: what runs when the drain starts comes back partial at once. (A grace of
        # 0.5 s was a race: on an idle machine the tiny model finished all 20 samples in it.)
        drain_grace_seconds=0.0,
        device_refresh_seconds=3600.0,
    )
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        params = dict(n=4, temperature=0.0, max_new_tokens=1000)
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            stream = Stream(c, "job", PROMPTS, sampling=sampling(**params), request_id="dr")
            sup = d.supervisor
            wait_until(lambda: sup.assigned_samples > 0, what="running")
            # The workers held until the drain has begun: on a loaded machine the drain call
            # could otherwise land after the tiny model had finished every sample. A worker
            # takes its commands (the Drain) before its next step.
            pids = [h.proc.pid for h in sup.handles.values()]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                c.drain(node=True)
                wait_until(lambda: not sup._drain.assigning, what="the drain's grace over")
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            got = stream.result(30)
            with pytest.raises(UnavailableError, match="draining"):
                list(c.generate("job", PROMPTS[:1], sampling=sampling(max_new_tokens=2)))
            req = c.get_request("dr", include_samples=True)
        assert isinstance(stream.error, UnavailableError) and "drained" in str(stream.error)
        assert len(got) == 20 and any(s.partial for s in got)
        assert all(s.finish_reason == FR.FINISH_REASON_ABORTED for s in got if s.partial)
        assert req.request.status == rollout_pb2.REQUEST_STATUS_FAILED
        assert len(req.samples) == 20
    finally:
        d.kill()


def test_cancelling_the_job_cancels_its_running_request(sqlite_daemon, ckpt):
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        params = dict(n=2, temperature=0.0, max_new_tokens=1000)
        stream = Stream(c, "job", PROMPTS[:2], sampling=sampling(**params), request_id="j-1")
        wait_until(lambda: d.supervisor.assigned_samples == 4, what="running")
        # Frozen while the cancel lands, so that no sample can reach its token limit first
        # (on a loaded machine the cancel RPC can take longer than 1000 tiny-model steps).
        pids = [s.proc.pid for s in d.supervisor.handles.values()]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            c.cancel_job("job", reason="experiment over")
            wait_until(
                lambda: d.store.requests.get("j-1").status is RequestStatus.CANCELLED,
                what="the cancel stored",
            )
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        got = stream.result(30)
        req = c.get_request("j-1").request
    assert stream.error is None and len(got) == 4
    assert {s.finish_reason for s in got} == {FR.FINISH_REASON_CANCELLED}
    assert req.status == rollout_pb2.REQUEST_STATUS_CANCELLED
    assert "experiment over" in req.status_reason


def test_promoted_drafter_is_hot_swapped_into_workers_and_stays_lossless(
    sqlite_daemon, ckpt, tmp_path
):
    from tltd_workers.engine.eagle import EagleDrafter
    from tltd_workers.engine.transformer import load_model

    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    EagleDrafter.random_init(load_model(ckpt), seed=3).save_pretrained(tmp_path / "drafter")
    params = dict(n=2, temperature=0.0, max_new_tokens=40)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        dv = d.store.drafters.add(
            DrafterVersion("job", 0, policy_version=0, path=str(tmp_path / "drafter"))
        )
        d.store.drafters.set_status("job", dv.version, DrafterStatus.PROMOTED, "test")
        sup.kick_threadsafe()
        wait_until(
            lambda: all(
                s.drafter_version == dv.version and s.phase is Phase.READY
                for s in sup.handles.values()
            ),
            what="drafter loaded by every worker",
        )
        got = list(c.generate("job", PROMPTS, sampling=sampling(**params)))
    # A random drafter is mostly rejected, but the output is still exactly the target's.
    assert _by_key(got) == direct_outputs(ckpt, PROMPTS, SamplingParams(**params))
    assert {s.drafter_version for s in got} <= {0, dv.version}
    assert any(s.drafter_version == dv.version for s in got)  # EAGLE steps ran


def test_a_prompts_stored_answers_draft_its_next_rollout_after_a_restart(
    sqlite_store, settings, ckpt
):
    """Answers stored by an earlier daemon (a row in the store is all a restart keeps) reach
    the workers of a fresh one with the prompt: its history drafter drafts them, losslessly."""
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    want = direct_outputs(ckpt, PROMPTS[:2], params)
    store = sqlite_store
    store.jobs.create(Job(job_id="job", model_path=str(ckpt)))
    store.requests.create(RolloutRequest("epoch-1", "job", tuple(map(tuple, PROMPTS[:2])), params))
    for (p, s), tokens in want.items():
        sample = Sample("epoch-1", p, s, tokens, (-1.0,) * len(tokens), FinishReason.STOP)
        store.samples.add(sample)
    d = InProcessDaemon(settings, store).start()
    try:
        with d.client() as c:
            d.wait_workers_ready(2)
            got = list(
                c.generate(
                    "job",
                    PROMPTS[:2],
                    sampling=sampling(
                        temperature=0.0, max_new_tokens=12, n=2, return_provenance=True
                    ),
                    request_id="epoch-2",
                )
            )
    finally:
        d.kill()
    assert _by_key(got) == want
    drafters = {
        pair for s in got for pair in zip(s.provenance.drafter, s.provenance.source, strict=True)
    }
    assert (rollout_pb2.DRAFTER_KIND_HISTORY, rollout_pb2.TOKEN_SOURCE_ACCEPTED) in drafters


def test_a_stream_whose_units_all_run_here_reads_the_store_only_to_end(
    store, tmp_path, ckpt, monkeypatch
):
    """While this node runs every unit of a request, its samples reach the stream as events:
    the poll (every 20 ms here) does not read the store again, and the request's end (every
    unit recorded here) ends the stream without reading the samples back. Reading at every
    poll would make one read per 20 ms of the request's run. On PostgreSQL the node hears its
    own notifications of those samples and of the end: they wake none of its streams."""
    from tests.api.support import make_settings

    settings = make_settings(tmp_path, cpu_slots=2, worker_max_batch=16, worker_max_seq_len=1024,
                             worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
                             stream_poll_seconds=0.02, drafter_training=False)  # fmt: skip
    reads: list[str] = []
    stream_state = store.leases.stream_state

    def counted(request_id, cursor):
        reads.append(request_id)
        return stream_state(request_id, cursor)

    listed: list[str] = []
    list_samples = store.samples.list

    def counted_list(request_id, *args, **kwargs):
        listed.append(request_id)
        return list_samples(request_id, *args, **kwargs)

    monkeypatch.setattr(store.leases, "stream_state", counted)
    monkeypatch.setattr(store.samples, "list", counted_list)
    d = InProcessDaemon(settings, store).start()
    try:
        params = dict(n=8, temperature=1.0, max_new_tokens=400, seed=5)
        with d.client() as c:
            c.create_job(str(ckpt), job_id="job")
            d.wait_workers_ready(2)
            t0 = time.monotonic()
            got = list(c.generate("job", PROMPTS, sampling=sampling(**params), request_id="q"))
            took = time.monotonic() - t0
    finally:
        d.kill()
    assert len(got) == len(PROMPTS) * 8
    assert took > 20 * settings.stream_poll_seconds  # long enough for polls to show
    # Before the node claimed the units (a tick): a handful, not one per poll.
    assert reads.count("q") <= 5, (reads.count("q"), took)
    assert listed.count("q") == 0
    assert _by_key(got) == _by_key(store.samples.list("q"))
