"""LISTEN/NOTIFY on PostgreSQL: writes of one node wake the others on commit."""

from __future__ import annotations

import queue
from dataclasses import replace

import pytest

from tests.store.test_store_api import JOB, SAMPLING
from tltd.domain import FinishReason, RequestStatus, RolloutRequest, Sample
from tltd.store import Store
from tltd.store.notifications import REQUEST, SAMPLE, STATE, WORK, Listener


@pytest.mark.postgres
def test_stored_samples_new_work_and_ended_requests_are_notified(pg_store: Store) -> None:
    got: queue.Queue = queue.Queue()
    listener = Listener(
        pg_store.url, lambda ch, payload, _own: ch != STATE and got.put((ch, payload))
    ).start()
    try:
        assert listener.connected.wait(10)
        pg_store.jobs.create(JOB)
        pg_store.requests.create(RolloutRequest("r1", JOB.job_id, ((1, 2),), SAMPLING))
        assert got.get(timeout=5) == (WORK, "r1")
        pg_store.samples.add(Sample("r1", 0, 0, (7,), (-0.5,), FinishReason.STOP))
        assert got.get(timeout=5) == (SAMPLE, "r1")
        pg_store.requests.set_status("r1", RequestStatus.CANCELLED, "stop")
        assert got.get(timeout=5) == (REQUEST, "r1")
        pg_store.requests.set_status("r1", RequestStatus.CANCELLED, "again")  # no change
        with pytest.raises(queue.Empty):
            got.get(timeout=1.0)
    finally:
        listener.stop()


@pytest.mark.postgres
def test_writes_of_what_a_tick_reads_move_the_other_nodes_counts(pg_store: Store) -> None:
    other = Store(pg_store.url, node_id="node-b")  # another node on the same database
    got: queue.Queue = queue.Queue()

    def heard(channel: str, payload: str, _own: bool) -> None:
        if channel == STATE:
            other.db.scheduling_writes.changed_elsewhere(payload)
            got.put(payload)

    listener = Listener(pg_store.url, heard).start()
    try:
        assert listener.connected.wait(10)
        before = other.db.scheduling_writes.generation
        pg_store.jobs.create(JOB)  # a job created on this node
        assert got.get(timeout=5) == pg_store.db.scheduling_writes.origin
        assert other.db.scheduling_writes.generation == before + 1
        pg_store.requests.create(RolloutRequest("r1", JOB.job_id, ((1, 2),), SAMPLING))
        with pytest.raises(queue.Empty):  # not what a tick reads: nothing sent
            got.get(timeout=1.0)
        other.jobs.create(replace(JOB, job_id="job-b"))  # its own write moves it once
        assert got.get(timeout=5) == other.db.scheduling_writes.origin  # heard back: not again
        assert other.db.scheduling_writes.generation == before + 2
    finally:
        listener.stop()
        other.close()


@pytest.mark.postgres
def test_a_node_tells_its_own_notifications_from_another_node_s(pg_store: Store) -> None:
    """Each notification carries its sender's backend pid: the node's own writes are `own`
    (its streams had them as events), another node's are not, also once a connection of the
    pool was closed and another opened."""
    other = Store(pg_store.url, node_id="node-b")
    got: queue.Queue = queue.Queue()
    listener = Listener(
        pg_store.url,
        lambda ch, payload, own: ch == SAMPLE and got.put((payload, own)),
        pg_store.db.own_backends,
    ).start()
    try:
        assert listener.connected.wait(10)
        pg_store.jobs.create(JOB)
        for rid in ("mine", "theirs"):
            pg_store.requests.create(RolloutRequest(rid, JOB.job_id, ((1, 2),), SAMPLING))
        pg_store.samples.add(Sample("mine", 0, 0, (7,), (-0.5,), FinishReason.STOP))
        assert got.get(timeout=5) == ("mine", True)
        other.samples.add(Sample("theirs", 0, 0, (7,), (-0.5,), FinishReason.STOP))
        assert got.get(timeout=5) == ("theirs", False)
        pg_store.db.engine.dispose()  # every pooled session closed: new ones, new pids
        pg_store.samples.add(Sample("mine", 0, 1, (7,), (-0.5,), FinishReason.STOP))
        assert got.get(timeout=5) == ("mine", True)
    finally:
        listener.stop()
        other.close()
