"""The store's count of committed writes to what a scheduler tick reads, and the tick's reuse of
its last read: on the real databases."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tltd.devices import cpu_devices
from tltd.domain import (
    DeviceState,
    DrafterStatus,
    DrafterVersion,
    Job,
    JobStatus,
    RolloutRequest,
    SamplingParams,
)
from tltd.store import Store
from tltd.supervisor.tick_state import TickState

JOB = Job(job_id="job-1", model_path="/models/tiny", name="grpo")


def _moves(store: Store, write) -> bool:
    before = store.db.scheduling_writes.generation
    write()
    return store.db.scheduling_writes.generation != before


def test_writes_to_jobs_devices_and_drafters_move_the_count(store: Store) -> None:
    assert _moves(store, lambda: store.jobs.create(JOB))
    device = cpu_devices(1)[0]
    assert _moves(store, lambda: store.devices.upsert([device]))
    assert _moves(
        store, lambda: store.devices.set_state(device.device_id, DeviceState.ROLLOUT, "busy")
    )
    dv = DrafterVersion(JOB.job_id, 1, 0, "/d/1", status=DrafterStatus.PROMOTED)
    assert _moves(store, lambda: store.drafters.add(dv))
    assert _moves(store, lambda: store.jobs.set_status(JOB.job_id, JobStatus.CANCELLED, "done"))


def test_reads_and_other_tables_leave_it(store: Store) -> None:
    store.jobs.create(JOB)
    assert not _moves(store, lambda: store.jobs.devices_and_jobs([JobStatus.ACTIVE]))
    req = RolloutRequest(
        request_id="r1", job_id=JOB.job_id, prompts=((1, 2),), sampling=SamplingParams(n=1)
    )
    assert not _moves(store, lambda: store.requests.create(req))


def test_a_refused_write_leaves_it(store: Store) -> None:
    store.jobs.create(JOB)
    with pytest.raises(Exception, match="job"):
        store.jobs.create(replace(JOB, model_path="/elsewhere"))
    assert store.db.scheduling_writes.generation == 1  # the first create only


def test_the_tick_reuses_its_read_until_a_write_or_its_age(store: Store) -> None:
    state = TickState(store, max_age=0.3)
    assert state.reusable() is None
    state.read()
    assert state.reusable() == ([], {})
    store.jobs.create(JOB)  # a write of what the tick reads: read again
    assert state.reusable() is None
    _, jobs = state.read()
    assert list(jobs) == [JOB.job_id]
    assert state.reusable() is not None
    time.sleep(0.35)  # another node's writes are not counted: the read ages out
    assert state.reusable() is None
    assert state.reads == 2
