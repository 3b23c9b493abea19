"""Group-committed sample writes (`store.sample_batches.add`) follow `store.samples.add`'s rules
sample by sample, on SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import event

from tests.store.test_leases import LONG_LEASE, _node
from tests.store.test_store_api import JOB, SAMPLING, _request, _sample
from tltd.domain import (
    FinishReason,
    PromptLogprobs,
    Sample,
    SpeculativeStats,
    TokenProvenance,
    TokenSource,
    TopLogprobs,
)
from tltd.errors import Fenced, InvalidArgument, NotFound
from tltd.store import Store


def test_a_batch_stores_each_sample_by_the_single_write_rules(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    assert store.samples.add(_sample(0, 0, tokens=(1,)))
    partial = replace(_sample(1, 0, tokens=(2,)), partial=True, finish_reason=FinishReason.ABORTED)
    assert store.samples.add(partial)
    batch = [
        _sample(0, 0, tokens=(9, 9)),  # a duplicate: the stored copy stands
        _sample(0, 1, tokens=(3,)),  # new
        _sample(1, 0, tokens=(4, 5)),  # complete, replaces the partial one
        _sample(1, 1, tokens=(6,)),  # new
        _sample(1, 1, tokens=(7,)),  # the same key again in the batch: a duplicate
        _sample(5, 0),  # no such prompt
        _sample(0, 9),  # no such sample index
        replace(_sample(0, 1), logprobs=(float("nan"), -1.0, -1.0)),  # not finite
        replace(_sample(0, 0), request_id="req-missing"),
    ]
    got = store.sample_batches.add(batch)
    assert got[:5] == [False, True, True, True, False]
    assert isinstance(got[5], InvalidArgument) and got[5].field == "prompt_index"
    assert isinstance(got[6], InvalidArgument) and got[6].field == "sample_index"
    assert isinstance(got[7], InvalidArgument) and got[7].field == "logprobs[0]"
    assert isinstance(got[8], NotFound)
    stored = {(s.prompt_index, s.sample_index): s for s in store.samples.list("req-1")}
    assert {k: s.token_ids for k, s in stored.items()} == {
        (0, 0): (1,), (0, 1): (3,), (1, 0): (4, 5), (1, 1): (6,)
    }  # fmt: skip
    assert not stored[(1, 0)].partial
    req = store.requests.get("req-1")
    assert req.samples_done == 4 == req.samples_total
    # The replacement has a larger row id than every sample before it: a stream reading
    # past the last id it saw finds it.
    _, _, after_first, _ = store.leases.stream_state("req-1", 0)
    assert [(s.prompt_index, s.sample_index) for s in after_first][-1] in {(1, 0), (1, 1)}


def test_an_ended_request_keeps_what_its_streams_were_given(store: Store) -> None:
    from tltd.domain import RequestStatus

    store.jobs.create(JOB)
    store.requests.create(_request())
    partial = replace(_sample(0, 0), partial=True, finish_reason=FinishReason.CANCELLED)
    assert store.sample_batches.add([partial]) == [True]
    store.requests.set_status("req-1", RequestStatus.CANCELLED, "test")
    # Not stored yet: still recorded; a replacement of the partial one: refused.
    assert store.sample_batches.add([_sample(0, 0), _sample(0, 1)]) == [False, True]
    assert [s.partial for s in store.samples.list("req-1")] == [True, False]
    assert store.requests.get("req-1").samples_done == 1


def test_leases_fence_each_unit_of_a_batch(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    a = _node(store, "a")
    try:
        claims = a.leases.claim_units(capacity=2, lease_seconds=LONG_LEASE)
        assert [c.prompt_index for c in claims] == [0]  # prompt 1 stays queued
        got = a.sample_batches.add([_sample(0, 0), _sample(1, 0), _sample(0, 1)])
        assert got[0] is True and got[2] is True and isinstance(got[1], Fenced)
        assert [(s.prompt_index, s.sample_index) for s in a.samples.list("req-1")] == [
            (0, 0), (0, 1)
        ]  # fmt: skip
    finally:
        a.close()


def test_a_batch_over_several_requests_is_one_write_each(store: Store) -> None:
    store.jobs.create(JOB)
    for rid in ("req-b", "req-a"):
        store.requests.create(_request(rid))
    batch = [
        Sample(rid, p, s, (p, s), (-0.1, -0.2), FinishReason.LENGTH)
        for rid in ("req-b", "req-a")
        for p in range(2)
        for s in range(2)
    ]
    assert store.sample_batches.add(batch) == [True] * 8
    for rid in ("req-a", "req-b"):
        samples = store.samples.list(rid)
        assert [s.token_ids for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [s.logprobs for s in samples] == [(-0.1, -0.2)] * 4
        assert store.requests.get(rid).samples_done == 4


def test_a_batch_in_range_checks_its_keys_against_the_work_units_not_the_prompts(
    store: Store,
) -> None:
    """The prompts (a request's largest column: 512 prompts of 200 tokens are ~100k ids of
    JSON) are read only to word the error for an index out of range."""
    store.jobs.create(JOB)
    store.requests.create(_request())
    statements: list[str] = []

    def seen(conn, cursor, statement, params, context, executemany) -> None:
        statements.append(statement)

    event.listen(store.db.engine, "before_cursor_execute", seen)
    try:
        assert store.sample_batches.add([_sample(0, 0), _sample(1, 1)]) == [True, True]
        assert statements and not any("rollout_requests.prompts" in x for x in statements)
        got = store.sample_batches.add([_sample(0, 1), _sample(2, 0)])
    finally:
        event.remove(store.db.engine, "before_cursor_execute", seen)
    assert got[0] is True
    assert isinstance(got[1], InvalidArgument) and got[1].field == "prompt_index"
    assert f"for {len(_request().prompts)} prompts" in str(got[1])


def test_a_batch_stores_every_column_as_a_single_write_does(store: Store) -> None:
    """The batch's INSERT (on PostgreSQL from arrays sent in the binary format) keeps every
    field: packed and JSON token ids, -inf and fractional floats, JSON columns, text with
    quotes, backslashes and non-ASCII characters, flags and counters."""
    store.jobs.create(JOB)
    store.requests.create(replace(_request(), sampling=replace(SAMPLING, top_logprobs=2)))
    top = TopLogprobs((1, 2), (-0.5, float("-inf")))
    prov = (TokenProvenance(TokenSource.PLAIN), TokenProvenance(TokenSource.ACCEPTED, "ngram", 4))
    batch = [
        _sample(0, 0, tokens=(2**31, 5), policy_version=7, simulated=True),  # ids beyond int32
        _sample(
            0, 1, tokens=(1, 2), speculative=SpeculativeStats(2, 1, 5, 2.5, 7, 1, 1),
            provenance=prov, top_logprobs=(top, top), policy_spans=((0, 1), (1, 2)),
        ),
        replace(
            _sample(1, 0, tokens=(3,), drafter_version=2), logprobs=(-1e-300,),
            prompt_logprobs=PromptLogprobs((-1.5, float("-inf")), (2, 40), (top, top)),
        ),
        replace(
            _sample(1, 1, tokens=()), finish_reason=FinishReason.ABORTED,
            error='a "quoted" \\ {braces}, NULL, \u00e9\u4e2d',
        ),
    ]  # fmt: skip
    assert store.sample_batches.add(batch) == [True] * 4
    assert store.samples.list("req-1") == batch
