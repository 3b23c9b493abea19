"""No drafter training starts for a job while its UpdatePolicy is being applied.

A supervisor with real rollout worker processes and a training hook that always has enough
fresh data: training for the job would start on every tick its device is idle. The policy
update goes through the real PolicyService; the test records every scheduling tick.
"""

from __future__ import annotations

import asyncio
import time

from tests.api.support import make_settings, seed_devices
from tltd import scheduler
from tltd.services import build_services
from tltd.services.jobs import NewJob
from tltd.supervisor import Supervisor


class HungryTraining:
    """A TrainingHook whose job is always eligible (fresh data, never trained, not holding)."""

    def __init__(self) -> None:
        self.starts: list[str] = []

    def views(self):
        return ()

    def job_view(self, job_id):
        return 10_000, None

    def on_sample(self, job_id, prompt, sample) -> None:
        pass

    async def start(self, device_id, job_id) -> None:
        self.starts.append(job_id)

    async def preempt(self, device_id, reason) -> None:
        pass


async def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


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
    settings = make_settings(
        tmp_path,
        cpu_slots=1,
        worker_max_batch=16,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        training_idle_grace_seconds=0.0,
    )
    seed_devices(sqlite_store, 1)

    async def main() -> None:
        hook = HungryTraining()
        sup = Supervisor(sqlite_store, settings, training=hook)
        services = build_services(sqlite_store, settings, None, sup)
        await sup.start()
        try:
            services.jobs.create(NewJob(job_id="job", model_path=str(ckpt)))
            sup.kick()
            [slot] = sup.slots.values()
            await _until(lambda: slot.job_id == "job" and not slot.loading, "version 0 loaded")
            await _until(lambda: hook.starts, "training starts while nothing loads")

            ticks.clear()
            assert services.policy.update("job", "checkpoint", str(ckpt2)).version == 1
            await _until(lambda: slot.policy_version == 1 and not slot.loading, "version 1 loaded")
            n = len(hook.starts)
            await _until(lambda: len(hook.starts) > n, "training starts again after the load")
        finally:
            await sup.stop()

    asyncio.run(main())
    during = [t for t in ticks if t[1]]  # ticks while the worker loaded version 1
    assert during, ticks  # the tick that sent LoadPolicy is one of them
    assert all(updating for updating, *_ in during)  # set from the real path,
    assert not any(started for *_, started in during)  # so no training started meanwhile;
    after = ticks[ticks.index(during[-1]) + 1 :]  # cleared by the worker's Ready
    assert (False, False, True) in after and not any(updating for updating, *_ in after)
