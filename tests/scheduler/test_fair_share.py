"""Fair-share accounts: a job waking from idle starts level with the busy jobs, not with credit."""

from __future__ import annotations

import pytest

from tltd.domain import RolloutRequest, SamplingParams
from tltd.scheduler import (
    DeviceView,
    JobView,
    PendingWork,
    RolloutWorkerView,
    SchedulerConfig,
    Snapshot,
    schedule,
)
from tltd.supervisor.fair_share import FairShare, active_jobs, lift_waking

A, B, C = JobView("a"), JobView("b"), JobView("c")


@pytest.mark.parametrize(
    "name, jobs, accounts, active, was_active, floors, lifted, new_floors",
    [
        (
            "a waking job rises to the busy job's account",
            [A, B],
            {"a": 100_000, "b": 2_000},
            {"a", "b"},
            {"a"},
            {},
            {"b": 100_000},
            {0: 100_000},
        ),
        (
            "to the smallest of the busy jobs",
            [A, B, C],
            {"a": 100_000, "b": 40_000, "c": 0},
            {"a", "b", "c"},
            {"a", "b"},
            {},
            {"c": 40_000},
            {0: 40_000},
        ),
        (
            "a job ahead of the busy ones keeps its account (never lowered)",
            [A, B],
            {"a": 10, "b": 5_000},
            {"a", "b"},
            {"a"},
            {},
            {},
            {0: 10},
        ),
        (
            "a job that kept working is not lifted",
            [A, B],
            {"a": 100_000, "b": 2_000},
            {"a", "b"},
            {"a", "b"},
            {},
            {},
            {0: 2_000},
        ),
        (
            "an idle job is not lifted (only on waking)",
            [A, B],
            {"a": 100_000, "b": 2_000},
            {"a"},
            {"a"},
            {},
            {},
            {0: 100_000},
        ),
        (
            "virtual time is per weight: level in tokens / weight",
            [JobView("a", weight=2.0), JobView("b", weight=3.0)],
            {"a": 10_000, "b": 0},
            {"a", "b"},
            {"a"},
            {},
            {"b": 15_000},
            {0: 5_000},
        ),
        (
            "rounded down, never a hair ahead (the scheduler splits workers to a job not ahead)",
            [JobView("a", weight=3.0), B],
            {"a": 1_000, "b": 0},
            {"a", "b"},
            {"a"},
            {},
            {"b": 333},
            {0: 1_000 / 3},
        ),
        (
            "only the jobs of its own priority set the level",
            [A, JobView("h", priority=5), JobView("l", priority=5)],
            {"a": 100_000, "h": 0, "l": 0},
            {"a", "h", "l"},
            {"a", "h"},
            {},
            {},
            {0: 100_000, 5: 0},
        ),
        (
            "all waking together: the level where the busy ones left off",
            [A, B],
            {"a": 100_000, "b": 0},
            {"a", "b"},
            set(),
            {0: 90_000},
            {"b": 90_000},
            {0: 90_000},
        ),
        (
            "nobody ever busy: nothing to be level with",
            [A, B],
            {"a": 100_000, "b": 0},
            {"a", "b"},
            set(),
            {},
            {},
            {},
        ),
        (
            "a job with no account yet (new) wakes level too",
            [A, B],
            {"a": 7_000},
            {"a", "b"},
            {"a"},
            {},
            {"b": 7_000},
            {0: 7_000},
        ),
    ],
)
def test_lift_waking(name, jobs, accounts, active, was_active, floors, lifted, new_floors):
    got, got_floors = lift_waking(accounts, jobs, active, was_active, floors)
    assert got == lifted, name
    assert got_floors == pytest.approx(new_floors), name


def test_active_jobs_have_waiting_or_running_samples():
    from tltd.domain import RequestStatus
    from tltd.supervisor.work_queue import WorkQueue

    q = WorkQueue()

    def add(rid: str, job: str) -> None:
        req = RolloutRequest(rid, job, ((1, 2),), SamplingParams(n=2, max_new_tokens=8))
        q.add(req, 0, set(), 0.0)

    add("waiting", "a")
    add("running", "b")
    q.take("running", 0, 2, "w0")
    add("cancelled", "c")
    q.close("cancelled", RequestStatus.CANCELLED, "stop")  # nothing will run
    add("done", "d")
    q.take("done", 0, 2, "w0")
    q.finish("done", (0, 0))
    q.finish("done", (0, 1))
    assert active_jobs(q) == {"a", "b"}


def test_fair_share_remembers_who_was_busy_between_ticks():
    fair = FairShare()
    served = fair.served  # the counter the supervisor adds served tokens to
    served.update({"a": 50_000, "b": 1_000})
    jobs = [A, B]
    assert fair.accounts(jobs, {"a"}) is served
    served["a"] += 10_000  # a works alone
    assert fair.accounts(jobs, {"a", "b"}) == {"a": 60_000, "b": 60_000}  # b wakes level
    served["b"] += 500
    assert fair.accounts(jobs, {"a", "b"})["b"] == 60_500  # still busy: not lifted again
    fair.accounts(jobs, {"a"})  # b idle ...
    served["a"] += 5_000
    assert fair.accounts(jobs, {"a", "b"})["b"] == 65_000  # ... and back: level again


# ---- a returning job on a single worker (the scheduler fed by the accounts) ----------------

CFG = SchedulerConfig(max_samples_per_worker=8, share_quantum_tokens=4_000)
TOKENS = 100  # per sample; a tick serves one batch: 8 x 100 = 800 tokens


def _run(fair: FairShare, worker: list[str], active: set[str], ticks: int) -> list[str]:
    """`ticks` scheduling ticks of one worker: each tick either switches the (empty) worker to
    the job the scheduler says, or serves one full batch of its job. Returns, per tick, the job
    the worker served ("" for a switch)."""
    jobs = [A, B]
    out = []
    for t in range(ticks):
        accounts = fair.accounts(jobs, active)
        views = tuple(JobView(j.job_id, served_tokens=accounts[j.job_id]) for j in jobs)
        pending = tuple(PendingWork(f"{j}{t}", 0, j, 8, TOKENS, float(t)) for j in sorted(active))
        snap = Snapshot(
            float(t),
            (DeviceView("cpu:0", True),),
            (RolloutWorkerView("w0", "cpu:0", worker[0], True),),
            (),
            pending,
            views,
        )
        d = schedule(snap, CFG)
        if d.switches:
            worker[0] = d.switches[0].job_id
            out.append("")
            continue
        served = sum(a.samples for a in d.assignments) * TOKENS
        fair.served[worker[0]] += served
        out.append(worker[0] if served else "")
    return out


def test_a_job_back_from_idle_does_not_hold_the_only_worker_to_catch_up():
    fair, worker = FairShare(), ["a"]
    _run(fair, worker, {"a", "b"}, 40)  # both busy: they take turns
    _run(fair, worker, {"a"}, 500)  # b idle: a alone is served 400k tokens
    after = _run(fair, worker, {"a", "b"}, 60)  # b is back
    # b gets the worker (it waits its turn: it is level, not owed) ...
    assert "b" in after
    first_b = after.index("b")
    # ... and gives it back once it leads by a quantum (it took the worker a quantum behind),
    # instead of holding it for the ~400k tokens a whole-life account would owe it.
    assert "a" in after[first_b:], after
    tenure = after[first_b : first_b + after[first_b:].index("a")]
    assert tenure.count("b") * 8 * TOKENS <= 2 * CFG.share_quantum_tokens + 8 * TOKENS, after
