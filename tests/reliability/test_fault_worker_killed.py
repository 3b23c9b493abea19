"""A rollout worker killed mid-batch (SIGKILL: what the kernel's OOM killer sends a process
over its memory limit) while trainers keep requests in flight: the daemon starts a new worker,
the killed worker's samples run again, and every request completes with each of its samples
exactly once.

The kill is sent by the test rather than provoked through a memory cgroup: this machine's
memory cgroup is the one the whole session runs in, which the tests leave alone.
"""

from __future__ import annotations

import os
import signal
import time

from tests.reliability.trainers import Trainer
from tests.rollout.support import pid_alive, wait_until
from tltd.v1.rollout_pb2 import REQUEST_STATUS_COMPLETED
from tltd_clients.client import TltClient


def _busy_worker(c: TltClient, job: str) -> tuple[str, int]:
    """A worker running `job`'s samples now (waits for one)."""
    found: list = []

    def busy() -> bool:
        found[:] = [
            w
            for w in c.list_workers()
            if w.kind == "rollout" and w.job_id == job and w.state == "busy" and w.pid
        ]
        return bool(found)  # fmt: skip

    wait_until(busy, timeout=120, what=f"a worker busy with {job}")
    return found[0].worker_id, found[0].pid


def test_killed_workers_samples_run_again(sqlite_serve, ckpt, size, figures):
    kills, between = {"short": (1, 2.0), "long": (20, 10.0)}[size]
    d, job = sqlite_serve, f"kill-{size}"
    killed = []
    log_start = len(d.logs())
    with TltClient(d.target, timeout=120) as c:
        c.create_job(str(ckpt), job_id=job)
        trainer = Trainer(d.target, job, inflight=4, prompts=2, n=4, max_new_tokens=32).start()
        for _ in range(kills):
            time.sleep(between)
            worker_id, pid = _busy_worker(c, job)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            wait_until(lambda p=pid: not pid_alive(p), timeout=30, what="worker gone")
            # A new process takes the device's place.
            wait_until(
                lambda w=worker_id, p=pid: any(
                    x.worker_id == w and x.pid not in (0, p) for x in c.list_workers()
                ),
                timeout=120,
                what="worker restarted",
            )
        time.sleep(between)
        trainer.stop(timeout=300)
        stored = {rid: c.get_request(rid).request for rid in trainer.outcomes}
        c.cancel_job(job)
    outcomes = list(trainer.outcomes.values())
    incomplete = [o for o in outcomes if len(o.samples) != o.expected or o.error]
    logged = [
        r.get("msg", "") for r in d.logs()[log_start:] if r.get("level") in ("error", "warning")
    ]
    figures.update(
        kills=len(killed),
        requests=len(outcomes),
        samples=sum(len(o.samples) for o in outcomes),
        retried_client_errors=sorted({e.split(":")[0] for o in outcomes for e in o.retried}),
        lost=len(incomplete),
        daemon_log=sorted(set(logged))[:5],
    )
    assert not incomplete, [(o.request_id, len(o.samples), o.expected, o.error) for o in incomplete]
    for o in outcomes:
        r = stored[o.request_id]
        assert r.status == REQUEST_STATUS_COMPLETED and r.samples_done == o.expected, r
