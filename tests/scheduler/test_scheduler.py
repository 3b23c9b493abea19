"""Table-driven cases for the pure scheduling policy (no processes, no clock)."""

from __future__ import annotations

from dataclasses import replace

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
    idle_grace_seconds=2.0,
    min_fresh_samples=10,
    training_cadence_seconds=30.0,
    max_samples_per_worker=8,
)


def dev(i: int, ok: bool = True) -> DeviceView:
    return DeviceView(f"cpu:{i}", ok)


def wk(
    i: int,
    job: str = "j",
    running: int = 0,
    tokens: int = 0,
    idle_since: float | None = None,
    ready: bool = True,
) -> RolloutWorkerView:
    return RolloutWorkerView(f"w{i}", f"cpu:{i}", job, ready, running, tokens, idle_since)


def UNMEASURED(wid: str) -> None:  # noqa: N802 - used as a constant: no re-prefill cost known
    return None


def work(
    req: str, idx: int = 0, job: str = "j", n: int = 1, tokens: int = 100, at: float = 0.0
) -> PendingWork:
    return PendingWork(req, idx, job, n, tokens, at)


DEFAULT_JOBS = (JobView("j"),)


def snap(devices=(), workers=(), training=(), pending=(), jobs=DEFAULT_JOBS, now=100.0):
    return Snapshot(
        now, tuple(devices), tuple(workers), tuple(training), tuple(pending), tuple(jobs)
    )


def placed(decision) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in decision.assignments:
        out[a.worker_id] = out.get(a.worker_id, 0) + a.samples
    return out


@pytest.mark.parametrize(
    "name, workers, pending, expected",
    [
        (
            "least remaining work wins, not fewest samples",
            [wk(0, running=1, tokens=900), wk(1, running=3, tokens=300)],
            [work("r", n=1)],
            {"w1": 1},
        ),
        (
            "n samples of one prompt spread to balance",
            [wk(0), wk(1)],
            [work("r", n=4)],
            {"w0": 2, "w1": 2},
        ),
        (
            "spread follows existing load",
            [wk(0, running=1, tokens=200), wk(1)],
            [work("r", n=4)],
            {"w0": 1, "w1": 3},
        ),
        ("capacity caps a worker", [wk(0, running=7, tokens=10)], [work("r", n=4)], {"w0": 1}),
        ("worker not ready gets nothing", [wk(0, ready=False), wk(1)], [work("r", n=2)], {"w1": 2}),
        (
            "worker of another job gets nothing",
            [wk(0, job="other"), wk(1)],
            [work("r", n=2)],
            {"w1": 2},
        ),
    ],
)
def test_placement_balances_expected_work(name, workers, pending, expected):
    d = schedule(snap([dev(0), dev(1)], workers, pending=pending), CFG)
    assert placed(d) == expected, name


def where(decision) -> dict[int, str]:
    """Prompt index -> the worker its (single) sample went to."""
    return {a.prompt_index: a.worker_id for a in decision.assignments}


def predicted(
    req: str, lengths: list[int | None], at: float = 0.0, cap: int = 2048
) -> list[PendingWork]:
    """One sample per prompt of a request, with these predicted lengths."""
    return [
        replace(work(req, i, tokens=cap, at=at), predicted_tokens=n) for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize(
    "name, pending, expected",
    [
        (
            "without predictions: in order, alternating (both long ones on w1)",
            predicted("r", [None, None, None, None]),
            {0: "w0", 1: "w1", 2: "w0", 3: "w1"},
        ),
        (
            "longest predicted first, each onto the least predicted work: one long each",
            predicted("r", [100, 1000, 100, 1000]),
            {1: "w0", 3: "w1", 0: "w0", 2: "w1"},
        ),
        (
            "a long prompt is balanced by several short ones",
            predicted("r", [300, 900, 300, 300]),
            {1: "w0", 0: "w1", 2: "w1", 3: "w1"},
        ),
    ],
)
def test_placement_is_longest_predicted_first_and_balances_predicted_work(name, pending, expected):
    d = schedule(snap([dev(0), dev(1)], [wk(0), wk(1)], pending=pending), CFG)
    assert where(d) == expected, name
    # The order of the assignments is the order of placement.
    assert [a.prompt_index for a in d.assignments] == list(expected), name


def test_requests_keep_their_arrival_order_whatever_their_predictions():
    cfg = replace(CFG, max_samples_per_worker=1)
    pending = predicted("late", [2000], at=5.0) + predicted("early", [10], at=1.0)
    d = schedule(snap([dev(0)], [wk(0)], pending=pending), cfg)
    assert [a.request_id for a in d.assignments] == ["early"]


def test_workers_reporting_predicted_work_get_the_long_sample_where_least_is_left():
    workers = [wk(0, running=3, tokens=300), wk(1, running=1, tokens=1500)]
    d = schedule(snap([dev(0), dev(1)], workers, pending=predicted("r", [800, 50])), CFG)
    assert where(d) == {0: "w0", 1: "w0"}  # 300 + 800 < 1500 still takes the short one too


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
        (
            "a round cut short resumes within the cadence and without fresh data",
            JobView("j", fresh_samples=0, last_training_at=99.0, round_cut_short=True),
            ["cpu:0"],
        ),
        (
            "not even a cut-short round during a policy update",
            JobView("j", last_training_at=99.0, round_cut_short=True, policy_updating=True),
            [],
        ),
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
        snap(
            [dev(0), dev(1)],
            [wk(0, idle_since=0.0), wk(1, idle_since=0.0)],
            training=[TrainingView("cpu:0", "j")],
            jobs=[job],
        ),
        CFG,
    )
    assert d.start_training == () and d.preempt_training == ()
    assert d.idle_devices == ("cpu:1",)


def test_training_preempted_when_rollout_work_arrives():
    d = schedule(
        snap(
            [dev(0)],
            [wk(0, idle_since=0.0)],
            training=[TrainingView("cpu:0", "j")],
            pending=[work("r", n=2)],
        ),
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
        snap(
            [dev(0), dev(1)],
            [wk(0, job="j", idle_since=0.0), wk(1, job="k")],
            training=[TrainingView("cpu:0", "j")],
            pending=[work("r", job="k")],
            jobs=[JobView("j"), JobView("k")],
        ),
        CFG,
    )
    assert d.preempt_training == ()
    assert placed(d) == {"w1": 1}


def test_training_not_preempted_when_a_free_rollout_worker_takes_the_tie():
    # Same expected work on both workers: the one not training takes it.
    d = schedule(
        snap(
            [dev(0), dev(1)],
            [wk(0, idle_since=0.0), wk(1, idle_since=0.0)],
            training=[TrainingView("cpu:0", "j")],
            pending=[work("r", n=1)],
        ),
        CFG,
    )
    assert d.preempt_training == () and placed(d) == {"w1": 1}


def test_training_preempted_when_balance_needs_its_device():
    # Two samples: balancing expected work puts one on the training device's worker.
    d = schedule(
        snap(
            [dev(0), dev(1)],
            [wk(0, idle_since=0.0), wk(1, idle_since=0.0)],
            training=[TrainingView("cpu:0", "j")],
            pending=[work("r", n=2)],
        ),
        CFG,
    )
    assert d.preempt_training == ("cpu:0",) and placed(d) == {"w0": 1, "w1": 1}


@pytest.mark.parametrize(
    "name, workers, pending, expected_preempt, expected_not_idle",
    [
        (
            "another job's workers are full: training of j yields to k's work",
            [wk(0, job="j", idle_since=0.0), wk(1, job="k", running=8, tokens=800)],
            [work("r", job="k", n=2)],
            ("cpu:0",),
            {"cpu:0"},
        ),
        (
            "k's worker holds another policy version: it needs a switched worker",
            [wk(0, job="j", idle_since=0.0)],
            [PendingWork("r", 0, "k", 2, 100, 0.0, policy_version=3)],
            ("cpu:0",),
            {"cpu:0"},
        ),
        (
            "a free rollout worker is switched before training yields",
            [
                wk(0, job="j", idle_since=0.0),
                wk(1, job="j", running=8, tokens=800),
                wk(2, job="j", idle_since=0.0),
            ],
            [work("r", job="k", n=2)],
            (),
            {"cpu:0", "cpu:2"},
        ),
    ],
)
def test_training_preempted_by_any_jobs_waiting_work(
    name, workers, pending, expected_preempt, expected_not_idle
):
    devices = [dev(i) for i in range(len(workers))]
    jobs = [JobView("j"), JobView("k", fresh_samples=50)]
    d = schedule(
        snap(devices, workers, training=[TrainingView("cpu:0", "j")], pending=pending, jobs=jobs),
        CFG,
    )
    assert d.preempt_training == expected_preempt, name
    for device_id in expected_preempt:
        assert "rollout work is waiting" in d.reasons[device_id]
        assert "job k" in d.reasons[device_id]
    # Devices that training yields or workers are switched on are not idle: k's data-rich
    # job must not start training on the device its work is about to use.
    assert not expected_not_idle & set(d.idle_devices), name
    assert d.start_training == (), name


def test_only_as_many_training_devices_yield_as_the_waiting_work_needs():
    workers = [
        wk(0, job="a", idle_since=0.0),
        wk(1, job="b", idle_since=0.0),
        wk(2, job="k", running=8, tokens=800),
    ]
    training = [TrainingView("cpu:0", "a"), TrainingView("cpu:1", "b")]
    jobs = [JobView("a"), JobView("b"), JobView("k")]
    d = schedule(
        snap(
            [dev(0), dev(1), dev(2)],
            workers,
            training=training,
            pending=[work("r", job="k", n=3)],
            jobs=jobs,
        ),
        CFG,  # 8 samples per worker: one device covers 3
    )
    assert d.preempt_training == ("cpu:0",)


def test_fair_share_holds_on_the_device_training_yields():
    jobs = [JobView("a", weight=3.0), JobView("b", weight=1.0)]
    workers = [RolloutWorkerView("w0", "cpu:0", "", True, idle_since=0.0)]
    pending = [work(f"a{i}", job="a", at=i) for i in range(8)] + [
        work(f"b{i}", job="b", at=i) for i in range(8)
    ]
    d = schedule(
        snap([dev(0)], workers, training=[TrainingView("cpu:0", "a")], pending=pending, jobs=jobs),
        CFG,
    )
    assert d.preempt_training == ("cpu:0",)
    order = [a.request_id[0] for a in d.assignments]
    assert order.count("a") == 6 and order.count("b") == 2  # 3:1 by weight, as without training


def test_preempted_device_gets_no_training_start_in_the_same_tick():
    d = schedule(
        snap(
            [dev(0)],
            [wk(0, job="j", idle_since=0.0)],
            training=[TrainingView("cpu:0", "j")],
            pending=[PendingWork("r", 0, "k", 1, 100, 0.0)],
            jobs=[JobView("j"), JobView("k", fresh_samples=50)],
        ),
        CFG,
    )
    assert d.preempt_training == ("cpu:0",)
    assert d.idle_devices == () and d.start_training == ()


def test_worker_starting_up_is_not_idle():
    d = schedule(snap([dev(0)], [wk(0, ready=False, idle_since=None)]), CFG)
    assert d.idle_devices == ()


@pytest.mark.parametrize(
    "name, workers, expected",
    [
        ("idle within the grace: no training yet", [wk(0, idle_since=99.5)], []),
        ("busy device: no training", [wk(0, running=1, tokens=10, idle_since=None)], []),
    ],
)
def test_training_starts_only_on_idle_devices(name, workers, expected):
    d = schedule(snap([dev(0)], workers, jobs=[JobView("j", fresh_samples=50)]), CFG)
    assert [t.device_id for t in d.start_training] == expected, name


def test_training_start_goes_to_the_job_with_most_fresh_data_first():
    jobs = [JobView("a", fresh_samples=20), JobView("b", fresh_samples=40)]
    d = schedule(snap([dev(0)], [wk(0, job="", idle_since=0.0)], jobs=jobs), CFG)
    assert [(t.device_id, t.job_id) for t in d.start_training] == [("cpu:0", "b")]
    d = schedule(
        snap(
            [dev(0), dev(1)],
            [wk(0, job="", idle_since=0.0), wk(1, job="", idle_since=0.0)],
            jobs=jobs,
        ),
        CFG,
    )
    assert [(t.device_id, t.job_id) for t in d.start_training] == [("cpu:0", "b"), ("cpu:1", "a")]


def test_policy_update_blocks_only_its_own_jobs_training():
    jobs = [JobView("a", fresh_samples=50, policy_updating=True), JobView("b", fresh_samples=20)]
    d = schedule(snap([dev(0)], [wk(0, job="", idle_since=0.0)], jobs=jobs), CFG)
    assert [t.job_id for t in d.start_training] == ["b"]


def test_training_is_never_started_on_an_unschedulable_device():
    d = schedule(
        snap([dev(0, ok=False)], [wk(0, idle_since=0.0)], jobs=[JobView("j", fresh_samples=50)]),
        CFG,
    )
    assert d.idle_devices == () and d.start_training == ()


# ---- which job a worker serves (switches) -------------------------------------------------


def sw(i: int, job: str, running: int = 0, tokens: int = 0, to: str = "", ready: bool = True):
    return RolloutWorkerView(
        f"w{i}", f"cpu:{i}", job, ready, running, tokens, None, switching_to=to
    )


A_BUSY = [work(f"a{i}", job="a", n=4, at=i) for i in range(10)]  # far more than fits


@pytest.mark.parametrize(
    "name, workers, pending, jobs, expected_switches, expected_placed",
    [
        (
            "a higher-priority job takes a worker while the busy job still waits",
            [sw(0, "a", running=6, tokens=600), sw(1, "a", running=2, tokens=200)],
            [*A_BUSY, work("b", job="b", n=1, at=5)],
            [JobView("a", served_tokens=10), JobView("b", priority=5)],
            {"w1": "b"},  # the emptiest worker: it drains soonest
            {"w0": 2},  # w1 takes no more of a's work
        ),
        (
            "a lower-priority job never takes a worker from a higher one",
            [sw(0, "a", running=8, tokens=800)],
            [*A_BUSY, work("b", job="b")],
            [JobView("a", priority=5, served_tokens=10**9), JobView("b")],
            {},
            {},
        ),
        (
            "a new equal job gets one worker of two (weights 1:1), not both",
            [sw(0, "a", running=8, tokens=800), sw(1, "a", running=8, tokens=800)],
            [*A_BUSY, *[work(f"b{i}", job="b", n=8, at=i) for i in range(4)]],
            [JobView("a", served_tokens=5000), JobView("b")],
            {"w0": "b"},
            {},
        ),
        (
            "weights 3:1 split four workers 3:1",
            [sw(i, "a", running=8, tokens=800) for i in range(4)],
            [*A_BUSY, *[work(f"b{i}", job="b", n=8, at=i) for i in range(4)]],
            [JobView("a", served_tokens=5000), JobView("b", weight=3.0)],
            {"w0": "b", "w1": "b", "w2": "b"},
            {},
        ),
        (
            "an even split stays put (no ping-pong)",
            [sw(0, "a", running=8, tokens=800), sw(1, "b", running=8, tokens=800)],
            [*A_BUSY, *[work(f"b{i}", job="b", n=8, at=i) for i in range(4)]],
            [JobView("a", served_tokens=0), JobView("b", served_tokens=10**9)],
            {},
            {},
        ),
        (
            "one worker, equal jobs: the trailing job waits for a quantum",
            [sw(0, "a", running=4, tokens=400)],
            [*A_BUSY, work("b", job="b")],
            [JobView("a", served_tokens=1000), JobView("b")],
            {},
            {"w0": 4},
        ),
        (
            "one worker, equal jobs: past the quantum the trailing job takes it",
            [sw(0, "a", running=4, tokens=400)],
            [*A_BUSY, work("b", job="b")],
            [JobView("a", served_tokens=40_000), JobView("b")],
            {"w0": "b"},
            {},
        ),
        (
            "a worker already switching covers the need: no second switch, no work",
            [sw(0, "a", running=3, tokens=300, to="b"), sw(1, "a", running=8, tokens=800)],
            [*A_BUSY, work("b", job="b", n=2)],
            [JobView("a"), JobView("b", priority=5)],
            {},
            {},
        ),
        (
            "a switch whose job has nothing waiting any more is called off",
            [sw(0, "a", running=3, tokens=300, to="b")],
            [work("a0", job="a", n=2)],
            [JobView("a"), JobView("b", priority=5)],
            {"w0": "a"},
            {"w0": 2},
        ),
        (
            "a spare worker (its job has nothing waiting) is taken first",
            [sw(0, "a", running=1, tokens=10), sw(1, "c"), sw(2, "a", running=8, tokens=800)],
            [*A_BUSY, work("b", job="b", n=2)],
            [JobView("a"), JobView("b", priority=5), JobView("c")],
            {"w1": "b"},
            {"w0": 7},
        ),
        (
            "a busy worker of a job between requests stays (it is not spare)",
            [sw(0, "a", running=6, tokens=600), sw(1, "b", running=8, tokens=800)],
            [work("b0", job="b", n=8)],
            [JobView("a"), JobView("b")],
            {},
            {},
        ),
        (
            "once empty, it is spare",
            [sw(0, "a"), sw(1, "b", running=8, tokens=800)],
            [work("b0", job="b", n=8)],
            [JobView("a"), JobView("b")],
            {"w0": "b"},
            {},
        ),
        (
            "emptied within the spare grace (its trainer's next request is on its way): stays",
            [replace(sw(0, "a"), idle_since=99.5), sw(1, "b", running=8, tokens=800)],
            [work("b0", job="b", n=8)],
            [JobView("a"), JobView("b")],
            {},
            {},
        ),
        (
            "empty for the spare grace: spare",
            [replace(sw(0, "a"), idle_since=99.0), sw(1, "b", running=8, tokens=800)],
            [work("b0", job="b", n=8)],
            [JobView("a"), JobView("b")],
            {"w0": "b"},
            {},
        ),
        (
            "the grace holds a worker for its own job only: a higher priority takes it at once",
            [replace(sw(0, "a"), idle_since=99.9), sw(1, "b", running=8, tokens=800)],
            [work("b0", job="b", n=8)],
            [JobView("a"), JobView("b", priority=5)],
            {"w0": "b"},
            {},
        ),
    ],
)
def test_which_job_a_worker_serves(
    name, workers, pending, jobs, expected_switches, expected_placed
):
    devices = [dev(i) for i in range(len(workers))]
    d = schedule(snap(devices, workers, pending=pending, jobs=jobs), CFG)
    assert {s.worker_id: s.job_id for s in d.switches} == expected_switches, name
    assert placed(d) == expected_placed, name
    switched = {s.worker_id for s in d.switches if s.job_id != "a"}
    assert not {f"cpu:{w[1:]}" for w in switched} & set(d.idle_devices), name


def test_a_device_whose_worker_died_is_not_idle_while_work_waits():
    # cpu:0's worker is in restart backoff (not in the snapshot); cpu:1's is full.
    d = schedule(
        snap(
            [dev(0), dev(1)],
            [wk(1, running=8, tokens=800)],
            pending=[work("r", n=4)],
            jobs=[JobView("j", fresh_samples=50)],
        ),
        CFG,
    )
    assert d.idle_devices == () and d.start_training == ()


def test_a_worker_loading_a_model_with_nothing_waiting_does_not_preempt_training():
    # cpu:1's worker (re)starts and loads job j on its own; nothing is pending, so the
    # training running on cpu:1 keeps the device.
    loading = RolloutWorkerView("w1", "cpu:1", "", ready=False, switching_to="j")
    s = Snapshot(
        now=100.0,
        devices=(DeviceView("cpu:0", True), DeviceView("cpu:1", True)),
        workers=(RolloutWorkerView("w0", "cpu:0", "j", ready=True, idle_since=0.0), loading),
        training=(TrainingView("cpu:1", "j"),),
        pending=(),
        jobs=(JobView("j"),),
    )
    d = schedule(s, CFG)
    assert d.preempt_training == ()
    # With work of that job waiting, the loading worker's device is needed: training yields.
    d = schedule(replace(s, pending=(work("r", n=4, job="j"),)), CFG)
    assert "cpu:1" in d.preempt_training


def test_work_on_a_version_no_worker_holds_does_not_hold_up_the_job():
    """A request accepted on version 91 just after one on version 90 was (the 91 one claimed
    first) while both workers hold 90: the planner keeps them on 90 for the older request,
    so its work must be placed; waiting behind the 91 work would leave both stuck for good."""
    workers = [
        RolloutWorkerView("w0", "cpu:0", "j", True, idle_since=0.0, policy_version=90),
        RolloutWorkerView("w1", "cpu:1", "j", True, idle_since=0.0, policy_version=90),
    ]
    pending = [
        PendingWork("new", 0, "j", 2, 100, 1.0, policy_version=91),
        PendingWork("old", 0, "j", 2, 100, 2.0, policy_version=90),
    ]
    d = schedule(snap([dev(0), dev(1)], workers, pending=pending), CFG)
    assert {(a.request_id, a.worker_id) for a in d.assignments} == {("old", "w0"), ("old", "w1")}
    # Once a worker holds 91, each request goes to the worker of its version.
    workers[0] = replace(workers[0], policy_version=91)
    d = schedule(snap([dev(0), dev(1)], workers, pending=pending), CFG)
    assert {(a.request_id, a.worker_id, a.samples) for a in d.assignments} == {
        ("new", "w0", 2),
        ("old", "w1", 2),
    }


ROLLOUT_ONLY = replace(CFG, train_during_rollout_only=True)


def test_rollout_window_training_starts_in_the_jobs_tail_not_after_it():
    job = JobView("j", fresh_samples=50)
    # cpu:0 idle while cpu:1 still runs the job's last samples: the tail, training starts.
    tail = snap([dev(0), dev(1)], [wk(0, idle_since=0.0), wk(1, running=2)], jobs=[job])
    assert [t.device_id for t in schedule(tail, ROLLOUT_ONLY).start_training] == ["cpu:0"]
    # The same job with nothing waiting or running: its rollout is over, no training here
    # (the trainer has the devices), though the idle-window default would start one.
    over = snap([dev(0), dev(1)], [wk(0, idle_since=0.0), wk(1, idle_since=0.0)], jobs=[job])
    assert schedule(over, ROLLOUT_ONLY).start_training == ()
    assert len(schedule(over, CFG).start_training) == 1


@pytest.mark.parametrize(
    "name, job, expected",
    [
        ("a round just ended, fresh samples since", JobView("j", fresh_samples=3,
                                                            last_training_at=99.0), ["cpu:0"]),
        ("nothing new, the trainer holds samples", JobView("j", fresh_samples=0,
                                                           buffered_samples=40,
                                                           last_training_at=99.0), ["cpu:0"]),
        ("nothing new and nothing to train on", JobView("j", fresh_samples=0,
                                                        last_training_at=99.0), []),
    ],
)  # fmt: skip
def test_rollout_window_rounds_follow_each_other_in_the_tail(name, job, expected):
    """In the job's tail the next round needs neither the cadence nor min_fresh_samples, nor
    even a sample finished since the last round: the idle device is there for seconds only,
    and the tail's last samples may all still be running."""
    tail = snap([dev(0), dev(1)], [wk(0, idle_since=0.0), wk(1, running=2)], jobs=[job])
    assert [t.device_id for t in schedule(tail, ROLLOUT_ONLY).start_training] == expected, name
    assert schedule(tail, CFG).start_training == ()  # the default window waits the cadence


def test_rollout_window_training_yields_when_the_jobs_last_sample_is_done():
    training = [TrainingView("cpu:0", "j")]
    running = snap([dev(0), dev(1)], [wk(0, idle_since=0.0), wk(1, running=1)], training)
    assert schedule(running, ROLLOUT_ONLY).preempt_training == ()
    done = snap([dev(0), dev(1)], [wk(0, idle_since=0.0), wk(1, idle_since=0.0)], training)
    d = schedule(done, ROLLOUT_ONLY)
    assert d.preempt_training == ("cpu:0",)
    assert "rollout ended" in d.reasons["cpu:0"]
    assert schedule(done, CFG).preempt_training == ()  # the default window keeps training


def test_rollout_window_counts_waiting_work_and_only_the_trained_jobs_own():
    jobs = [JobView("j", fresh_samples=50), JobView("k")]
    training = [TrainingView("cpu:0", "j")]
    # Job k's rollout does not keep j's training alive: j's has ended.
    other = snap(
        [dev(0), dev(1)], [wk(0, job="j", idle_since=0.0), wk(1, job="k", running=3)],
        training, jobs=jobs,
    )  # fmt: skip
    assert schedule(other, ROLLOUT_ONLY).preempt_training == ("cpu:0",)
    # Work of j waiting that no worker here can take yet (it needs policy version 5, which no
    # worker has loaded) is a rollout in flight: training starts on the idle device.
    waiting = snap(
        [dev(0)], [wk(0, job="j", idle_since=0.0)],
        pending=[replace(work("r", job="j"), policy_version=5)], jobs=jobs,
    )  # fmt: skip
    d = schedule(waiting, ROLLOUT_ONLY)
    assert d.assignments == () and [t.job_id for t in d.start_training] == ["j"]
