"""Soak: a bounded mixed workload against one `tltd serve` (rollouts from several trainer
lanes, reads of requests, jobs, stats and workers, cancels, policy updates, refused calls)
with the daemon's resident memory and open file descriptors sampled once a second.

Bounds (after a warm-up of the first quarter of the run, in which caches, pools and the
allocator's arenas fill): resident memory grows by at most RSS_BOUND_MB from the warm-up's
end to the run's end, and the open descriptors by at most FD_BOUND. The short variant runs
in CI; `TLTD_RELIABILITY_LONG=1` runs the long one (TLTD_SOAK_SECONDS, default 1800).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from tests.reliability.trainers import Trainer
from tltd.v1 import rollout_pb2
from tltd_clients.client import TltClient
from tltd_clients.errors import FailedPreconditionError, NotFoundError, TltClientError

RSS_BOUND_MB = 40.0
FD_BOUND = 8


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _chatter(
    target: str, ids: list[str], stop: threading.Event, calls: dict, unexpected: list[str]
) -> None:
    """Everything but rollouts: reads, cancels and refused calls. The refusals the mix asks
    for (NOT_FOUND: an id not yet used; FAILED_PRECONDITION: a cancel of a finished request)
    are expected; any other error (INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED...) is recorded."""
    rng = random.Random(7)
    with TltClient(target, timeout=120) as c:
        while not stop.is_set():
            op = rng.choice(["get", "get", "list", "stats", "workers", "cancel", "bad"])
            try:
                if op == "get" and ids:
                    c.get_request(rng.choice(ids), include_samples=rng.random() < 0.5)
                elif op == "list":
                    c.list_jobs()
                elif op == "stats":
                    c.stats()
                elif op == "workers":
                    c.list_workers()
                elif op == "cancel" and ids:
                    c.cancel_request(rng.choice(ids), reason="soak")
                elif op == "bad":
                    c.get_job("no-such-job")
            except (NotFoundError, FailedPreconditionError):
                pass  # refused calls are part of the mix
            except TltClientError as exc:
                unexpected.append(f"{op}: {exc}")
            calls[op] = calls.get(op, 0) + 1
            time.sleep(0.02)


def test_memory_and_descriptors_stay_bounded(sqlite_serve, ckpt, ckpt2, size, figures):
    d = sqlite_serve
    seconds = {"short": 16.0, "long": float(os.environ.get("TLTD_SOAK_SECONDS", "1800"))}[size]
    every = 5 if size == "short" else 15  # seconds between policy updates
    job = f"soak-{size}"
    pid = d.proc.pid
    with TltClient(d.target, timeout=120) as c:
        c.create_job(str(ckpt), job_id=job)
        trainer = Trainer(d.target, job, inflight=3, prompts=2, n=2, max_new_tokens=24).start()
        stop, calls, unexpected = threading.Event(), {}, []
        ids = [f"{job}-{i:05d}" for i in range(1, 200)]
        chatter = threading.Thread(target=_chatter, args=(d.target, ids, stop, calls, unexpected))
        chatter.start()
        samples, pushes = [], 0
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            samples.append((elapsed, _rss_mb(pid), _fds(pid)))
            if len(samples) % every == 0:  # a policy update, alternating weights
                path = ckpt2 if pushes % 2 == 0 else ckpt
                c.update_policy(job, str(path), note="soak")
                pushes += 1
            time.sleep(1.0)
        stop.set()
        chatter.join(60)
        trainer.stop(timeout=300)
        samples.append((time.monotonic() - started, _rss_mb(pid), _fds(pid)))
        short = [o for o in trainer.outcomes.values() if len(o.samples) != o.expected]
        status = {o.request_id: c.get_request(o.request_id).request.status for o in short}
        c.cancel_job(job)
    warm = [s for s in samples if s[0] <= seconds / 4]
    rest = [s for s in samples if s[0] > seconds / 4]
    rss_growth = max(s[1] for s in rest[-5:]) - max(s[1] for s in warm[-5:])
    fd_growth = max(s[2] for s in rest) - max(s[2] for s in warm)
    outcomes = list(trainer.outcomes.values())
    cancelled = [o for o in short if status[o.request_id] == rollout_pb2.REQUEST_STATUS_CANCELLED]
    figures.update(
        seconds=round(samples[-1][0]),
        requests=len(outcomes),
        samples=sum(len(o.samples) for o in outcomes),
        cancelled_by_the_mix=len(cancelled),
        other_calls=calls,
        unexpected_errors=len(unexpected),
        policy_pushes=pushes,
        rss_mb={"start": round(samples[0][1], 1), "after_warmup": round(warm[-1][1], 1),
                "end": round(samples[-1][1], 1), "max": round(max(s[1] for s in samples), 1)},
        fds={"start": samples[0][2], "after_warmup": warm[-1][2], "end": samples[-1][2],
             "max": max(s[2] for s in samples)},
        rss_growth_after_warmup_mb=round(rss_growth, 1),
        fd_growth_after_warmup=fd_growth,
    )  # fmt: skip
    # Every request ended: completed with all samples, or cancelled by the mix's cancels.
    assert [o.request_id for o in short if o not in cancelled] == []
    assert unexpected == []
    assert rss_growth <= RSS_BOUND_MB, samples
    assert fd_growth <= FD_BOUND, samples
