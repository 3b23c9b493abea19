"""ModelPlanner: a version that failed to load is held back (with a backoff), not for good."""

from __future__ import annotations

import asyncio
import queue
from pathlib import Path

from tltd.contract import rollout_messages as msg
from tltd.domain import Device, DeviceKind, DrafterStatus, DrafterVersion, Job
from tltd.settings import Settings
from tltd.supervisor.model_planner import HeldBack, ModelPlanner
from tltd.supervisor.worker_process import Phase, WorkerHandle


class _Alive:
    def is_alive(self) -> bool:
        return True


class _Store:
    """Only what `_sync_drafter` reads: a drafter version, its directory under `root` on this
    node's storage (test_drafter_fallback.py runs the planner on real store rows)."""

    node_id = "n0"

    def __init__(self, root: Path | None = None) -> None:
        self.root = root
        self.drafters = self  # the drafter versions' repository: `get` alone

    def get(self, job_id: str, version: int) -> DrafterVersion:
        assert self.root is not None
        path = self.root / job_id / str(version)
        path.mkdir(parents=True, exist_ok=True)
        return DrafterVersion(job_id, version, 0, str(path), status=DrafterStatus.PROMOTED)


def _slot(worker_id: str = "w0") -> WorkerHandle:
    handle = WorkerHandle(worker_id, Device(f"cpu:{worker_id[1:]}", DeviceKind.CPU, 0))
    handle.proc, handle.outbox = _Alive(), queue.Queue()
    handle.job_id, handle.phase = "job", Phase.READY
    return handle


def test_a_failed_drafter_version_is_not_retried(tmp_path):
    planner = ModelPlanner(_Store(tmp_path), Settings())  # type: ignore[arg-type]
    handle, job = _slot(), Job("job", "/m", drafter_version=7)

    asyncio.run(planner._sync_drafter(handle, job))
    sent = handle.outbox.get_nowait()
    assert sent == msg.SetDrafter(str(tmp_path / "job" / "7"), 7)

    # The worker reports the failure with the drafter's version (not the policy's) ...
    assert (
        planner.load_failed(msg.LoadFailed("job", 7, "bad tensor", drafter=True), handle, {})
        is None
    )
    handle.phase = Phase.READY  # the worker's Ready after its LoadFailed
    asyncio.run(planner._sync_drafter(handle, job))
    assert handle.outbox.empty()  # ... so the same version is not sent again (no reload loop)

    # A newer version is tried.
    asyncio.run(planner._sync_drafter(handle, Job("job", "/m", drafter_version=8)))
    assert handle.outbox.get_nowait().version == 8


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_held_back_doubles_from_30s_to_10min_and_clears_on_success():
    clock = _Clock()
    held = HeldBack(clock)
    holds = []
    for _ in range(8):
        holds.append(held.fail(("job", 1)))
        assert ("job", 1) in held and held.retry_in(("job", 1)) == holds[-1]
        clock.now += holds[-1]  # the hold ends exactly now: free to try again
        assert ("job", 1) not in held and held.retry_in(("job", 1)) is None
    assert holds == [30, 60, 120, 240, 480, 600, 600, 600]
    held.fail(("job", 5))
    clock.now += 10
    assert held.fail(("job", 5)) == 20  # a second worker's failure of the same try
    clock.now += 20
    assert held.fail(("job", 5)) == 60  # the next try
    held.clear(("job", 1))  # it loaded: the next failure starts afresh
    assert held.fail(("job", 1)) == 30
    assert ("job", 2) not in held and ("other", 1) not in held  # per (job, version)


def test_a_policy_version_that_failed_to_load_is_refused_then_retried():
    clock = _Clock()
    planner = ModelPlanner(_Store(), Settings(), clock=clock)  # type: ignore[arg-type]
    handle, jobs = _slot(), {"job": Job("job", "/m", policy_version=1)}
    assert planner._target(handle, jobs, {}) == ("job", 1)  # an idle worker preloads v1

    reason = planner.load_failed(msg.LoadFailed("job", 1, "CUDA out of memory"), handle, {})
    assert reason is not None and "out of memory" in reason and "retried in 30s" in reason
    assert planner._target(handle, jobs, {}) is None  # not loaded again meanwhile
    why = planner.refusal("job", 1)
    assert why == (
        "cannot load policy version 1 of job job: its last load failed; it is retried in 30s"
    )
    clock.now += 20
    assert planner.refusal("job", 1) is not None and "retried in 10s" in planner.refusal("job", 1)
    assert planner.refusal("job", 0) is None  # the old version still runs

    clock.now += 10  # the hold is over: requests are taken and the worker tries again
    assert planner.refusal("job", 1) is None
    assert planner._target(handle, jobs, {}) == ("job", 1)
    planner.load_failed(msg.LoadFailed("job", 1, "CUDA out of memory"), handle, {})  # fails again
    assert "retried in 60s" in planner.refusal("job", 1)

    # A worker that holds the version (a Ready naming it) clears it for good.
    planner.loaded(msg.Ready(pid=1, job_id="job", policy_version=1), handle)
    assert planner.refusal("job", 1) is None
    assert "retried in 30s" in planner.load_failed(msg.LoadFailed("job", 1, "disk"), handle, {})


def test_a_failed_drafter_version_is_retried_after_its_hold(tmp_path):
    clock = _Clock()
    planner = ModelPlanner(_Store(tmp_path), Settings(), clock=clock)  # type: ignore[arg-type]
    handle, job = _slot(), Job("job", "/m", drafter_version=7)
    planner.load_failed(msg.LoadFailed("job", 7, "bad tensor", drafter=True), handle, {})
    asyncio.run(planner._sync_drafter(handle, job))
    assert handle.outbox.empty()
    clock.now += 30
    asyncio.run(planner._sync_drafter(handle, job))
    assert handle.outbox.get_nowait() == msg.SetDrafter(str(tmp_path / "job" / "7"), 7)


def test_a_version_that_fails_on_one_worker_while_another_runs_it_is_held_back_there_only():
    clock = _Clock()
    planner = ModelPlanner(_Store(), Settings(), clock=clock)  # type: ignore[arg-type]
    a, b = _slot("w0"), _slot("w1")
    a.phase, a.policy_version = Phase.READY, 1  # w0 runs v1 of the job
    b.job_id = ""
    jobs = {"job": Job("job", "/m", policy_version=1)}
    assert planner._target(b, jobs, {"job": {1}}) is None  # no job: the scheduler picks
    b.job_id = "job"
    assert planner._target(b, jobs, {"job": {1}}) == ("job", 1)

    # Out of memory on w1's device: its requests still run on w0, new ones are taken ...
    failed = msg.LoadFailed("job", 1, "CUDA out of memory")
    assert planner.load_failed(failed, b, {"w0": a, "w1": b}) is None
    assert planner.refusal("job", 1) is None
    # ... and w1 does not retry it in a loop, while w0 would still be pointed at it.
    assert planner._target(b, jobs, {"job": {1}}) is None
    assert planner._target(a, jobs, {"job": {1}}) == ("job", 1)
    clock.now += 30
    assert planner._target(b, jobs, {"job": {1}}) == ("job", 1)  # retried after its hold

    # With no other worker running it, the version itself is held back (requests fail).
    a.phase = Phase.STARTING
    reason = planner.load_failed(failed, b, {"w0": a, "w1": b})
    assert reason is not None and planner.refusal("job", 1) is not None


def test_held_back_survives_a_long_failure_loop():
    # Days of failures in a row (a version that never loads) must not overflow the backoff
    # (2.0 ** 1024 raises OverflowError, which would break every tick).
    clock = _Clock()
    held = HeldBack(clock)
    for _ in range(1100):
        clock.now += held.fail(("job", 1))
    assert held.fail(("job", 1)) == 600


def test_the_worker_restart_backoff_is_capped_for_any_crash_loop():
    from tltd.supervisor.rollout_workers import restart_backoff

    assert [restart_backoff(n) for n in range(8)] == [0, 0.5, 1, 2, 4, 8, 16, 30]
    assert restart_backoff(5000) == 30  # no OverflowError after hours of crashes


class _Busy:
    """A work queue whose only worker has samples in flight and nothing else waits."""

    def pending_work(self) -> list:
        return []

    def inflight(self, worker_id: str) -> int:
        return 3


class _Versions:
    """The store's policy versions: version 1 of the job was recorded from `path`."""

    node_id = "n0"

    def __init__(self, path: str) -> None:
        self.path = path
        self.policies = self  # the policy versions' repository: `get` alone

    def get(self, job_id: str, version: int):
        return type("PolicyVersion", (), {"path": self.path})()


def test_an_engine_in_a_recorded_broadcast_switches_with_its_samples_waiting():
    """An SGLang engine that received a broadcast holds its samples (none runs) until that
    version loads: the planner sends it the load although work is in flight; an engine whose
    broadcast is not the recorded version keeps its samples and version."""
    job = Job("job", "/m", policy_version=1)
    planner = ModelPlanner(_Versions("/v/job/u1"), Settings())  # type: ignore[arg-type]
    handle = _slot()
    handle.broadcast_path = "/v/job/u1"
    asyncio.run(planner.plan({"w0": handle}, _Busy(), {"job": job}))  # type: ignore[arg-type]
    assert handle.outbox.get_nowait() == msg.LoadPolicy("/v/job/u1", 1)
    assert handle.phase is Phase.LOADING

    other = _slot("w1")
    other.broadcast_path = "/v/job/u2"  # a broadcast that did not become version 1
    asyncio.run(planner.plan({"w1": other}, _Busy(), {"job": job}))  # type: ignore[arg-type]
    assert other.outbox.empty() and other.phase is Phase.READY
