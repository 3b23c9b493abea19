"""Each finished work unit is recorded once, on SQLite and PostgreSQL, even when two
`LiveRequests.finalize` calls of one request overlap: one records a unit while the other,
which read the request's complete units before its own write, waits behind it. A unit
claimed more than `max_sample_attempts` times fails with the reason."""

from __future__ import annotations

import asyncio
import logging
import threading

from tests.api.support import make_settings
from tests.store.expiry import expire_unit_leases
from tests.store.test_leases import LONG_LEASE, _node, _requests, _sample
from tltd.domain import FinishReason, RequestStatus
from tltd.store import Store
from tltd.supervisor.live_requests import LiveRequests
from tltd.supervisor.writes import OrderedWrites


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_overlapping_finalize_calls_record_each_unit_once(store: Store, tmp_path, caplog) -> None:
    """Unit 1 completes first: its record is written while held at a gate in the store call.
    Unit 0 then completes: a second finalize reads units [0, 1] (1 being recorded), and its
    write for unit 0 queues behind unit 1's. Once the gate opens, unit 1 is recorded by the
    first call; the second records unit 0 and must not record unit 1 again."""
    _requests(store, 1, 2)  # r0000: 2 prompts, n=2
    node = _node(store, "a")
    rid = "r0000"
    calls: list[int] = []
    gate = threading.Event()
    real_finish_unit = node.leases.finish_unit

    def gated_finish_unit(request_id, prompt_index, outcome, reason):
        calls.append(prompt_index)
        if prompt_index == 1:
            assert gate.wait(10), "gate never opened"
        return real_finish_unit(request_id, prompt_index, outcome, reason)

    async def run() -> None:
        writes = OrderedWrites()
        writes.bind()
        writer = asyncio.create_task(writes.run())
        spawned: list[asyncio.Future] = []
        reqs = LiveRequests(
            node, make_settings(tmp_path), writes,
            lambda c: spawned.append(asyncio.ensure_future(c)), lambda: None,
        )  # fmt: skip
        try:
            await reqs.take_claims(*_claimed(node, LONG_LEASE))
            live = reqs.queue.get(rid)
            assert live is not None and live.units == {0, 1}
            for p in (0, 1):
                for s in range(2):
                    node.samples.add(_sample(rid, p, s))
            node.leases.finish_unit = gated_finish_unit  # type: ignore[method-assign]

            for s in range(2):
                reqs.queue.finish(rid, (1, s))
            first = asyncio.create_task(reqs.finalize(live))
            await _until(lambda: calls == [1], "unit 1's record at the gate")

            for s in range(2):
                reqs.queue.finish(rid, (0, s))
            second = asyncio.create_task(reqs.finalize(live))
            await _until(lambda: (rid, 0) in reqs._finalizing, "unit 0's record queued")

            gate.set()
            await asyncio.wait_for(asyncio.gather(first, second), 10)
            await asyncio.wait_for(writes.join(), 10)
            assert not spawned  # no write failed, so no retry
        finally:
            gate.set()
            writer.cancel()

    try:
        with caplog.at_level(logging.WARNING, logger="tltd.supervisor.live_requests"):
            asyncio.run(run())
        assert sorted(calls) == [0, 1], f"finish_unit calls by unit: {calls}"
        assert "unit not recorded" not in caplog.text
        req = store.requests.get(rid)
        assert req.status is RequestStatus.COMPLETED, req.status_reason
    finally:
        node.close()


def test_a_unit_claimed_past_the_attempt_limit_fails_with_the_reason(
    pg_store: Store, tmp_path
) -> None:
    """Two nodes lose a unit's lease in turn (max_sample_attempts 2): the second claim still
    runs it; the third fails it at once, its missing samples stored partial FAILED with the
    reason, the samples stored before kept, and the request ends FAILED naming it."""
    store = pg_store
    _requests(store, 1, 2)  # r0000: 2 prompts, n=2
    rid = "r0000"
    a, b, c = (_node(store, n) for n in ("a", "b", "c"))
    settings = make_settings(tmp_path, max_sample_attempts=2)

    async def take(node: Store, lease: float) -> LiveRequests:
        writes = OrderedWrites()
        writes.bind()
        writer = asyncio.create_task(writes.run())
        reqs = LiveRequests(node, settings, writes, asyncio.ensure_future, lambda: None)
        try:
            await reqs.take_claims(*_claimed(node, lease))
            await asyncio.wait_for(writes.join(), 10)
        finally:
            writer.cancel()
        return reqs

    try:
        assert [u.attempts for u in a.leases.claim_units(100, LONG_LEASE)] == [1, 1]
        assert a.samples.add(_sample(rid, 0, 0))  # stored by the first owner: kept
        assert expire_unit_leases(store) == 2  # a loses them
        second = asyncio.run(take(b, LONG_LEASE))
        live = second.queue.get(rid)
        assert live is not None and live.pending == {0: [1], 1: [0, 1]}  # attempt 2 runs
        assert expire_unit_leases(store) == 2  # b loses them too
        third = asyncio.run(take(c, LONG_LEASE))
        assert third.queue.get(rid) is None  # both units ended and recorded at once
        why = "claimed 2 times by nodes that lost it (limit 2)"
        req = store.requests.get(rid)
        assert req.status is RequestStatus.FAILED
        assert req.status_reason == f"3 of 4 samples failed: {why}"
        got = {(s.prompt_index, s.sample_index): s for s in store.samples.list(rid)}
        assert not got[(0, 0)].partial and got[(0, 0)].token_ids == (7, 8)
        for key in [(0, 1), (1, 0), (1, 1)]:
            assert got[key].partial and got[key].finish_reason is FinishReason.FAILED
            assert got[key].error == why
    finally:
        for n in (a, b, c):
            n.close()


def _claimed(node, lease: float):
    """What the supervisor hands take_claims: the claims and the claimed requests' state."""
    claims = node.leases.claim_units(100, lease)
    return claims, node.leases.claimed_state(sorted({c.request_id for c in claims}))
