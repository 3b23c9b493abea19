"""Work units under leases, on SQLite and PostgreSQL: claims sized to capacity, no unit held
twice while its lease is live (concurrent claimers), expiry and takeover, fencing of late
writes, a request finished by its last unit."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import pytest
from sqlalchemy import event

from tests.store.expiry import expire_unit_leases, silence_node
from tests.store.test_store_api import JOB, SAMPLING
from tltd.domain import FinishReason, NodeStatus, RequestStatus, RolloutRequest, Sample
from tltd.errors import ConfigError, Fenced
from tltd.store import Store
from tltd.store.leases import UnitEnd
from tltd.store.rollout_requests import AdmissionClaim

LONG_LEASE = 120.0
DOWN = 30.0  # a node's heartbeat threshold: missed beats are written, never waited for


def _node(store: Store, node_id: str) -> Store:
    other = Store(store.url, node_id=node_id)
    other.nodes.join(f"{node_id}:1", down_seconds=30.0)
    return other


def _requests(store: Store, count: int, prompts: int) -> None:
    store.jobs.create(JOB)
    for i in range(count):
        prompt_ids = tuple((1, 2, p) for p in range(prompts))
        store.requests.create(RolloutRequest(f"r{i:04d}", JOB.job_id, prompt_ids, SAMPLING))


def _sample(rid: str, p: int, s: int) -> Sample:
    return Sample(rid, p, s, (7, 8), (-0.5, -0.5), FinishReason.STOP)


def test_claim_is_sized_to_capacity(store: Store) -> None:
    _requests(store, 3, 2)  # 6 units of n=2 samples
    a = _node(store, "a")
    try:
        got = a.leases.claim_units(capacity=3, lease_seconds=LONG_LEASE)
        # Units are taken while the samples before each stay under 3: 2 units (4 samples).
        assert [(c.request_id, c.prompt_index, c.attempts) for c in got] == [
            ("r0000", 0, 1), ("r0000", 1, 1)
        ]  # fmt: skip
        assert len(a.leases.claim_units(capacity=100, lease_seconds=LONG_LEASE)) == 4
        assert a.leases.claim_units(capacity=100, lease_seconds=LONG_LEASE) == []
    finally:
        a.close()


def _several_nodes(store: Store, count: int) -> list[Store]:
    """`count` nodes on PostgreSQL; on SQLite (one node) `count` claimers of one node."""
    if store.dialect == "sqlite":
        one = _node(store, "only")
        return [one] * count
    return [_node(store, f"n{i}") for i in range(count)]


def test_concurrent_claimers_never_share_a_live_unit(store: Store) -> None:
    """Hundreds of units, four claimers at once in small bites: each unit is claimed exactly
    once (the leases are long: none expires during the test)."""
    _requests(store, 100, 3)  # 300 units
    nodes = _several_nodes(store, 4)
    claimed: list[tuple[str, str, int]] = []
    lock = threading.Lock()

    def claimer(node: Store) -> None:
        while True:
            got = node.leases.claim_units(capacity=5, lease_seconds=LONG_LEASE)
            if not got:
                return
            with lock:
                claimed.extend((node.node_id, c.request_id, c.prompt_index) for c in got)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in nodes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        per_unit = Counter((rid, p) for _, rid, p in claimed)
        assert len(per_unit) == 300
        assert max(per_unit.values()) == 1, [k for k, v in per_unit.items() if v > 1][:5]
        per_node = Counter(n for n, _, _ in claimed)
        assert sum(per_node.values()) == 300
        if store.dialect == "postgresql":
            assert len(per_node) >= 2, per_node
    finally:
        for n in set(nodes):
            n.close()


@pytest.mark.postgres
def test_expired_lease_is_taken_over_and_the_late_owner_is_fenced(pg_store: Store) -> None:
    store = pg_store
    _requests(store, 1, 1)
    a, b = _node(store, "a"), _node(store, "b")
    try:
        [first] = a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        a.samples.add(_sample(first.request_id, 0, 0))  # while held: stored
        assert b.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE) == []  # still live
        assert expire_unit_leases(store) == 1
        # Expired: not renewed, the owner must stop.
        assert a.leases.renew({("r0000", 0)}, LONG_LEASE) == set()
        [taken] = b.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        assert (taken.request_id, taken.prompt_index, taken.attempts) == ("r0000", 0, 2)
        with pytest.raises(Fenced):
            a.samples.add(_sample("r0000", 0, 1))  # a late write changes nothing
        with pytest.raises(Fenced):
            a.leases.finish_unit("r0000", 0, None, "")
        assert b.samples.add(_sample("r0000", 0, 1))
        assert not b.samples.add(_sample("r0000", 0, 0))  # first writer wins
        end = b.leases.finish_unit("r0000", 0, None, "")
        assert end.left == 0 and end.status is RequestStatus.COMPLETED
        assert b.requests.get("r0000").samples_done == SAMPLING.n
        assert b.leases.renew({("r0000", 0)}, LONG_LEASE) == set()  # done: nothing left to renew
    finally:
        a.close()
        b.close()


def test_only_the_units_a_node_runs_are_renewed(store: Store) -> None:
    """A unit leased to a node that does not run it (its claim's answer was lost in a
    database outage) is not renewed with the others: its lease lapses and it is claimed
    again, instead of being held forever."""
    _requests(store, 2, 1)
    a = _node(store, "a")
    try:
        got = a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        assert [c.request_id for c in got] == ["r0000", "r0001"]
        assert a.leases.renew({("r0000", 0)}, 10 * LONG_LEASE) == {("r0000", 0)}
        assert a.leases.renew(set(), 10 * LONG_LEASE) == set()
        # The lease that was not renewed lapses (one that was would end far later).
        assert expire_unit_leases(a, ending_within=2 * LONG_LEASE) == 1
        [again] = a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        assert (again.request_id, again.prompt_index, again.attempts) == ("r0001", 0, 2)
        assert a.leases.renew({("r0000", 0), ("r0001", 0)}, LONG_LEASE) == {
            ("r0000", 0), ("r0001", 0)
        }  # fmt: skip
    finally:
        a.close()


def test_unit_needs_every_sample_before_it_is_done(store: Store) -> None:
    _requests(store, 1, 2)
    a = _node(store, "a")
    try:
        a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        a.samples.add(_sample("r0000", 0, 0))
        with pytest.raises(Fenced):
            a.leases.finish_unit("r0000", 0, None, "")
        a.samples.add(_sample("r0000", 0, 1))
        end = a.leases.finish_unit("r0000", 0, None, "")
        assert end.left == 1 and end.status is RequestStatus.QUEUED  # prompt 1 still open
        assert a.leases.renew({("r0000", 0), ("r0000", 1)}, LONG_LEASE) == {("r0000", 1)}
    finally:
        a.close()


def test_a_unit_ends_without_reading_the_requests_prompts(store: Store) -> None:
    """A unit's end (a cancel or drain decided on the node) reads the request's n and status,
    not its row: the prompts are its largest column (~100k ids of JSON for 512 prompts)."""
    _requests(store, 1, 2)
    a = _node(store, "a")
    statements: list[str] = []

    def seen(conn, cursor, statement, params, context, executemany) -> None:
        statements.append(statement)

    try:
        a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        for p in range(2):
            a.sample_batches.add([_sample("r0000", p, i) for i in range(SAMPLING.n)])
        event.listen(a.db.engine, "before_cursor_execute", seen)
        try:
            assert a.leases.finish_unit("r0000", 0, None, "").left == 1
            end = a.leases.finish_unit("r0000", 1, RequestStatus.CANCELLED, "stop")
        finally:
            event.remove(a.db.engine, "before_cursor_execute", seen)
        assert end == UnitEnd(RequestStatus.CANCELLED, "stop", 0)
        assert statements and not any("rollout_requests.prompts" in x for x in statements)
        assert a.requests.get("r0000").status is RequestStatus.CANCELLED
    finally:
        a.close()


@pytest.mark.parametrize("batched", [True, False], ids=["add_samples", "add_sample"])
def test_a_sample_out_of_attempts_fails_its_request_over_a_lost_runs_partial(
    store: Store, batched: bool
) -> None:
    """A run lost with its lease leaves its samples stored partial (CANCELLED, the tokens so
    far); a sample that then runs out of attempts is stored FAILED in their place, so the
    request ends FAILED, not COMPLETED with the lost run's partial samples counted as done."""
    _requests(store, 1, 1)  # n=2
    a = _node(store, "a")
    try:
        a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        lost = [
            Sample("r0000", 0, i, (7,), (-0.5,), FinishReason.CANCELLED, partial=True)
            for i in range(2)
        ]
        failed = [
            replace(x, token_ids=(), logprobs=(), finish_reason=FinishReason.FAILED,
                    error="claimed 3 times by nodes that lost it")
            for x in lost
        ]  # fmt: skip
        add = a.sample_batches.add if batched else (lambda xs: [a.samples.add(x) for x in xs])
        assert add(lost) == [True, True]
        assert add(failed) == [True, True]
        assert add(failed) == [False, False]  # a verdict stored once
        assert add(lost) == [False, False]  # a lost run's partial does not replace it
        got = a.samples.list("r0000")
        assert [(x.finish_reason, x.error) for x in got] == [
            (FinishReason.FAILED, "claimed 3 times by nodes that lost it")
        ] * 2
        end = a.leases.finish_unit("r0000", 0, None, "")
        assert end.left == 0 and end.status is RequestStatus.FAILED
        assert end.reason.startswith("2 of 2 samples failed: claimed 3 times")
        assert a.requests.get("r0000").status_reason == end.reason
        assert a.requests.get("r0000").samples_done == 0
    finally:
        a.close()


@pytest.mark.postgres
def test_restart_releases_only_its_own_stale_leases(pg_store: Store) -> None:
    store = pg_store
    _requests(store, 2, 1)
    a, b = _node(store, "a"), _node(store, "b")
    try:
        a.leases.claim_units(capacity=2, lease_seconds=LONG_LEASE)
        b_got = b.leases.claim_units(capacity=2, lease_seconds=LONG_LEASE)
        assert len(b_got) == 1
        a2 = _node(store, "a")  # a restarted: a new epoch
        try:
            assert a2.epoch == a.epoch + 1
            assert a2.leases.release_stale() == 1
            b_unit = (b_got[0].request_id, 0)
            assert b.leases.renew({b_unit}, LONG_LEASE) == {b_unit}  # b's untouched
            again = a2.leases.claim_units(capacity=2, lease_seconds=LONG_LEASE)
            assert [c.attempts for c in again] == [2]
            with pytest.raises(Fenced):  # the old process (epoch) is fenced
                a.samples.add(_sample(again[0].request_id, 0, 0))
        finally:
            a2.close()
    finally:
        a.close()
        b.close()


def test_sqlite_restart_takes_its_expired_work_back(sqlite_store: Store) -> None:
    """SQLite's one node: a restart (new epoch) reclaims what the old process held; the old
    process's writes are fenced."""
    _requests(sqlite_store, 1, 1)
    old = _node(sqlite_store, "solo")
    new = None
    try:
        old.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        new = _node(sqlite_store, "solo")
        assert new.leases.release_stale() == 1
        assert [c.attempts for c in new.leases.claim_units(10, LONG_LEASE)] == [2]
        with pytest.raises(Fenced):
            old.samples.add(_sample("r0000", 0, 0))
        assert new.samples.add(_sample("r0000", 0, 0))
    finally:
        old.close()
        if new is not None:
            new.close()


def test_sqlite_refuses_a_second_live_node(sqlite_store: Store) -> None:
    a = _node(sqlite_store, "a")
    b = Store(sqlite_store.url, node_id="b")
    try:
        with pytest.raises(ConfigError, match="in use by node 'a'"):
            b.nodes.join("b:1", down_seconds=30.0)
        a.nodes.leave()  # a clean shutdown frees the database for another node
        assert b.nodes.join("b:1", down_seconds=30.0) == 1
        # A node silent for longer than the threshold does not hold it either.
        c = Store(sqlite_store.url, node_id="c")
        try:
            assert silence_node(b, "b") == 1
            assert c.nodes.join("c:1", down_seconds=DOWN) == 1
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_nodes_are_down_after_a_missed_heartbeat_and_back_with_a_new_epoch(
    sqlite_store: Store,
) -> None:
    a = _node(sqlite_store, "a")
    try:
        [n] = a.nodes.list(down_seconds=DOWN)
        assert (n.node_id, n.status, n.epoch, n.address) == ("a", NodeStatus.UP, 1, "a:1")
        assert a.nodes.beat(down_seconds=DOWN) == 1  # on time: same epoch
        assert silence_node(a, "a") == 1  # heartbeats missed for longer than DOWN
        assert a.nodes.list(down_seconds=DOWN)[0].status is NodeStatus.DOWN
        assert a.nodes.beat(down_seconds=DOWN) == 2  # back after being DOWN: a new epoch
        assert a.nodes.list(down_seconds=DOWN)[0].status is NodeStatus.UP
        a2 = _node(sqlite_store, "a")  # another process joins with the same id
        try:
            with pytest.raises(Fenced):
                a.nodes.beat(down_seconds=5.0)
        finally:
            a2.close()
    finally:
        a.close()


@pytest.mark.postgres
def test_cluster_wide_job_runs_on_one_node_at_a_time(pg_store: Store) -> None:
    from tltd.periodic import prune_history

    a, b = _node(pg_store, "a"), _node(pg_store, "b")
    _requests(pg_store, 1, 1)
    pg_store.requests.set_status("r0000", RequestStatus.CANCELLED, "old")
    try:
        with a.nodes.cluster_lock("history-gc") as mine:
            assert mine
            with b.nodes.cluster_lock("history-gc") as theirs:
                assert not theirs  # not waited for: skipped
            assert prune_history(b, retention_hours=1e-9) == (0, 0)
            assert b.requests.get("r0000").status is RequestStatus.CANCELLED
        with b.nodes.cluster_lock("history-gc") as theirs:
            assert theirs  # released at the end of a's block
        time.sleep(0.01)
        requests, _ = prune_history(b, retention_hours=1e-9)
        assert requests == 1
    finally:
        a.close()
        b.close()


def test_a_cancel_ends_the_units_no_node_holds(store: Store) -> None:
    _requests(store, 1, 2)
    a = _node(store, "a")
    try:
        [held] = a.leases.claim_units(capacity=2, lease_seconds=LONG_LEASE)  # prompt 0 only
        assert held.prompt_index == 0
        store.requests.set_status("r0000", RequestStatus.CANCELLED, "stop")
        assert store.leases.end_queued_units("r0000", FinishReason.CANCELLED, "stop") == 1
        req, open_units, samples, _ = store.leases.stream_state("r0000", 0)
        assert open_units == 1  # a's unit: a ends it
        assert {(s.prompt_index, s.finish_reason, s.partial) for s in samples} == {
            (1, FinishReason.CANCELLED, True)
        }
        for i in range(SAMPLING.n):
            a.samples.add(Sample("r0000", 0, i, (), (), FinishReason.CANCELLED, partial=True))
        end = a.leases.finish_unit("r0000", 0, RequestStatus.CANCELLED, "stop")
        assert end == UnitEnd(RequestStatus.CANCELLED, "stop", 0)
    finally:
        a.close()


def test_a_unit_given_back_is_not_a_lost_attempt(store: Store) -> None:
    """A release (a drain's hand-over, units a node cannot start) takes its claim's attempt
    back; a lease that lapsed counts."""
    _requests(store, 1, 1)
    a = _node(store, "a")
    try:
        [first] = a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        assert first.attempts == 1 and a.leases.release_unit("r0000", 0)
        [again] = a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        assert again.attempts == 1
        assert expire_unit_leases(a) == 1  # lapsed: not given back
        [third] = a.leases.claim_units(capacity=10, lease_seconds=LONG_LEASE)
        assert third.attempts == 2
    finally:
        a.close()


def test_a_request_admitted_with_a_claim_leases_what_fits_to_its_node(store: Store) -> None:
    store.jobs.create(JOB)
    a = _node(store, "a")
    b = _node(store, "b") if store.dialect == "postgresql" else None
    try:
        req = RolloutRequest("r0", JOB.job_id, ((1,), (2,), (3,)), SAMPLING)  # n=2 each
        # As claim_units sizes a claim: units are taken while the samples before each stay
        # under the capacity, so 3 samples take 2 units.
        got = a.requests.admit(req, claim=AdmissionClaim(3, LONG_LEASE))
        assert got.created and got.request.status is RequestStatus.QUEUED
        assert [(c.request_id, c.prompt_index, c.attempts) for c in got.claims] == [
            ("r0", 0, 1), ("r0", 1, 1)
        ]  # fmt: skip
        # Leased to `a` as a claim leases them: renewable by `a`, the other unit claimable.
        assert a.leases.renew({("r0", 0), ("r0", 1)}, LONG_LEASE) == {("r0", 0), ("r0", 1)}
        claimer = b if b is not None else a
        assert [
            (c.prompt_index, c.attempts) for c in claimer.leases.claim_units(100, LONG_LEASE)
        ] == [(2, 1)]
        # A retry claims nothing and changes nothing; a request admitted without one leases
        # nothing.
        again = a.requests.admit(req, claim=AdmissionClaim(100, LONG_LEASE))
        assert not again.created and again.claims == ()
        plain = a.requests.admit(replace(req, request_id="r1"))
        assert plain.claims == () and len(claimer.leases.claim_units(100, LONG_LEASE)) == 3
        # Samples fenced by the lease as ever: the admitting node may write, only it.
        assert a.sample_batches.add([_sample("r0", 0, 0)]) == [True]
        if b is not None:
            assert isinstance(b.sample_batches.add([_sample("r0", 1, 0)])[0], Fenced)
    finally:
        a.close()
        if b is not None:
            b.close()


def test_a_sample_batch_that_completes_several_units_ends_each_and_counts_every_sample(
    store: Store,
) -> None:
    """One batch completing both units of a running request, one sample failed: both ends
    recorded (on PostgreSQL the first with the batch's samples_done), the request FAILED."""
    store.jobs.create(JOB)
    a = _node(store, "a")
    try:
        req = RolloutRequest("r0", JOB.job_id, ((1,), (2,)), SAMPLING)  # n=2 each
        a.requests.admit(req, claim=AdmissionClaim(100, LONG_LEASE))
        assert a.requests.mark_running("r0", "running on w0")
        failed = replace(_sample("r0", 1, 1), finish_reason=FinishReason.FAILED, error="oom")
        batch = [_sample("r0", 0, 0), _sample("r0", 0, 1), _sample("r0", 1, 0), failed]
        got = a.sample_batches.store(batch, end_units=True, worker_id="w0")
        why = "1 of 4 samples failed: oom"
        assert got.outcomes == [True] * 4
        assert got.ends == {
            ("r0", 0): UnitEnd(RequestStatus.RUNNING, "running on w0", 1),
            ("r0", 1): UnitEnd(RequestStatus.FAILED, why, 0),
        }
        stored = a.requests.get("r0")
        assert (stored.status, stored.status_reason, stored.samples_done) == (
            RequestStatus.FAILED, why, 4
        )  # fmt: skip
    finally:
        a.close()


def test_a_sample_batch_records_the_units_it_completes(store: Store) -> None:
    store.jobs.create(JOB)
    a = _node(store, "a")
    try:
        req = RolloutRequest("r0", JOB.job_id, ((1,), (2,)), SAMPLING)  # n=2 each
        a.requests.admit(req, claim=AdmissionClaim(100, LONG_LEASE))
        # QUEUED, and no worker named to record its start by: the unit's end is the node's.
        got = a.sample_batches.store([_sample("r0", 0, 0), _sample("r0", 0, 1)], end_units=True)
        assert got.outcomes == [True, True] and got.ends == {}
        assert a.requests.mark_running("r0", "running on w0")
        a.leases.finish_unit("r0", 0, None, "")
        # A partial sample does not complete its unit; the complete one that replaces it does.
        partial = replace(_sample("r0", 1, 0), partial=True, finish_reason=FinishReason.ABORTED)
        got = a.sample_batches.store([partial, _sample("r0", 1, 1)], end_units=True)
        assert got.outcomes == [True, True] and got.ends == {}
        assert a.requests.get("r0").status is RequestStatus.RUNNING
        got = a.sample_batches.store([_sample("r0", 1, 0)], end_units=True)
        # The last unit: the request's final status in the same transaction, as finish_unit.
        assert got.ends == {
            ("r0", 1): UnitEnd(RequestStatus.COMPLETED, "all 4 samples finished", 0)
        }
        assert a.requests.get("r0").status is RequestStatus.COMPLETED
        with pytest.raises(Fenced):  # done already: the node's own write finds it so
            a.leases.finish_unit("r0", 1, None, "")
        # QUEUED with the worker named: started as mark_running would, then its unit ended.
        a.requests.admit(replace(req, request_id="r2"), claim=AdmissionClaim(100, LONG_LEASE))
        got = a.sample_batches.store([_sample("r2", 0, 0), _sample("r2", 0, 1)], True, "w1")
        assert got.ends == {("r2", 0): UnitEnd(RequestStatus.RUNNING, "running on w1", 1)}
        assert not a.requests.mark_running("r2", "running on w1")  # the node's own write: a no-op
        # A batch that starts the request and ends it records both moves (one statement on
        # PostgreSQL), their events in order.
        one = RolloutRequest("r3", JOB.job_id, ((1,),), SAMPLING)
        a.requests.admit(one, claim=AdmissionClaim(100, LONG_LEASE))
        got = a.sample_batches.store([_sample("r3", 0, 0), _sample("r3", 0, 1)], True, "w1")
        assert got.ends == {
            ("r3", 0): UnitEnd(RequestStatus.COMPLETED, "all 2 samples finished", 0)
        }
        moves = [
            (e.old_status, e.new_status, e.reason) for e in a.history.list_events("request", "r3")
        ]
        assert moves == [
            ("", "queued", "submitted"),
            ("queued", "running", "running on w1"),
            ("running", "completed", "all 2 samples finished"),
        ]
        # Without end_units a complete unit stays open for the node to record.
        a.requests.admit(replace(req, request_id="r1"), claim=AdmissionClaim(100, LONG_LEASE))
        a.requests.mark_running("r1", "running on w0")
        got = a.sample_batches.store([_sample("r1", 0, 0), _sample("r1", 0, 1)])
        assert got.ends == {}
        assert a.leases.finish_unit("r1", 0, None, "").left == 1
    finally:
        a.close()


def test_a_unit_preferring_a_node_waits_for_it_then_goes_to_any(pg_store: Store) -> None:
    """A session's turn prefers the node holding its KV: another node leaves it alone for
    the affinity window, the preferred node takes it at once; past the window, anyone may."""
    store = pg_store
    store.jobs.create(JOB)
    turn = RolloutRequest("turn-1", JOB.job_id, ((1, 2, 3),), SAMPLING, preferred_node="b")
    store.requests.create(turn)
    store.requests.create(RolloutRequest("other", JOB.job_id, ((4, 5),), SAMPLING))
    a, b = _node(store, "a"), _node(store, "b")
    try:
        got = a.leases.claim_units(capacity=8, lease_seconds=LONG_LEASE, affinity_seconds=60)
        assert [c.request_id for c in got] == ["other"]  # turn-1 is left to b
        got = b.leases.claim_units(capacity=8, lease_seconds=LONG_LEASE, affinity_seconds=60)
        assert [c.request_id for c in got] == ["turn-1"]
        store.requests.create(
            RolloutRequest("turn-2", JOB.job_id, ((1, 2, 3, 4),), SAMPLING, preferred_node="b")
        )
        time.sleep(0.3)
        got = a.leases.claim_units(capacity=8, lease_seconds=LONG_LEASE, affinity_seconds=0.2)
        assert [c.request_id for c in got] == ["turn-2"]  # b did not take it in time
    finally:
        a.close()
        b.close()
