"""Admission reads the job and the devices from the scheduler's last read while nothing in it
can have changed, and from the store once something did (real store, real Supervisor, not
started: no workers are needed to admit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.support import make_settings, seed_devices, write_model_dir
from tltd.domain import JobStatus, NewJob, RolloutRequest, SamplingParams
from tltd.errors import FailedPrecondition
from tltd.services import build_services
from tltd.store import Store
from tltd.supervisor import Supervisor


def test_admission_uses_the_ticks_read_until_a_write(store: Store, tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    seed_devices(store, 1)
    sup = Supervisor(store, settings)
    services = build_services(store, settings, None, sup)
    services.jobs.create(NewJob(job_id="job", model_path=str(write_model_dir(tmp_path / "m"))))
    req = RolloutRequest("r1", "job", ((5, 6, 7),), SamplingParams(n=1, max_new_tokens=4))
    sup.state.read()  # what a tick would have read

    reads = []
    real = store.jobs.job_and_devices
    store.jobs.job_and_devices = lambda job_id: reads.append(job_id) or real(job_id)
    assert services.rollouts.prepare(req).request_id == "r1"
    assert reads == []  # the tick's read served it

    store.jobs.set_status("job", JobStatus.CANCELLED, "trainer finished")  # a write: read again
    with pytest.raises(FailedPrecondition, match="job_id") as info:
        services.rollouts.prepare(req)
    assert "cancelled" in str(info.value) and reads == ["job"]
