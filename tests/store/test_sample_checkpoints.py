"""Checkpoints of running samples (`store.checkpoints`), on SQLite and PostgreSQL: the longest
per sample, fenced by the unit's lease, read back as the unfinished sample that was saved."""

from __future__ import annotations

from dataclasses import replace

from tests.store.test_leases import LONG_LEASE, _node
from tests.store.test_store_api import JOB, _request, _sample
from tltd.domain import FinishReason, Sample
from tltd.store import Store


def _running(p: int, i: int, tokens: tuple[int, ...], **kw) -> Sample:
    """A running sample's form as a worker checkpoints it: ABORTED, partial."""
    base = _sample(p, i, tokens=tokens)
    return replace(
        base,
        logprobs=tuple(-0.5 - t / 100 for t in range(len(tokens))),
        finish_reason=FinishReason.ABORTED,
        partial=True,
        **kw,
    )


def test_each_sample_keeps_its_longest_checkpoint_with_its_versions(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    a = _node(store, "a")
    try:
        a.leases.claim_units(capacity=8, lease_seconds=LONG_LEASE)
        first = _running(0, 0, (5, 6), policy_version=0)
        longer = _running(0, 0, (5, 6, 7, 8), policy_version=0, policy_spans=((0, 0), (2, 1)))
        assert a.checkpoints.save([first, _running(1, 1, (9,))]) == 2
        assert a.checkpoints.save([longer]) == 1
        assert a.checkpoints.save([first]) == 1  # sent, but shorter: the longer one stays
        got = {(s.prompt_index, s.sample_index): s for s in a.checkpoints.of_units("req-1", [0, 1])}
        assert set(got) == {(0, 0), (1, 1)}
        assert got[(0, 0)].token_ids == (5, 6, 7, 8)
        assert got[(0, 0)].logprobs == longer.logprobs
        assert got[(0, 0)].policy_spans == ((0, 0), (2, 1))
        assert got[(0, 0)].finish_reason is FinishReason.ABORTED and got[(0, 0)].partial
        assert a.checkpoints.of_units("req-1", [1])[0].token_ids == (9,)
        # Checkpoints are not results: the request's samples are untouched.
        assert store.samples.list("req-1") == []
    finally:
        a.close()


def test_only_the_node_holding_the_unit_writes_its_checkpoint(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    a = _node(store, "a")
    try:
        claims = a.leases.claim_units(capacity=2, lease_seconds=LONG_LEASE)
        assert [c.prompt_index for c in claims] == [0]  # prompt 1 stays queued
        assert a.checkpoints.save([_running(0, 0, (1,)), _running(1, 0, (4,))]) == 1
        assert [s.token_ids for s in store.checkpoints.of_units("req-1", [0, 1])] == [(1,)]
    finally:
        a.close()


def test_retention_deletes_a_requests_checkpoints(store: Store) -> None:
    from datetime import timedelta

    from tltd.domain import RequestStatus
    from tltd.store.tables import utcnow

    store.jobs.create(JOB)
    store.requests.create(_request())
    store.checkpoints.save([_running(0, 0, (1, 2))])
    store.requests.set_status("req-1", RequestStatus.CANCELLED, "test")
    store.history.prune(utcnow() + timedelta(seconds=1))
    assert store.checkpoints.of_units("req-1", [0]) == []
