"""A drafter trainer's pid is in the store while its model still loads (else its GPU use would
look foreign and the device would be vacated); a trainer that never gets ready is killed."""

from __future__ import annotations

import asyncio

from tests.training.conftest import training_settings
from tltd.devices import cpu_devices
from tltd.domain import Job, WorkerState
from tltd.drafter_training import DrafterTraining
from tltd.drafter_training.process import TrainerProcess


def test_trainer_pid_is_recorded_before_its_model_is_loaded(sqlite_store, tmp_path, monkeypatch):
    store = sqlite_store
    store.jobs.create(Job("job", str(tmp_path / "policy")))
    store.devices.upsert(cpu_devices(1))
    seen = {}

    def loading(self, kind, timeout=60.0):  # the model "loads" until we have looked
        row = next(w for w in store.workers.list() if w.worker_id == "drafter-job")
        seen.update(pid=row.pid, proc_pid=self.proc.pid, state=row.state, proc=self.proc)
        raise TimeoutError("model load timed out")

    monkeypatch.setattr(TrainerProcess, "wait_for", loading)
    training = DrafterTraining(store, training_settings(tmp_path))

    async def main():
        await training.start("cpu:0", "job")
        await training._runs["job"].launch

    asyncio.run(main())
    assert seen["pid"] == seen["proc_pid"] > 0 and seen["state"] is WorkerState.STARTING
    assert not seen["proc"].is_alive()  # not left loading after the failed start
    row = next(w for w in store.workers.list() if w.worker_id == "drafter-job")
    assert row.state is WorkerState.FAILED and "timed out" in row.state_reason
