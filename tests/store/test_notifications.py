"""LISTEN/NOTIFY on PostgreSQL: writes of one node wake the others on commit."""

from __future__ import annotations

import queue

import pytest

from tests.store.test_store_api import JOB, SAMPLING
from tltd.domain import FinishReason, RequestStatus, RolloutRequest, Sample
from tltd.store import Store
from tltd.store.notifications import REQUEST, SAMPLE, WORK, Listener


@pytest.mark.postgres
def test_stored_samples_new_work_and_ended_requests_are_notified(pg_store: Store) -> None:
    got: queue.Queue = queue.Queue()
    listener = Listener(pg_store.url, lambda ch, payload: got.put((ch, payload))).start()
    try:
        assert listener.connected.wait(10)
        pg_store.create_job(JOB)
        pg_store.create_request(RolloutRequest("r1", JOB.job_id, ((1, 2),), SAMPLING))
        assert got.get(timeout=5) == (WORK, "r1")
        pg_store.add_sample(Sample("r1", 0, 0, (7,), (-0.5,), FinishReason.STOP))
        assert got.get(timeout=5) == (SAMPLE, "r1")
        pg_store.set_request_status("r1", RequestStatus.CANCELLED, "stop")
        assert got.get(timeout=5) == (REQUEST, "r1")
        pg_store.set_request_status("r1", RequestStatus.CANCELLED, "again")  # no change
        with pytest.raises(queue.Empty):
            got.get(timeout=1.0)
    finally:
        listener.stop()
