"""Store writes queued together share one transaction (`Store.batch` via `OrderedWrites`), and a
write that fails in it is undone alone: on the real databases."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from dataclasses import replace

import pytest

from tltd.domain import Job
from tltd.errors import AlreadyExists, FailedPrecondition, NotFound
from tltd.store import Store
from tltd.supervisor.writes import OrderedWrites, WritesClosed

JOB = Job(job_id="job-a", model_path="/models/tiny", name="grpo")


def _half_written(store: Store) -> None:
    """A write that adds a row, then refuses: its row must not stay."""
    with store._tx():  # in a batch: one savepoint around both
        store.jobs.create(replace(JOB, job_id="half"))
        raise FailedPrecondition("half: refused after writing", field="job_id")


async def _queue_at_once(writes: OrderedWrites, calls) -> list:
    """Queue every call before the writer runs, so they go in one batch."""
    writes.bind()
    futures = [asyncio.ensure_future(writes.write(fn, *args)) for fn, *args in calls]
    await asyncio.sleep(0)  # every write() has queued its call
    runner = asyncio.create_task(writes.run())
    try:
        return await asyncio.gather(*futures, return_exceptions=True)
    finally:
        runner.cancel()


def _counting(store: Store, fail_commit: bool = False):
    opened = []

    @contextmanager
    def batch():
        opened.append(1)
        with store.batch():
            yield
            if fail_commit:  # as a commit that fails would: the whole batch is undone
                raise OSError("disk full")

    return batch, opened


def test_a_failed_write_in_a_batch_is_undone_alone(store: Store) -> None:
    batch, opened = _counting(store)
    other = replace(JOB, job_id="job-b")
    results = asyncio.run(
        _queue_at_once(
            OrderedWrites(batch),
            [
                (store.jobs.create, JOB),
                (store.jobs.create, replace(JOB, model_path="/elsewhere")),  # a conflict
                (_half_written, store),
                (store.devices.get, "cuda:9"),  # not found
                (store.jobs.create, other),
            ],
        )
    )
    assert len(opened) == 1  # one transaction for the five
    assert results[0][1] is True and results[4][1] is True
    assert isinstance(results[1], AlreadyExists) and results[1].field == "job_id"
    assert isinstance(results[2], FailedPrecondition)
    assert isinstance(results[3], NotFound)
    assert sorted(j.job_id for j in store.jobs.list()) == ["job-a", "job-b"]  # no "half"


def test_a_batch_that_does_not_commit_is_written_again_one_by_one(store: Store) -> None:
    batch, opened = _counting(store, fail_commit=True)
    jobs = [replace(JOB, job_id=f"job-{i}") for i in range(4)]
    results = asyncio.run(
        _queue_at_once(OrderedWrites(batch), [(store.jobs.create, j) for j in jobs])
    )
    assert len(opened) == 1
    # Each created exactly once: the undone batch left nothing, the one-by-one run wrote all.
    assert [created for _, created in results] == [True] * 4
    assert sorted(j.job_id for j in store.jobs.list()) == [j.job_id for j in jobs]


@pytest.mark.parametrize("batched", [True, False])
def test_writes_run_in_the_order_queued(store: Store, batched: bool) -> None:
    order = []

    def note(i: int) -> int:
        order.append(i)
        return i

    writes = OrderedWrites(store.batch if batched else None)
    results = asyncio.run(_queue_at_once(writes, [(note, i) for i in range(10)]))
    assert order == list(range(10)) and results == list(range(10))


def test_a_batch_writes_requests_in_request_id_order(store: Store) -> None:
    """The order a sample batch locks request rows in: two transactions locking them in
    different orders deadlock on PostgreSQL. Writes of one request keep their queued order;
    each caller gets its own call's result."""
    batch, opened = _counting(store)
    ran: list[str] = []

    def record(name: str) -> str:
        ran.append(name)
        return name

    async def queue() -> list:
        writes = OrderedWrites(batch)
        writes.bind()
        calls = [("r-b first", "r-b"), ("worker", ""), ("r-a", "r-a"), ("r-b then", "r-b")]
        futures = [
            asyncio.ensure_future(writes.write(record, name, request=rid)) for name, rid in calls
        ]
        await asyncio.sleep(0)
        runner = asyncio.create_task(writes.run())
        try:
            return await asyncio.gather(*futures)
        finally:
            runner.cancel()

    assert asyncio.run(queue()) == ["r-b first", "worker", "r-a", "r-b then"]
    assert len(opened) == 1
    assert ran == ["worker", "r-a", "r-b first", "r-b then"]


async def _a_write_then_another(writes: OrderedWrites, store: Store, fn, *args):
    """Through a running writer: `fn(*args)` (its result or error), then the creation of JOB
    (its result), and whether the writer had ended by then."""
    writes.bind()
    runner = asyncio.create_task(writes.run())
    try:
        first = await asyncio.wait_for(
            asyncio.gather(writes.write(fn, *args), return_exceptions=True), 10.0
        )
        second = await asyncio.wait_for(writes.write(store.jobs.create, JOB), 10.0)
        return first[0], second, runner.done()
    finally:
        runner.cancel()


@pytest.mark.parametrize("batched", [True, False])
def test_a_store_call_raising_a_base_exception_does_not_end_the_writer(
    store: Store, batched: bool
) -> None:
    """A store call that raises what is not an Exception (here a CancelledError out of the
    call, in the writer's thread) fails that write alone; had it ended the writer, nothing
    queued after it would ever be stored and its callers would wait for ever."""

    def cancelled() -> None:
        raise asyncio.CancelledError("inside a store call")

    writes = OrderedWrites(store.batch if batched else None)
    error, created, writer_ended = asyncio.run(_a_write_then_another(writes, store, cancelled))
    assert isinstance(error, RuntimeError) and "CancelledError" in str(error)
    assert created[1] is True and not writer_ended
    assert [j.job_id for j in store.jobs.list()] == ["job-a"]


def test_joining_the_writes_ends_when_the_writer_has_ended(store: Store) -> None:
    """A stop waits for the queued writes, but not for ever once their writer is gone."""

    async def scenario() -> None:
        writes = OrderedWrites(store.batch)
        writes.bind()
        runner = asyncio.create_task(writes.run())
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        writes.write_nowait(store.jobs.create, JOB)  # queued for a writer that is gone
        await asyncio.wait_for(writes.join(runner), 5.0)

    asyncio.run(scenario())
    assert store.jobs.list() == []


def test_a_thread_hop_that_fails_fails_its_writes_and_the_writer_goes_on(
    store: Store, monkeypatch
) -> None:
    """No thread to run a write in (e.g. "can't start new thread"): that write fails, the
    writer stays and runs the next one."""
    import tltd.supervisor.writes as writes_module

    real = asyncio.to_thread
    calls = []

    async def failing_once(fn, *args):
        calls.append(fn)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        return await real(fn, *args)

    monkeypatch.setattr(writes_module.asyncio, "to_thread", failing_once)

    writes = OrderedWrites(store.batch)
    error, created, writer_ended = asyncio.run(
        _a_write_then_another(writes, store, store.devices.get, "cpu:0")
    )
    assert isinstance(error, RuntimeError) and "new thread" in str(error)
    assert created[1] is True and not writer_ended


def test_writes_left_when_the_writer_stops_fail_instead_of_waiting_for_ever(store: Store) -> None:
    """The stop cancels the writer once the queue was empty; a write the workers' last
    messages queued after that (a unit's end) fails with WritesClosed at `close`, as does any
    write after it, so nothing awaits a writer that is gone."""

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        writes = OrderedWrites(store.batch)
        writes.bind()
        runner = asyncio.create_task(writes.run())
        await writes.join(runner)
        runner.cancel()
        late = asyncio.ensure_future(writes.write(store.jobs.create, JOB))
        await asyncio.sleep(0)  # queued
        await asyncio.gather(runner, return_exceptions=True)
        writes.close()
        queued = await asyncio.wait_for(asyncio.gather(late, return_exceptions=True), 5.0)
        writes.write_nowait(store.jobs.create, JOB)  # dropped, logged
        try:
            await writes.write(store.jobs.create, JOB)
        except WritesClosed as exc:
            return queued[0], exc
        return queued[0], None

    queued, later = asyncio.run(scenario())
    assert isinstance(queued, WritesClosed) and "JobRecords.create" in str(queued)
    assert isinstance(later, WritesClosed)
    assert store.jobs.list() == []


def test_a_write_in_flight_when_the_writer_is_cancelled_fails_its_caller(store: Store) -> None:
    """Cancelled while a store call runs in its thread, the writer can no longer hand over
    that call's result: the caller is told WritesClosed instead of waiting for ever."""
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10.0)
        return "done"

    async def scenario() -> BaseException | str:
        writes = OrderedWrites(store.batch)
        writes.bind()
        runner = asyncio.create_task(writes.run())
        call = asyncio.ensure_future(writes.write(slow))
        assert await asyncio.to_thread(started.wait, 5.0)
        runner.cancel()
        got = await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), 5.0)
        release.set()
        await asyncio.gather(runner, return_exceptions=True)
        return got[0]

    try:
        got = asyncio.run(scenario())
    finally:
        release.set()
    assert isinstance(got, WritesClosed) and "slow" in str(got)
