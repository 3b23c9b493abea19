"""Load and fairness: concurrent trainers of jobs with different weights and priorities
against one real daemon (`tltd serve` in its own process, 4 CPU rollout workers, SQLite) for
a bounded time.

The scheduler (tltd/scheduler.py) ranks jobs by priority, then splits the workers among
equal-priority jobs with waiting work in proportion to their weights. With weights 2:1:1 on
four workers each job's share of worker-seconds should be 1/2, 1/4, 1/4: checked within
+-10% (relative) over the measured window. The window starts once the split first matches
the weights (the workers load models and switch at start; how long that took is reported).
Two windows: trainers keeping more in flight than the workers hold (backlogged), then
trainers of two lanes a job, whose jobs run dry for a moment whenever both lanes are between
requests; the scheduler keeps a job's emptied workers for it for `spare_grace_seconds`, so
such a gap costs no switch (without it the split churned and came out near 1:1:1). How long
each job had more samples outstanding than its workers hold (backlogged, as its trainer sees
it) is reported per window. A priority-1 job then arrives: it gets a worker while the others
are busy. Nothing is lost: every request id sent completes with all samples.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC

import pytest

from tests.reliability.trainers import Outcome, Trainer, WorkerSampler, percentile
from tests.rollout.support import ServeProcess, wait_until
from tltd.v1.rollout_pb2 import REQUEST_STATUS_COMPLETED
from tltd_clients.client import TltClient

WEIGHTS = {"heavy": 2.0, "light-a": 1.0, "light-b": 1.0}
STEADY = {"heavy": 2, "light-a": 1, "light-b": 1}  # workers each job holds once converged
# Requests of 4 prompts x 4 samples in flight per job: 96 and 64 samples against 8 per worker,
# so every job nearly always has work waiting.
INFLIGHT = {"heavy": 6, "light-a": 4, "light-b": 4}
DRY = {"heavy": 2, "light-a": 2, "light-b": 2}  # lanes that leave gaps (see the test)
BATCH = 8  # samples a worker holds


def _split(sampler: WorkerSampler) -> dict[str, int]:
    """How many workers each job holds now."""
    held = sampler.timeline[-1][1] if sampler.timeline else ()
    return dict(Counter(j for j in held if j))


def _timeline(sampler: WorkerSampler) -> str:
    t0 = sampler.timeline[0][0]
    return "\n".join(f"{t - t0:7.2f} {held}" for t, held in sampler.timeline)


@pytest.fixture
def four_workers(migrated_sqlite_url, tmp_path):
    d = ServeProcess(
        tmp_path, migrated_sqlite_url, cpu_slots=4, start_timeout=180,
        worker_max_batch=BATCH, worker_max_seq_len=256, drafter_training="false",
    )  # fmt: skip
    try:
        yield d
    finally:
        d.kill()


def _measure(sampler: WorkerSampler, seconds: float) -> dict:
    """Worker-seconds per job over `seconds`, their shares and errors against the weights,
    how long each job was backlogged, and how often the split changed."""
    sampler.held.clear()
    sampler.backlogged.clear()
    sampler.measured = 0.0
    sampler.measuring.set()
    start = time.monotonic()
    time.sleep(seconds)
    sampler.measuring.clear()
    end = time.monotonic()
    held = {j: sampler.held[j] for j in WEIGHTS}
    total, weight_sum = sum(held.values()), sum(WEIGHTS.values())
    shares = {j: held[j] / total for j in WEIGHTS}
    return {
        "seconds": seconds,
        "worker_seconds": {j: round(v, 1) for j, v in held.items()},
        "share": {j: round(v, 3) for j, v in shares.items()},
        "share_error": {j: round(shares[j] / (WEIGHTS[j] / weight_sum) - 1, 3) for j in WEIGHTS},
        "backlogged_share": {
            j: round(sampler.backlogged[j] / sampler.measured, 2) for j in WEIGHTS
        },
        "split_changes": sum(1 for t, _ in sampler.timeline[1:] if start <= t <= end),
    }


def _trainers(target: str, lanes: dict[str, int], name: str) -> dict[str, Trainer]:
    return {
        job: Trainer(
            target, job, inflight=n, prompts=4, n=4, max_new_tokens=16, name=f"{job}-{name}"
        ).start()
        for job, n in lanes.items()
    }


def test_weighted_shares_latency_and_nothing_lost(four_workers, ckpt, size, figures):
    d = four_workers
    warmup, window = {"short": (2.0, 8.0), "long": (10.0, 300.0)}[size]
    with TltClient(d.target, timeout=120) as c:  # the machine may be loaded: generous deadlines
        for job, w in WEIGHTS.items():
            c.create_job(str(ckpt), job_id=job, weight=w)
        c.create_job(str(ckpt), job_id="urgent", priority=1)
    d.wait_workers_ready(n=4)
    trainers: dict[str, Trainer] = {}  # the sampler reads who is backlogged from the trainers
    sampler = WorkerSampler(d.target, trainers=trainers, per_worker=BATCH).start()
    trainers.update(_trainers(d.target, INFLIGHT, "deep"))
    # Warm-up: the workers load models and switch until the split matches the weights.
    started = time.monotonic()
    wait_until(lambda: _split(sampler) == STEADY, timeout=120, what="the weighted split")
    converged = time.monotonic() - started
    time.sleep(warmup)
    backlogged = _measure(sampler, window)

    # Trainers that run dry between two requests: two lanes a job, so a job's queue empties
    # whenever both lanes are between requests (a stream's end, the next admission). Started
    # before the others stop sending: no job is left without work in between.
    earlier = list(trainers.values())
    trainers.update(_trainers(d.target, DRY, "dry"))
    for t in earlier:
        t.stop_sending()
    for t in earlier:
        t.stop()
    dry = _measure(sampler, window)

    # A higher-priority job arrives while the others are busy (what they have in flight keeps
    # every worker busy for a while; they send no more from now on).
    for t in trainers.values():
        t.stop_sending()
    urgent = Trainer(d.target, "urgent", inflight=1, n=2, max_new_tokens=8)

    def send_urgent(seed: int) -> Outcome:
        with TltClient(d.target, timeout=120) as c:
            return urgent.run_one(c, random.Random(seed))

    with ThreadPoolExecutor(3) as pool:
        urgent_outcomes = list(pool.map(send_urgent, range(3)))
    for t in trainers.values():
        t.stop()
    sampler.stop()

    outcomes = [o for t in [*earlier, *trainers.values()] for o in t.outcomes.values()]
    outcomes += urgent_outcomes
    lost = [o for o in outcomes if len(o.samples) != o.expected or o.error]
    with TltClient(d.target, timeout=120) as c:
        stored = {o.request_id: c.get_request(o.request_id).request for o in outcomes}
    not_completed = [rid for rid, r in stored.items() if r.status != REQUEST_STATUS_COMPLETED]
    admission = [
        stored[o.request_id].created_at.ToDatetime(UTC).timestamp() - o.sent_wall for o in outcomes
    ]
    first = [o.first_sample - o.sent for o in outcomes if o.first_sample is not None]
    urgent_first = [o.first_sample - o.sent for o in urgent_outcomes]
    figures.update(
        converged_seconds=round(converged, 1),
        backlogged=backlogged,
        dry=dry,
        requests=len(outcomes),
        samples=sum(len(o.samples) for o in outcomes),
        lost=len(lost),
        admission_ms={"p50": round(1e3 * percentile(admission, 50), 1),
                      "p99": round(1e3 * percentile(admission, 99), 1)},
        first_sample_s={"p50": round(percentile(first, 50), 2),
                        "p99": round(percentile(first, 99), 2)},
        urgent_first_sample_s=[round(v, 2) for v in urgent_first],
    )  # fmt: skip
    assert not lost, [(o.request_id, len(o.samples), o.expected, o.error) for o in lost][:5]
    assert not not_completed, not_completed[:5]
    print(_timeline(sampler))  # shown when the test fails
    for name, m in (("backlogged", backlogged), ("dry", dry)):
        for job, err in m["share_error"].items():
            assert abs(err) <= 0.10, (name, job, m)
    # The priority-1 job is served although every worker was busy with the others.
    assert all(o.first_sample is not None for o in urgent_outcomes)
