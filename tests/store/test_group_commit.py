"""Concurrent admissions written together (`GroupCommit` over `Store.batch`): one transaction
for the calls that arrive while a group runs, each undone alone when it fails, a group that
does not commit run again call by call; on the real databases."""

from __future__ import annotations

import asyncio
import threading
from functools import partial

from sqlalchemy import text

from tests.store.test_batched_writes import _counting
from tltd.domain import Job, RequestStatus, RolloutRequest, SamplingParams
from tltd.errors import NotFound
from tltd.services.group_commit import GroupCommit
from tltd.store import Store

JOB = Job(job_id="job-1", model_path="/models/tiny", name="grpo")
SAMPLING = SamplingParams(n=2, max_new_tokens=8, seed=1)


def _request(request_id: str, job_id: str = JOB.job_id) -> RolloutRequest:
    return RolloutRequest(request_id, job_id, ((1, 2, 3), (4, 5)), SAMPLING)


async def _admit_together(group: GroupCommit, store: Store, requests: list[RolloutRequest]):
    """The first call goes alone; the others arrive while it runs and go in the next group."""
    release = threading.Event()

    def first():
        release.wait(10)
        return store.requests.admit(_request("first"))

    calls = [asyncio.ensure_future(group.run(first))]
    await asyncio.sleep(0.05)  # the first group is in its thread
    calls += [asyncio.ensure_future(group.run(partial(store.requests.admit, r))) for r in requests]
    await asyncio.sleep(0)  # every call has queued
    release.set()
    return await asyncio.gather(*calls, return_exceptions=True)


def test_calls_that_arrive_together_share_one_transaction_and_fail_alone(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.admit(_request("stored"))
    batch, opened = _counting(store)
    group = GroupCommit(batch)
    results = asyncio.run(_admit_together(group, store, [
        _request("a"),
        _request("b", job_id="no-such-job"),  # refused: NotFound
        _request("stored"),  # a retry attaches to the stored request
        _request("c"),
        _request("a"),  # the same id again in the same group: attaches to the first
    ]))  # fmt: skip
    assert group.groups == 2 and len(opened) == 1  # the first alone, the five in one group
    assert results[0].created and results[1].created and results[4].created
    assert isinstance(results[2], NotFound) and results[2].field == "job_id"
    assert not results[3].created and results[3].request.request_id == "stored"
    assert not results[5].created and results[5].request.request_id == "a"
    stored = {r.request_id: r for r in store.requests.list()}
    assert sorted(stored) == ["a", "c", "first", "stored"]
    assert all(r.status is RequestStatus.QUEUED for r in stored.values())


def test_a_group_that_does_not_commit_is_run_again_call_by_call(store: Store) -> None:
    store.jobs.create(JOB)
    batch, opened = _counting(store, fail_commit=True)
    group = GroupCommit(batch)
    results = asyncio.run(_admit_together(group, store, [_request(f"r{i}") for i in range(3)]))
    assert len(opened) == 1  # the group was tried once, then each call alone
    assert all(r.created for r in results)
    assert sorted(r.request_id for r in store.requests.list()) == ["first", "r0", "r1", "r2"]
    with store.db.engine.connect() as conn:  # each request's two units, none twice
        units = conn.execute(text("SELECT request_id, COUNT(*) FROM work_units GROUP BY 1"))
        assert dict(units.all()) == {"first": 2, "r0": 2, "r1": 2, "r2": 2}


def test_a_call_alone_runs_at_once_without_a_batch(store: Store) -> None:
    store.jobs.create(JOB)
    batch, opened = _counting(store)
    group = GroupCommit(batch)

    async def one_after_another():
        return [await group.run(partial(store.requests.admit, _request(f"r{i}"))) for i in range(3)]

    results = asyncio.run(one_after_another())
    assert group.groups == 3 and opened == []  # no savepoints for a call alone
    assert all(r.created for r in results)


def test_a_call_does_not_wait_behind_a_group_that_is_itself_waiting(store: Store) -> None:
    store.jobs.create(JOB)
    group, release = GroupCommit(store.batch), threading.Event()

    def held():
        assert release.wait(10)
        return store.requests.admit(_request("held"))

    async def scenario():
        first = asyncio.ensure_future(group.run(held))
        await asyncio.sleep(0.05)  # the first group waits in its thread
        after = group.run(partial(store.requests.admit, _request("next")))
        second = await asyncio.wait_for(after, 5)  # in the other lane
        release.set()
        return second, await first

    second, first = asyncio.run(scenario())
    assert second.created and first.created and group.groups == 2
