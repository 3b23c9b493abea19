"""Drafter training through a real daemon: starts on an idle device after rollouts, yields
when a batch arrives, publishes versions, checkpoints on shutdown."""

from __future__ import annotations

import json
import time

import pytest

from tests.api.support import sampling
from tests.rollout.support import direct_outputs
from tltd.domain import DeviceState, SamplingParams, WorkerState
from tltd.metrics import METRICS
from tltd.v1 import drafter_pb2

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [3, 1, 4, 1, 5]]
PARAMS = dict(n=2, temperature=0.0, max_new_tokens=16)


def _wait(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


def _trainer(c):
    return next((w for w in c.list_workers() if w.kind == "drafter_training"), None)


def _by_key(samples) -> dict:
    return {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples}


def test_training_starts_when_idle_and_is_preempted_by_a_new_batch(start_daemon, ckpt):
    # A round never ends by itself here: only the new batch stops it.
    d = start_daemon(training_steps_per_round=100_000)
    hook = d.daemon.training
    seconds_before = METRICS.device_seconds()
    loading_before = METRICS.trainer_loading_seconds()
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-1"))

        w = _wait(lambda: (t := _trainer(c)) and t.state == "busy" and t, what="training")
        assert w.job_id == "job" and w.worker_id == "drafter-job" and w.pid
        # The worker row and the device row are separate writes: wait for the second.
        _wait(
            lambda: d.store.devices.get(w.device_id).state is DeviceState.TRAINING,
            what="device state training",
        )
        _wait(lambda: hook._runs["job"].step >= 2, what="two optimizer steps")

        got = list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-2"))
        w = _wait(lambda: (t := _trainer(c)) and t.state == "ready" and t, what="preempted")
        events = d.store.history.list_events("worker", "drafter-job")
    assert _by_key(got) == direct_outputs(ckpt, PROMPTS, SamplingParams(**PARAMS))
    assert "preempted: rollout work is waiting" in w.state_reason
    transitions = [(e.old_status, e.new_status, e.reason) for e in events]
    assert any(new == "busy" and "idle device" in why for _, new, why in transitions)
    assert any(
        (old, new) == ("busy", "ready") and "preempted: rollout work is waiting" in why
        for old, new, why in transitions
    )
    [p] = hook.preemptions
    assert p.job_id == "job" and p.device_id == w.device_id and p.step >= 2
    print(f"\ndrafter training preemption latency: {p.latency_seconds * 1000:.1f} ms")
    # The device came back from training (a later round may have taken it again since: the
    # second batch left fresh samples, so its current state proves nothing).
    device_events = d.store.history.list_events("device", w.device_id)
    assert any(
        (e.old_status, e.new_status) == ("training", "idle") and "preempted" in e.reason
        for e in device_events
    ), [(e.old_status, e.new_status, e.reason) for e in device_events]
    # The same preemption and the training time are in the Prometheus metrics.
    latency = METRICS.registry.get_sample_value("tltd_preemption_latency_seconds_sum")
    assert latency is not None and latency >= p.latency_seconds
    preempted = METRICS.registry.get_sample_value(
        "tltd_preemptions_total", {"device_id": w.device_id, "reason": "rollout"}
    )
    assert preempted is not None and preempted >= 1
    key = (w.device_id, "training")
    trained = METRICS.device_seconds()[key] - seconds_before.get(key, 0.0)
    # The trainer's start-up is counted apart: part of the training time, and not all of it.
    loading = METRICS.trainer_loading_seconds()[w.device_id] - loading_before.get(w.device_id, 0)
    assert 0 < loading < trained


def test_round_publishes_a_version_and_shutdown_leaves_a_checkpoint(start_daemon, ckpt):
    # Rows shorter than the samples: they train in windows (workers/drafter/packing.py).
    d = start_daemon(training_steps_per_round=3, training_row_len=8)
    data_dir = d.settings.data_dir
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-1"))
        evaluated = (drafter_pb2.DRAFTER_STATUS_PROMOTED, drafter_pb2.DRAFTER_STATUS_REJECTED)
        # publish() inserts the row as CANDIDATE, then evaluates it in a second write.
        listed = _wait(
            lambda: (
                (r := c.list_drafters("job")).drafters and r.drafters[0].status in evaluated and r
            ),
            what="an evaluated version",
        )
        [v] = listed.drafters
        assert v.train_steps == 3 and v.policy_version == 0 and v.acceptance_length > 0
        w = _wait(lambda: (t := _trainer(c)) and t.state == "ready" and t, what="round done")
        assert "published version 1" in w.state_reason
    if v.status == drafter_pb2.DRAFTER_STATUS_PROMOTED:  # the supervisor hot-swaps it in
        _wait(
            lambda: all(s.drafter_version == 1 for s in d.supervisor.handles.values()),
            what="promoted drafter in every rollout worker",
        )
    d.shutdown()  # what SIGTERM runs
    from pathlib import Path

    from tltd_workers.drafter.trainer import latest_checkpoint

    ckpt_dir = latest_checkpoint(Path(data_dir) / "drafters" / "job" / "train")
    assert ckpt_dir is not None and (ckpt_dir / "model.safetensors").is_file()
    meta = json.loads((ckpt_dir / "trainer.json").read_text())
    assert meta["trainer"]["row_len"] == 8  # the daemon setting reached the trainer
    w = d.store.workers.get("drafter-job")
    assert w.state is WorkerState.STOPPED and str(ckpt_dir) in w.state_reason


def test_new_policy_is_loaded_into_the_trainer_in_place_and_node_drain_stops_training(
    start_daemon, ckpt, ckpt2
):
    d = start_daemon(training_steps_per_round=3)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-1"))
        _wait(lambda: c.list_drafters("job").drafters, what="version 1")
        _wait(lambda: (t := _trainer(c)) and t.state == "ready", what="round 1 done")
        assert c.update_policy("job", str(ckpt2)).version == 1
        got = list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-2"))
        assert {s.policy_version for s in got} == {1}
        listed = _wait(
            lambda: len((r := c.list_drafters("job")).drafters) == 2 and r, what="version 2"
        )
        assert [v.policy_version for v in listed.drafters] == [0, 1]
        # The trainer of round 2 trained on the new target, loaded into the same process: its
        # drafter carried on from round 1.
        assert listed.drafters[1].train_steps == 6
        reasons = [e.reason for e in d.store.history.list_events("worker", "drafter-job")]
        assert any("; policy version 1 loaded in place (steps" in r for r in reasons)
        assert not any("restarting" in r for r in reasons)
        _wait(lambda: (t := _trainer(c)) and t.state == "ready", what="round 2 done")

        c.drain(node=True)
        w = _wait(lambda: (t := _trainer(c)) and t.state == "stopped" and t, what="stopped")
    assert "node drained" in w.state_reason and "checkpoint" in w.state_reason


def test_training_off_by_setting(start_daemon, ckpt):
    d = start_daemon(drafter_training=False)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-1"))
        time.sleep(1.0)  # several ticks past the idle grace
        assert _trainer(c) is None
    assert d.daemon.training is None


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["daemon", "process-group"])
def test_sigterm_while_training_exits_0_with_a_drafter_checkpoint(
    tmp_path, migrated_sqlite_url, ckpt, group
):
    """`tltd serve` as a real process: SIGTERM mid-round -> the trainer checkpoints, exit 0;
    also when every process of the daemon gets it (systemd's stop, KillMode=control-group)."""
    import os
    import signal
    from pathlib import Path

    from tests.rollout.support import ServeProcess, pid_alive
    from tltd_workers.drafter.trainer import latest_checkpoint

    serve = ServeProcess(
        tmp_path,
        migrated_sqlite_url,
        training_idle_grace_seconds="0.2",
        training_min_fresh_samples="4",
        training_steps_per_round="100000",
        shutdown_grace_seconds="10",
    )
    try:
        with serve.client() as c:
            c.create_job(str(ckpt), job_id="job")
            serve.wait_workers_ready("job")
            list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), request_id="b-1"))
            w = _wait(lambda: (t := _trainer(c)) and t.state == "busy" and t, what="training")
            time.sleep(1.0)  # a few optimizer steps
        if group:
            os.killpg(serve.proc.pid, signal.SIGTERM)  # ServeProcess runs in its own session
        else:
            serve.proc.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
    finally:
        serve.kill()
    assert not pid_alive(w.pid)
    ckpt_dir = latest_checkpoint(Path(tmp_path) / "data" / "drafters" / "job" / "train")
    assert ckpt_dir is not None and (ckpt_dir / "model.safetensors").is_file()
