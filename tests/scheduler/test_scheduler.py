"""Table-driven cases for the pure scheduling policy (no processes, no clock)."""

from __future__ import annotations

import pytest

from tltd.scheduler import (
    DeviceView,
    JobView,
    PendingWork,
    RolloutWorkerView,
    SchedulerConfig,
    Snapshot,
    TrainingView,
    schedule,
)

CFG = SchedulerConfig(
    idle_grace_seconds=2.0, min_fresh_samples=10, training_cadence_seconds=30.0,
    max_samples_per_worker=8,
)


def dev(i: int, ok: bool = True) -> DeviceView:
    return DeviceView(f"cpu:{i}", ok)


def wk(i: int, job: str = "j", running: int = 0, tokens: int = 0, idle_since: float | None = None,
       ready: bool = True) -> RolloutWorkerView:
    return RolloutWorkerView(f"w{i}", f"cpu:{i}", job, ready, running, tokens, idle_since)


def work(req: str, idx: int = 0, job: str = "j", n: int = 1, tokens: int = 100,
         at: float = 0.0) -> PendingWork:
    return PendingWork(req, idx, job, n, tokens, at)


DEFAULT_JOBS = (JobView("j"),)


def snap(devices=(), workers=(), training=(), pending=(), jobs=DEFAULT_JOBS, now=100.0):
    return Snapshot(now, tuple(devices), tuple(workers), tuple(training), tuple(pending),
                    tuple(jobs))


def placed(decision) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in decision.assignments:
        out[a.worker_id] = out.get(a.worker_id, 0) + a.samples
    return out


@pytest.mark.parametrize(
    "name, workers, pending, expected",
    [
        ("least remaining work wins, not fewest samples",
         [wk(0, running=1, tokens=900), wk(1, running=3, tokens=300)],
         [work("r", n=1)], {"w1": 1}),
        ("n samples of one prompt spread to balance",
         [wk(0), wk(1)], [work("r", n=4)], {"w0": 2, "w1": 2}),
        ("spread follows existing load",
         [wk(0, running=1, tokens=200), wk(1)], [work("r", n=4)], {"w0": 1, "w1": 3}),
        ("capacity caps a worker", [wk(0, running=7, tokens=10)], [work("r", n=4)], {"w0": 1}),
        ("worker not ready gets nothing", [wk(0, ready=False), wk(1)], [work("r", n=2)],
         {"w1": 2}),
        ("worker of another job gets nothing", [wk(0, job="other"), wk(1)], [work("r", n=2)],
         {"w1": 2}),
    ],
)
def test_placement_balances_expected_work(name, workers, pending, expected):
    d = schedule(snap([dev(0), dev(1)], workers, pending=pending), CFG)
    assert placed(d) == expected, name


def test_partially_placed_prompt_reports_only_what_fits():
    d = schedule(snap([dev(0)], [wk(0, running=6)], pending=[work("r", n=5)]), CFG)
    assert [(a.request_id, a.samples) for a in d.assignments] == [("r", 2)]


@pytest.mark.parametrize(
    "flag",
    ["cordoned", "draining", "foreign"],
)
def test_unschedulable_device_gets_no_new_work(flag):
    # DeviceView.schedulable folds cordon, drain and foreign processes into one bit.
    d = schedule(snap([dev(0, ok=False), dev(1)], [wk(0), wk(1)], pending=[work("r", n=3)]), CFG)
    assert placed(d) == {"w1": 3}, flag
    assert "cpu:0" not in d.idle_devices


def test_weighted_fair_share_between_jobs():
    jobs = [JobView("a", weight=3.0), JobView("b", weight=1.0)]
    workers = [RolloutWorkerView("w0", "cpu:0", "", True)]
    pending = [work(f"a{i}", job="a", at=i) for i in range(8)] + [
        work(f"b{i}", job="b", at=i) for i in range(8)
    ]
    d = schedule(snap([dev(0)], workers, pending=pending, jobs=jobs), CFG)
    order = [a.request_id[0] for a in d.assignments]
    assert len(order) == 8  # capacity
    assert order.count("a") == 6 and order.count("b") == 2  # 3:1 by weight


def test_priority_beats_weight():
    jobs = [JobView("lo", weight=10.0), JobView("hi", weight=1.0, priority=5)]
    workers = [RolloutWorkerView("w0", "cpu:0", "", True)]
    pending = [work("l", job="lo", n=4), work("h", job="hi", n=8)]
    d = schedule(snap([dev(0)], workers, pending=pending, jobs=jobs), CFG)
    assert [a.request_id for a in d.assignments] == ["h"]


def test_fair_share_accounts_for_past_service():
    jobs = [JobView("a", served_tokens=10_000), JobView("b", served_tokens=0)]
    workers = [RolloutWorkerView("w0", "cpu:0", "", True, running_samples=7)]
    pending = [work("a1", job="a", at=0), work("b1", job="b", at=1)]
    d = schedule(snap([dev(0)], workers, pending=pending, jobs=jobs), CFG)
    assert [a.request_id for a in d.assignments] == ["b1"]


@pytest.mark.parametrize(
    "name, workers, now, expected_idle",
    [
        ("idle past the grace", [wk(0, idle_since=90.0)], 100.0, ["cpu:0"]),
        ("idle but within grace", [wk(0, idle_since=99.0)], 100.0, []),
        ("busy worker", [wk(0, running=2, tokens=50)], 100.0, []),
        ("device without workers is idle", [], 100.0, ["cpu:0"]),
    ],
)
def test_idle_detection(name, workers, now, expected_idle):
    d = schedule(snap([dev(0)], workers, now=now), CFG)
    assert list(d.idle_devices) == expected_idle, name


def test_device_that_just_got_work_is_not_idle():
    d = schedule(snap([dev(0)], [wk(0, idle_since=0.0)], pending=[work("r")]), CFG)
    assert d.idle_devices == ()


@pytest.mark.parametrize(
    "name, job, expected",
    [
        ("enough fresh data, never trained", JobView("j", fresh_samples=10), ["cpu:0"]),
        ("not enough data", JobView("j", fresh_samples=9), []),
        ("cadence not reached", JobView("j", fresh_samples=50, last_training_at=80.0), []),
        ("cadence reached", JobView("j", fresh_samples=50, last_training_at=60.0), ["cpu:0"]),
        ("not during a policy update", JobView("j", fresh_samples=50, policy_updating=True), []),
        ("online training off", JobView("j", fresh_samples=50, online_training=False), []),
    ],
)
def test_training_start(name, job, expected):
    d = schedule(snap([dev(0)], [wk(0, idle_since=0.0)], jobs=[job]), CFG)
    assert [t.device_id for t in d.start_training] == expected, name


def test_one_training_task_per_job_and_none_on_training_device():
    job = JobView("j", fresh_samples=50)
    d = schedule(
        snap([dev(0), dev(1)], [wk(0, idle_since=0.0), wk(1, idle_since=0.0)],
             training=[TrainingView("cpu:0", "j")], jobs=[job]),
        CFG,
    )
    assert d.start_training == () and d.preempt_training == ()
    assert d.idle_devices == ("cpu:1",)


def test_training_preempted_when_rollout_work_arrives():
    d = schedule(
        snap([dev(0)], [wk(0, idle_since=0.0)], training=[TrainingView("cpu:0", "j")],
             pending=[work("r", n=2)]),
        CFG,
    )
    assert d.preempt_training == ("cpu:0",)
    assert "waiting" in d.reasons["cpu:0"]
    assert placed(d) == {"w0": 2}  # the work goes to the device being freed


def test_training_preempted_on_cordon_or_foreign_process():
    d = schedule(snap([dev(0, ok=False)], [], training=[TrainingView("cpu:0", "j")]), CFG)
    assert d.preempt_training == ("cpu:0",)


def test_training_not_preempted_by_other_jobs_work():
    d = schedule(
        snap([dev(0), dev(1)], [wk(0, job="j", idle_since=0.0), wk(1, job="k")],
             training=[TrainingView("cpu:0", "j")], pending=[work("r", job="k")],
             jobs=[JobView("j"), JobView("k")]),
        CFG,
    )
    assert d.preempt_training == ()
    assert placed(d) == {"w1": 1}
