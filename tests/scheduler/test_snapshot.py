"""The supervisor's state folded into the scheduler's Snapshot (plain values, no processes)."""

from __future__ import annotations

import pytest

from tltd.domain import Device, DeviceKind, DeviceState, Job
from tltd.scheduler import TrainingView
from tltd.supervisor.snapshot import build_snapshot, device_view
from tltd.supervisor.training_hook import JobTraining
from tltd.supervisor.work_queue import WorkQueue
from tltd.supervisor.worker_process import Load, LoadKind, Phase, WorkerHandle


def device(i: int = 0, **kw) -> Device:
    return Device(device_id=f"cpu:{i}", kind=DeviceKind.CPU, index=i, **kw)


@pytest.mark.parametrize(
    "name, d, schedulable",
    [
        ("ours and idle", device(), True),
        ("cordoned", device(cordoned=True), False),
        ("draining", device(draining=True), False),
        ("taken by a foreign process", device(foreign=True), False),
        ("unavailable", device(state=DeviceState.UNAVAILABLE), False),
        ("training is still ours", device(state=DeviceState.TRAINING), True),
    ],
)
def test_device_view_folds_cordon_drain_foreign_and_unavailable(name, d, schedulable):
    assert device_view(d).schedulable is schedulable, name


def handle(i: int, job: str = "j", alive: bool = True, load: str = "") -> WorkerHandle:
    s = WorkerHandle(f"w{i}", device(i), proc=object(), job_id=job)
    s.phase = Phase.READY if alive else Phase.DEAD
    if load:
        s.phase = Phase.LOADING if alive else Phase.DEAD
        s.load = Load(LoadKind.POLICY, load, 1)
    return s


class Hook:
    def views(self):
        return (TrainingView("cpu:9", "j"),)

    def job_view(self, job_id):
        return JobTraining(7, 1.5, True, buffered=12)


def snap(handles, jobs=("j", "k"), training=None):
    return build_snapshot(
        10.0,
        [device(0)],
        [Job(job_id=j, model_path="/m") for j in jobs],
        handles,
        WorkQueue(),
        {"j": 40},
        training,
    )


def test_a_job_is_policy_updating_while_a_live_worker_loads_its_weights():
    loading = handle(0, load="j")
    s = snap([loading, handle(1, job="k")], training=Hook())
    jobs = {j.job_id: j for j in s.jobs}
    assert jobs["j"].policy_updating and not jobs["k"].policy_updating
    assert [w.ready for w in s.workers] == [False, True]  # no work while it loads


def test_a_dead_worker_neither_counts_nor_updates():
    s = snap([handle(0, alive=False, load="j")], training=Hook())
    assert s.workers == () and not any(j.policy_updating for j in s.jobs)


def test_job_accounts_come_from_the_training_hook_and_served_tokens():
    s = snap([handle(0)], training=Hook())
    j = next(j for j in s.jobs if j.job_id == "j")
    got = (j.served_tokens, j.fresh_samples, j.last_training_at, j.round_cut_short)
    assert got == (40, 7, 1.5, True) and j.buffered_samples == 12 and j.online_training
    assert s.training == (TrainingView("cpu:9", "j"),)
    assert not any(j.online_training for j in snap([handle(0)]).jobs)  # no hook: no training


def test_a_worker_s_prefill_cost_is_its_prefill_slope_in_decode_passes():
    from tltd.supervisor.snapshot import prefill_steps_per_token

    stats = {
        "prefill_seconds_per_token": 0.0002,
        "steps": {"plain": 80, "spec": 20, "total": 100},
        "seconds": {"plain_decode": 0.8, "draft": 0.05, "verify": 0.15, "prefill": 3.0},
    }
    assert prefill_steps_per_token(stats) == pytest.approx(0.02)  # 0.2 ms / 10 ms a pass
    assert prefill_steps_per_token(stats | {"prefill_seconds_per_token": None}) is None
    assert prefill_steps_per_token(stats | {"steps": {"total": 0}}) is None
    assert prefill_steps_per_token({}) is None  # an engine that reports neither (SGLang's)
    assert prefill_steps_per_token(stats | {"seconds": None}) is None  # no decode time known
