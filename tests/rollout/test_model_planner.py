"""ModelPlanner: a drafter version that failed to load is not sent to workers again."""

from __future__ import annotations

import asyncio
import queue

from tltd.domain import Device, DeviceKind, Job
from tltd.settings import Settings
from tltd.supervisor.models import ModelPlanner
from tltd.supervisor.worker_process import WorkerSlot
from workers.rollout import protocol as msg


class _Alive:
    def is_alive(self) -> bool:
        return True


class _Store:
    """Only what `_sync_drafter` reads: where a drafter version lives."""

    def get_drafter(self, job_id: str, version: int):
        return type("D", (), {"path": f"/drafters/{job_id}/{version}"})()


def _slot() -> WorkerSlot:
    slot = WorkerSlot("w0", Device("cpu:0", DeviceKind.CPU, 0))
    slot.proc, slot.outbox = _Alive(), queue.Queue()
    slot.job_id = "job"
    return slot


def test_a_failed_drafter_version_is_not_retried():
    planner = ModelPlanner(_Store(), Settings())  # type: ignore[arg-type]
    slot, job = _slot(), Job("job", "/m", drafter_version=7)

    asyncio.run(planner._sync_drafter(slot, job))
    sent = slot.outbox.get_nowait()
    assert sent == msg.SetDrafter("/drafters/job/7", 7)

    # The worker reports the failure with the drafter's version (not the policy's) ...
    assert planner.load_failed(msg.LoadFailed("job", 7, "bad tensor", drafter=True)) is None
    slot.loading = False
    asyncio.run(planner._sync_drafter(slot, job))
    assert slot.outbox.empty()  # ... so the same version is not sent again (no reload loop)

    # A newer version is tried.
    asyncio.run(planner._sync_drafter(slot, Job("job", "/m", drafter_version=8)))
    assert slot.outbox.get_nowait().version == 8
