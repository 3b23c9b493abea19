"""PostgreSQL restarted mid-rollout: the daemon (`tltd serve`, its own process) keeps serving
or recovers, and every request a trainer sent completes with all its samples or ends with a
reason; nothing is lost, nothing is duplicated. A Generate whose admission meets the outage
gets UNAVAILABLE (the trainer retries it with the same id); one that still ends in an error
must never have been stored, or be stored FAILED with a reason (`trainers.Accounting`).

The database is a throwaway cluster of the test's own (tests/reliability/pg_cluster.py),
restarted with a fast shutdown as `pg_ctlcluster ... restart` does, so the PostgreSQL server
other tests share is never touched.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.ci import skip_unless_ci
from tests.reliability import pg_cluster
from tests.reliability.trainers import Trainer, account
from tests.rollout.support import ServeProcess
from tltd_clients.client import TltClient


@pytest.fixture
def cluster():
    why = pg_cluster.available()
    if why:
        skip_unless_ci(why)
    c = pg_cluster.PgCluster()
    try:
        yield c
    finally:
        c.close()


@pytest.mark.postgres
def test_a_postgres_restart_mid_rollout_loses_nothing(cluster, tmp_path, ckpt, size, figures):
    restarts, between = {"short": (1, 2.0), "long": (10, 20.0)}[size]
    # A request that failed in the outage answers FAILED_PRECONDITION (final, not retried);
    # the trainer's patience bounds its retries of UNAVAILABLE (the short variant's outage is
    # ~0.2 s: 20 s is ample).
    patience = {"short": 20.0, "long": 120.0}[size]
    d = ServeProcess(
        tmp_path, cluster.url, worker_max_batch=8, worker_max_seq_len=256, start_timeout=180
    )
    try:
        with TltClient(d.target, timeout=120) as c:
            c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready("job", n=2, timeout=120)
        trainer = Trainer(
            d.target, "job", inflight=4, prompts=2, n=4, max_new_tokens=32,
            retry_seconds=patience,
        ).start()  # fmt: skip
        outages = []
        for _ in range(restarts):
            time.sleep(between)
            t0 = time.monotonic()
            cluster.restart()
            outages.append(time.monotonic() - t0)
        time.sleep(between)
        trainer.stop(timeout=300)
        with TltClient(d.target, timeout=120) as c:
            health = c.health()
            accounting = account(c, trainer)
    finally:
        d.kill()
    # The outage was felt: the daemon logged database errors while PostgreSQL was down.
    db_errors = [r["msg"] for r in d.logs() if r.get("level") == "error"]

    figures.update(
        restarts=restarts,
        restart_seconds=[round(v, 2) for v in outages],
        **accounting.figures(),
        daemon_errors_logged=dict(Counter(db_errors)),
    )
    assert db_errors, "the restart did not hit the daemon"
    assert health == "SERVING"
    assert len(accounting.outcomes) >= 4
    accounting.check_nothing_lost()
