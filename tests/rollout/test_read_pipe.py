"""The worker pipe's reader thread stores samples before the loop streams them."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from dataclasses import replace

import pytest

from tests.store.test_store_api import JOB, _request, _sample
from tltd.contract import rollout_messages as msg
from tltd.domain import Worker, WorkerKind
from tltd.store import Store
from tltd.supervisor import worker_pipe
from tltd.supervisor.worker_pipe import HeartbeatStamp, serve_pipe
from tltd.supervisor.worker_process import store_reported


def test_a_sample_that_ran_twice_streams_the_stored_copy(store: Store) -> None:
    """A retry may produce other tokens (SD vs plain, another worker); the trainer must see
    the copy the store holds, not the new one."""
    store.jobs.create(JOB)
    store.requests.create(_request())
    first = _sample(0, 1, tokens=(7, 8, 9))
    assert store.samples.add(first)
    rerun = replace(first, token_ids=(5, 5), logprobs=(-1.0, -2.0))
    fresh = _sample(1, 0, tokens=(4,))

    got: list[tuple] = []
    parent, child = multiprocessing.Pipe()
    stamp = HeartbeatStamp(store, "w0")

    async def serve() -> None:
        closed = asyncio.Event()
        serve_pipe(
            "w0",
            parent,
            asyncio.get_running_loop(),
            receive=lambda m: store_reported(store, stamp, m),
            deliver=got.append,
            closed=closed.set,
        )
        child.send(msg.Finished(rerun))
        child.send(msg.Finished(fresh))
        child.close()
        await asyncio.wait_for(closed.wait(), 30)

    asyncio.run(serve())

    (dup, dup_stored, _), (new, new_stored, _) = got[:2]
    assert dup_stored is False and dup.sample == first  # the stored copy, not the rerun
    assert new_stored is True and new.sample == fresh
    assert [s.token_ids for s in store.samples.list(first.request_id)] == [(7, 8, 9), (4,)]


def test_a_heartbeat_before_the_worker_is_recorded_waits_for_it(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh worker's first heartbeat may be read before the loop records the worker: no
    warning, and the next heartbeat is stamped once the worker exists."""
    stamp = HeartbeatStamp(store, "w0")
    with caplog.at_level(logging.WARNING):
        stamp()
    assert caplog.records == []
    store.workers.upsert(Worker(worker_id="w0", kind=WorkerKind.ROLLOUT, device_id="cpu:0"))
    assert store.workers.get("w0").last_heartbeat is None
    stamp()  # not held back by the write interval: nothing was written before
    assert store.workers.get("w0").last_heartbeat is not None


def test_a_worker_never_recorded_is_logged_once_per_period(
    store: Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(worker_pipe.time, "monotonic", lambda: clock[0])
    stamp = HeartbeatStamp(store, "ghost")
    with caplog.at_level(logging.WARNING):
        for t in (100.0, 110.0, 120.0, 131.0, 140.0, 162.0):
            clock[0] = t
            stamp()
    assert [r.getMessage() for r in caplog.records] == ["heartbeat of an unrecorded worker"] * 2


def test_the_samples_of_a_unit_that_ended_its_request_are_delivered_last() -> None:
    """A worker step's samples arrive together and are stored in one transaction, which ends
    the request with the last unit it records. Delivered in the worker's order, that unit's
    end could reach the loop before another unit of the same batch is recorded there, and the
    request's streams would read every sample back from the store instead of ending on the
    event. Those samples go last within their run of samples; other messages keep their
    place."""
    from tltd.domain import RequestStatus
    from tltd.store.leases import UnitEnd
    from tltd.supervisor.worker_process import _request_ends_last

    ended = UnitEnd(RequestStatus.COMPLETED, "all 4 samples finished", 0)
    running = UnitEnd(RequestStatus.RUNNING, "running on w0", 1)
    beat = msg.Heartbeat(0, 0, 0, None)

    def fin(p: int, i: int, end: UnitEnd | None) -> tuple:
        return (msg.Finished(_sample(p, i)), True, end)

    batch = [fin(1, 0, ended), fin(0, 0, running), fin(1, 1, ended), fin(0, 1, running),
             (beat, None, None), fin(2, 0, ended), fin(3, 0, None),
             (msg.Drained(0), None, None)]  # fmt: skip
    got = _request_ends_last(batch)
    assert got == [batch[1], batch[3], batch[0], batch[2], batch[4], batch[6], batch[5], batch[7]]
    plain = [fin(0, 0, running), (beat, None, None)]
    assert _request_ends_last(plain) is plain  # nothing ended: as it came
