"""A job's pause holds on every node: two nodes' service layers over one database (SQLite and
PostgreSQL), a pause made through one gating admission on the other, a resume through either
letting held requests in, an abort through one ending requests wherever they were stored."""

from __future__ import annotations

import asyncio

import pytest

from tests.api.support import make_settings
from tltd.domain import Job, RequestStatus, RolloutRequest, SamplingParams
from tltd.services import PauseMode, build_services
from tltd.services.pause import POLL_SECONDS
from tltd.store import Store

JOB = Job(job_id="job-1", model_path="/models/tiny")


@pytest.fixture
def nodes(migrated_db_url, tmp_path):
    db_url = migrated_db_url
    stores = [Store(db_url, node_id=n) for n in ("node-a", "node-b")]
    stores[0].jobs.create(JOB)
    try:
        yield [build_services(s, make_settings(tmp_path / s.node_id)) for s in stores]
    finally:
        for s in stores:
            s.close()


def test_a_pause_through_one_node_holds_admission_on_another(nodes):
    a, b = nodes

    async def scenario():
        assert not await asyncio.to_thread(b.pauses.is_paused, JOB.job_id)
        await a.pauses.pause(JOB.job_id, PauseMode.KEEP)
        assert await asyncio.to_thread(b.pauses.is_paused, JOB.job_id)
        held = asyncio.create_task(b.pauses.wait_open(JOB.job_id))
        await asyncio.sleep(3 * POLL_SECONDS)
        assert not held.done()  # node b's admission waits on node a's pause
        assert await a.pauses.resume(JOB.job_id) is True
        await asyncio.wait_for(held, 10 * POLL_SECONDS)  # seen through the store
        assert not await asyncio.to_thread(b.pauses.is_paused, JOB.job_id)
        # ... and the other way round, resumed on the node that did not pause
        await b.pauses.pause(JOB.job_id, PauseMode.KEEP)
        held = asyncio.create_task(b.pauses.wait_open(JOB.job_id))
        await asyncio.sleep(POLL_SECONDS)
        assert await a.pauses.resume(JOB.job_id) is True
        await asyncio.wait_for(held, 10 * POLL_SECONDS)
        assert await b.pauses.resume(JOB.job_id) is False  # resumed already

    asyncio.run(scenario())


def test_an_abort_through_one_node_ends_requests_stored_by_another(nodes):
    a, b = nodes
    req = RolloutRequest("on-b", JOB.job_id, ((1, 2),), SamplingParams(max_new_tokens=4))
    b.rollouts.store.requests.create(req)

    async def scenario():
        aborted = await a.pauses.pause(JOB.job_id, PauseMode.ABORT)
        assert aborted == 1
        assert await asyncio.to_thread(b.pauses.is_paused, JOB.job_id)
        await b.pauses.resume(JOB.job_id)

    asyncio.run(scenario())
    got = b.rollouts.store.requests.get("on-b")
    assert got.status is RequestStatus.CANCELLED and "pause" in got.status_reason
