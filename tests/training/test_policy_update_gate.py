"""No drafter training starts for a job while its UpdatePolicy is being applied.

A supervisor with real rollout worker processes and a training hook that always has enough
fresh data: training for the job would start on every tick its device is idle. The policy
update goes through the real PolicyService; the test records every scheduling tick. The race
tests land the update (deterministically, no sleeps) between a tick's read of the jobs and its
training start, or hold its store write open across a whole tick.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.api.support import make_settings, seed_devices
from tests.training.conftest import until
from tltd import scheduler
from tltd.services import build_services
from tltd.services.jobs import NewJob
from tltd.supervisor import Supervisor
from tltd.supervisor.policy_updates import PolicyUpdates
from tltd.supervisor.training_hook import JobTraining
from tltd.supervisor.worker_process import Phase


class HungryTraining:
    """A TrainingHook whose job is always eligible (fresh data, never trained, not holding)."""

    def __init__(self) -> None:
        self.starts: list[str] = []

    def views(self):
        return ()

    def job_view(self, job_id):
        return JobTraining(10_000, None, False)

    def on_sample(self, job_id, prompt, sample) -> None:
        pass

    async def start(self, device_id, job_id) -> None:
        self.starts.append(job_id)

    async def preempt(self, device_id, reason) -> None:
        pass


def _settings(tmp_path):
    """One CPU slot; training may start the moment the device is idle."""
    return make_settings(
        tmp_path,
        cpu_slots=1,
        worker_max_batch=16,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        training_idle_grace_seconds=0.0,
    )


def test_training_waits_while_workers_load_the_new_policy(
    sqlite_store, tmp_path, ckpt, ckpt2, monkeypatch
):
    ticks: list[tuple[bool, bool, bool]] = []  # (updating, a worker loading, training started)
    real_schedule = scheduler.schedule

    def recording_schedule(snap, cfg):
        decision = real_schedule(snap, cfg)
        [job] = [j for j in snap.jobs if j.job_id == "job"] or [None]
        if job is not None:
            loading = any(not w.ready for w in snap.workers)
            ticks.append((job.policy_updating, loading, bool(decision.start_training)))
        return decision

    monkeypatch.setattr("tltd.supervisor.supervisor.schedule", recording_schedule)
    settings = _settings(tmp_path)
    seed_devices(sqlite_store, 1)

    async def main() -> None:
        hook = HungryTraining()
        sup = Supervisor(sqlite_store, settings, training=hook)
        services = build_services(sqlite_store, settings, None, sup)
        await sup.start()
        try:
            services.jobs.create(NewJob(job_id="job", model_path=str(ckpt)))
            sup.kick()
            [handle] = sup.handles.values()
            await until(
                lambda: handle.job_id == "job" and handle.phase is Phase.READY, "version 0 loaded"
            )
            await until(lambda: hook.starts, "training starts while nothing loads")

            ticks.clear()
            assert services.policy.update("job", "checkpoint", str(ckpt2)).version == 1
            await until(
                lambda: handle.policy_version == 1 and handle.phase is Phase.READY,
                "version 1 loaded",
            )
            n = len(hook.starts)
            await until(lambda: len(hook.starts) > n, "training starts again after the load")
        finally:
            await sup.stop()

    asyncio.run(main())
    during = [t for t in ticks if t[1]]  # ticks while the worker loaded version 1
    assert during, ticks  # the tick that sent LoadPolicy is one of them
    assert all(updating for updating, *_ in during)  # set from the real path,
    assert not any(started for *_, started in during)  # so no training started meanwhile;
    after = ticks[ticks.index(during[-1]) + 1 :]  # cleared by the worker's Ready
    assert (False, False, True) in after and not any(updating for updating, *_ in after)


class RacingSupervisor:
    """A supervisor with one real worker and a hungry training hook, whose `schedule` calls
    `race(decision)` on every tick that sees the job.

    `ticks` holds every such tick's (number, whether its decision starts training for the
    job); `starts` every training start actually made as (tick number, the policy version the
    worker held then)."""

    def __init__(self, store, tmp_path, monkeypatch, race) -> None:
        self.ticks: list[tuple[int, bool]] = []
        self.starts: list[tuple[int, int]] = []
        real_schedule = scheduler.schedule

        def racing_schedule(snap, cfg):
            decision = real_schedule(snap, cfg)
            if any(j.job_id == "job" for j in snap.jobs):
                starts = any(t.job_id == "job" for t in decision.start_training)
                self.ticks.append((len(self.ticks), starts))
                race(decision)
            return decision

        monkeypatch.setattr("tltd.supervisor.supervisor.schedule", racing_schedule)
        settings = _settings(tmp_path)
        seed_devices(store, 1)
        hook = HungryTraining()
        self.sup = Supervisor(store, settings, training=hook)
        self.services = build_services(store, settings, None, self.sup)

        async def start(device_id, job_id) -> None:  # runs in the tick that decided it
            self.starts.append((self.ticks[-1][0], self.handle.policy_version))

        hook.start = start  # type: ignore[method-assign]

    @property
    def handle(self):
        [handle] = self.sup.handles.values()
        return handle

    async def start(self, ckpt) -> None:
        """Start; the worker holds version 0 of `job`, training has started at least once."""
        await self.sup.start()
        self.services.jobs.create(NewJob(job_id="job", model_path=str(ckpt)))
        self.sup.kick()
        await until(
            lambda: self.handle.job_id == "job" and self.handle.phase is Phase.READY, "v0 loaded"
        )
        await until(lambda: self.starts, "training starts while nothing loads")


def test_an_update_written_after_a_tick_read_the_jobs_drops_that_ticks_training_start(
    sqlite_store, tmp_path, ckpt, ckpt2, monkeypatch
):
    """UpdatePolicy's store write lands between the tick's read of the jobs and its training
    start: the snapshot (version 0, nothing loading) lets the scheduler start training; the
    supervisor must drop that start. (Without the fix training started on version 0.)"""
    armed, raced = threading.Event(), []

    def race(decision) -> None:
        if armed.is_set() and decision.start_training:
            armed.clear()
            assert r.services.policy.update("job", "checkpoint", str(ckpt2)).version == 1
            raced.append(r.ticks[-1][0])

    r = RacingSupervisor(sqlite_store, tmp_path, monkeypatch, race)

    async def main() -> None:
        await r.start(ckpt)
        try:
            armed.set()
            await until(lambda: raced, "a tick raced with the update")
            await until(
                lambda: r.handle.policy_version == 1 and r.handle.phase is Phase.READY, "v1 loaded"
            )
            n = len(r.starts)
            await until(lambda: len(r.starts) > n, "training starts again after the load")
        finally:
            await r.sup.stop()

    asyncio.run(main())
    [tick] = raced
    assert (tick, True) in r.ticks  # the stale snapshot did decide to start training,
    after = [version for t, version in r.starts if t >= tick]
    assert after and set(after) == {1}, r.starts  # but training started only on version 1


def test_an_update_in_flight_during_a_tick_drops_its_training_start(
    sqlite_store, tmp_path, ckpt, ckpt2, monkeypatch
):
    """UpdatePolicy has begun but its store write has not committed while a whole tick runs:
    the tick reads version 0 and must not start training. (Without the fix it did.)"""
    entered, release = threading.Event(), threading.Event()
    real_add = sqlite_store.policies.add

    def blocked_add(*args, **kw):
        entered.set()
        assert release.wait(60)
        return real_add(*args, **kw)

    monkeypatch.setattr(sqlite_store.policies, "add", blocked_add)
    r = RacingSupervisor(sqlite_store, tmp_path, monkeypatch, lambda decision: None)

    async def main() -> list[tuple[int, bool]]:
        await r.start(ckpt)
        try:
            update = asyncio.ensure_future(
                asyncio.to_thread(r.services.policy.update, "job", "checkpoint", str(ckpt2))
            )
            assert await asyncio.to_thread(entered.wait, 60)
            first = len(r.ticks)
            await r.sup.tick()  # at least this whole tick runs with the write in flight
            during = r.ticks[first:]
            release.set()
            assert (await update).version == 1
            return during
        finally:
            release.set()
            await r.sup.stop()

    during = asyncio.run(main())
    assert any(started for _, started in during), during  # the snapshot allowed a start,
    numbers = {t for t, _ in during}
    assert not [s for s in r.starts if s[0] in numbers], r.starts  # which was dropped


def test_policy_updates_counts_what_a_mark_missed():
    updates = PolicyUpdates()
    before = updates.mark()
    assert not updates.changed_since(before, "job")
    with updates.updating("job"):
        during = updates.mark()
        assert updates.changed_since(before, "job") and updates.changed_since(during, "job")
    after = updates.mark()
    assert updates.changed_since(before, "job")  # written after `before`: maybe not read
    assert updates.changed_since(during, "job")
    assert not updates.changed_since(after, "job") and not updates.changed_since(before, "k")
    with pytest.raises(RuntimeError), updates.updating("job"):
        raise RuntimeError("store write failed")
    assert not updates.changed_since(updates.mark(), "job")  # a failed write ends too
