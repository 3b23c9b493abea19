"""Store behaviour on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from tltd.domain import (
    Device,
    DeviceKind,
    DeviceProcess,
    DeviceState,
    DrafterStatus,
    DrafterVersion,
    FinishReason,
    Job,
    JobStatus,
    LogprobMode,
    PromptLogprobs,
    RequestStatus,
    RolloutRequest,
    Sample,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeStats,
    TokenProvenance,
    TokenSource,
    TopLogprobs,
    Worker,
    WorkerKind,
    WorkerState,
)
from tltd.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from tltd.store import JobPaused, Store

JOB = Job(job_id="job-1", model_path="/models/tiny", name="grpo", priority=2, weight=0.5)
PROMPTS = ((1, 2, 3), (4, 5))
SAMPLING = SamplingParams(
    n=2, temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=16, stop_token_ids=(0,), seed=1234
)


def _request(request_id: str = "req-1", **kw) -> RolloutRequest:
    return RolloutRequest(
        request_id=request_id, job_id=JOB.job_id, prompts=PROMPTS, sampling=SAMPLING, **kw
    )


def _sample(p: int, s: int, tokens=(7, 8, 9), **kw) -> Sample:
    return Sample(
        request_id="req-1",
        prompt_index=p,
        sample_index=s,
        token_ids=tokens,
        logprobs=tuple(-0.5 for _ in tokens),
        finish_reason=FinishReason.STOP,
        **kw,
    )


def _events(store: Store, entity: str, entity_id: str) -> list[tuple[str, str, str]]:
    return [
        (e.old_status, e.new_status, e.reason)
        for e in store.history.list_events(entity=entity, entity_id=entity_id)
    ]


# ---- jobs ---------------------------------------------------------------------------------


def test_dialect(store: Store) -> None:
    assert store.dialect == ("sqlite" if store.url.startswith("sqlite") else "postgresql")


def test_create_job_is_idempotent(store: Store) -> None:
    job, created = store.jobs.create(JOB)
    assert created
    assert (job.status, job.policy_version, job.drafter_version) == (JobStatus.ACTIVE, 0, 0)
    assert job.created_at is not None and job.created_at.tzinfo == UTC
    again, created = store.jobs.create(JOB)
    assert not created
    assert again == job
    assert store.jobs.get(JOB.job_id) == job
    assert _events(store, "job", JOB.job_id) == [("", "active", "created")]


def test_create_job_conflict_names_the_field(store: Store) -> None:
    store.jobs.create(JOB)
    spec = SpeculativeConfig(batch_threshold=8)
    with pytest.raises(AlreadyExists) as exc:
        store.jobs.create(replace(JOB, model_path="/other", speculative=spec))
    assert exc.value.field == "job_id"
    assert "model_path" in str(exc.value) and "speculative" in str(exc.value)
    assert str(exc.value).startswith("job_id: ")


def test_round_trips_every_job_field(store: Store) -> None:
    spec = SpeculativeConfig(
        batch_threshold=4, draft_lengths=(1, 3), drafter="ngram", online_training=False
    )
    job, _ = store.jobs.create(replace(JOB, speculative=spec))
    assert job.speculative == spec
    assert (job.name, job.priority, job.weight) == ("grpo", 2, 0.5)


def test_not_found_names_the_field(store: Store) -> None:
    with pytest.raises(NotFound, match=r"^job_id: job 'nope' not found$"):
        store.jobs.get("nope")
    with pytest.raises(NotFound, match=r"^request_id: rollout request 'nope' not found$"):
        store.requests.get("nope")
    with pytest.raises(NotFound, match=r"^device_id: "):
        store.devices.get("cuda:9")
    with pytest.raises(NotFound, match=r"^worker_id: "):
        store.workers.set_state("w-x", WorkerState.READY, "")
    with pytest.raises(NotFound, match=r"^job_id: "):
        store.requests.create(_request())
    store.jobs.create(JOB)
    with pytest.raises(NotFound, match=r"^version: drafter version 3 of job 'job-1' not found"):
        store.drafters.get(JOB.job_id, 3)
    with pytest.raises(NotFound, match=r"^version: policy version 7"):
        store.policies.get(JOB.job_id, 7)


def test_list_jobs_newest_first_and_filtered(store: Store) -> None:
    for i in range(3):
        store.jobs.create(replace(JOB, job_id=f"j{i}"))
    store.jobs.set_status("j1", JobStatus.CANCELLED, "done")
    assert [j.job_id for j in store.jobs.list()] == ["j2", "j1", "j0"]
    assert [j.job_id for j in store.jobs.list([JobStatus.ACTIVE])] == ["j2", "j0"]
    assert [j.job_id for j in store.jobs.list(limit=1)] == ["j2"]


def test_job_transitions(store: Store) -> None:
    store.jobs.create(JOB)
    job = store.jobs.set_status(JOB.job_id, JobStatus.CANCELLED, "trainer finished")
    assert (job.status, job.status_reason) == (JobStatus.CANCELLED, "trainer finished")
    # Same status again is a harmless no-op; leaving a final status is not allowed.
    assert store.jobs.set_status(JOB.job_id, JobStatus.CANCELLED, "again").status_reason == (
        "trainer finished"
    )
    with pytest.raises(FailedPrecondition, match="job 'job-1' cannot go from cancelled to active"):
        store.jobs.set_status(JOB.job_id, JobStatus.ACTIVE, "revive")
    assert _events(store, "job", JOB.job_id) == [
        ("", "active", "created"),
        ("active", "cancelled", "trainer finished"),
    ]
    with pytest.raises(FailedPrecondition, match="job_id: job 'job-1' is cancelled"):
        store.requests.create(_request())
    with pytest.raises(FailedPrecondition):
        store.policies.add(JOB.job_id, "checkpoint", "/ckpt/1")


def test_concurrent_identical_creates_all_succeed(store: Store) -> None:
    """Retries racing each other (a trainer re-sending before the first answer): exactly one
    creates, the others get the same row back, none sees an error."""
    results: list[tuple[str, bool]] = []
    errors: list[BaseException] = []

    def create(i: int) -> None:
        try:
            if i % 2:
                job, created = store.jobs.create(JOB)
                results.append(("job", created))
            else:
                while True:  # the request needs the job; spin until a creator committed it
                    try:
                        _, created = store.requests.create(_request())
                        break
                    except NotFound:
                        continue
                results.append(("request", created))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results).count(("job", True)) == 1
    assert sorted(results).count(("request", True)) == 1
    assert len(results) == 8


# ---- policy versions ----------------------------------------------------------------------


def test_policy_versions_increment(store: Store) -> None:
    store.jobs.create(JOB)
    v0 = store.policies.get(JOB.job_id)
    assert (v0.version, v0.source, v0.path) == (0, "initial", JOB.model_path)
    v1 = store.policies.add(JOB.job_id, "checkpoint", "/ckpt/1", note="step 1")
    v2 = store.policies.add(JOB.job_id, "checkpoint", "/ckpt/2")
    assert (v1.version, v2.version, v1.note) == (1, 2, "step 1")
    assert store.jobs.get(JOB.job_id).policy_version == 2
    assert store.policies.get(JOB.job_id) == v2
    assert store.policies.get(JOB.job_id, 1) == v1
    assert [v.version for v in store.policies.list(JOB.job_id)] == [0, 1, 2]


def test_concurrent_policy_versions_get_distinct_numbers(store: Store) -> None:
    store.jobs.create(JOB)
    errors: list[BaseException] = []

    def push(i: int) -> None:
        try:
            store.policies.add(JOB.job_id, "checkpoint", f"/ckpt/{i}")
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [v.version for v in store.policies.list(JOB.job_id)] == list(range(7))


# ---- requests and samples -----------------------------------------------------------------


def test_create_request_is_idempotent(store: Store) -> None:
    store.jobs.create(JOB)
    req, created = store.requests.create(_request())
    assert created and req.status == RequestStatus.QUEUED and req.samples_done == 0
    assert (req.prompts, req.sampling) == (PROMPTS, SAMPLING)
    again, created = store.requests.create(_request())
    assert not created and again == req
    with pytest.raises(AlreadyExists, match=r"^request_id: .*'req-1'.*sampling"):
        store.requests.create(replace(_request(), sampling=replace(SAMPLING, n=3)))
    with pytest.raises(AlreadyExists, match="prompts"):
        store.requests.create(replace(_request(), prompts=((1, 2, 3),)))


def test_logprob_mode_and_provenance_flag_are_request_parameters(store: Store) -> None:
    """They round-trip, and a retry that asks for other logprobs or provenance is not the
    same request (its samples would carry something else)."""
    store.jobs.create(JOB)
    raw = replace(SAMPLING, logprob_mode=LogprobMode.RAW, return_provenance=True)
    req, _ = store.requests.create(replace(_request(), sampling=raw))
    assert store.requests.get("req-1").sampling == raw == req.sampling
    for other in (
        replace(raw, logprob_mode=LogprobMode.PROCESSED),
        replace(raw, return_provenance=False),
    ):
        with pytest.raises(AlreadyExists, match="sampling"):
            store.requests.create(replace(_request(), sampling=other))
    req, _ = store.requests.create(_request("req-2"))
    assert (req.sampling.logprob_mode, req.sampling.return_provenance) == (
        LogprobMode.PROCESSED,
        False,
    )


def test_top_and_prompt_logprobs_round_trip(store: Store) -> None:
    """Requests keep what they asked scored; samples keep the scores, -inf (a token top-k
    excluded) included, and nothing when not asked."""
    store.jobs.create(JOB)
    asked = replace(SAMPLING, top_logprobs=3, prompt_logprobs=0)
    req, _ = store.requests.create(replace(_request(), sampling=asked))
    assert store.requests.get("req-1").sampling == asked == req.sampling
    with pytest.raises(AlreadyExists, match="sampling"):
        store.requests.create(replace(_request(), sampling=replace(asked, prompt_logprobs=None)))
    top = (TopLogprobs((1, 2), (-0.5, float("-inf"))),)
    prompt = PromptLogprobs((-1.5, float("-inf")), (2, 40), (top[0], top[0]))
    first = replace(_sample(0, 0), token_ids=(5,), logprobs=(-0.5,))
    store.samples.add(replace(first, top_logprobs=top, prompt_logprobs=prompt))
    store.samples.add(_sample(0, 1))
    got = store.samples.list("req-1")
    assert got[0] == replace(first, top_logprobs=top, prompt_logprobs=prompt)
    assert (got[1].top_logprobs, got[1].prompt_logprobs) == (None, None)


def test_list_requests_queue_order_and_filters(store: Store) -> None:
    store.jobs.create(JOB)
    store.jobs.create(replace(JOB, job_id="job-2"))
    for i in range(3):
        store.requests.create(_request(f"r{i}"))
    store.requests.create(replace(_request("other"), job_id="job-2"))
    store.requests.set_status("r1", RequestStatus.RUNNING, "picked")
    assert [r.request_id for r in store.requests.list(job_id=JOB.job_id)] == ["r0", "r1", "r2"]
    queued = store.requests.list([RequestStatus.QUEUED], job_id=JOB.job_id)
    assert [r.request_id for r in queued] == ["r0", "r2"]
    assert len(store.requests.list(limit=2)) == 2
    assert len(store.requests.list()) == 4


def test_mark_running_moves_only_a_queued_request(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    assert store.requests.mark_running("req-1", "running on w0") is True
    assert store.requests.mark_running("req-1", "running on w1") is False  # running already
    req = store.requests.get("req-1")
    assert (req.status, req.status_reason) == (RequestStatus.RUNNING, "running on w0")
    store.requests.create(_request("req-2"))
    store.requests.set_status("req-2", RequestStatus.CANCELLED, "stop")
    assert store.requests.mark_running("req-2", "running on w0") is False  # ended meanwhile: stands
    assert store.requests.get("req-2").status is RequestStatus.CANCELLED
    assert _events(store, "request", "req-1") == [
        ("", "queued", "submitted"),
        ("queued", "running", "running on w0"),
    ]
    assert store.requests.mark_running("nope", "running on w0") is False


def test_create_request_unless_paused_stores_nothing_but_lets_a_retry_attach(
    store: Store,
) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request("stored"))
    store.jobs.set_paused(JOB.job_id, "hold")
    with pytest.raises(JobPaused):
        store.requests.create(_request("new"), unless_paused=True)
    with pytest.raises(NotFound):
        store.requests.get("new")
    assert store.requests.create(_request("stored"), unless_paused=True)[1] is False
    assert store.requests.create(_request("new"))[1] is True  # a pause gates only when asked
    store.jobs.set_paused(JOB.job_id, None)
    assert store.requests.create(_request("new-2"), unless_paused=True)[1] is True
    store.jobs.set_status(JOB.job_id, JobStatus.CANCELLED, "done")
    assert store.requests.create(_request("stored"))[1] is False  # a retry attaches still
    with pytest.raises(FailedPrecondition, match="cancelled"):
        store.requests.create(_request("new-3"))


def test_request_transitions_and_events(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    store.requests.set_status("req-1", RequestStatus.RUNNING, "worker w0")
    store.requests.set_status("req-1", RequestStatus.QUEUED, "worker lost")  # requeue
    store.requests.set_status("req-1", RequestStatus.RUNNING, "worker w1")
    req = store.requests.set_status("req-1", RequestStatus.COMPLETED, "all samples")
    assert (req.status, req.status_reason) == (RequestStatus.COMPLETED, "all samples")
    with pytest.raises(FailedPrecondition, match="request 'req-1' cannot go from completed"):
        store.requests.set_status("req-1", RequestStatus.CANCELLED, "too late")
    assert _events(store, "request", "req-1") == [
        ("", "queued", "submitted"),
        ("queued", "running", "worker w0"),
        ("running", "queued", "worker lost"),
        ("queued", "running", "worker w1"),
        ("running", "completed", "all samples"),
    ]
    store.requests.create(_request("req-2"))
    with pytest.raises(FailedPrecondition, match="from queued to completed"):
        store.requests.set_status("req-2", RequestStatus.COMPLETED, "")


def test_add_sample_idempotent_and_counts(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    spec = SpeculativeStats(
        draft_steps=2,
        plain_steps=1,
        accepted_tokens=5,
        mean_accepted_length=2.5,
        drafted_tokens=7,
        bonus_tokens=1,
        residual_tokens=1,
    )
    prov = (
        TokenProvenance(TokenSource.PLAIN),
        TokenProvenance(TokenSource.ACCEPTED, "ngram", 4),
        TokenProvenance(TokenSource.RESIDUAL, "ngram", 4),
    )
    first = _sample(1, 1, policy_version=3, drafter_version=2, speculative=spec, provenance=prov)
    assert store.samples.add(first) is True
    assert store.samples.add(first) is False
    assert store.samples.add(replace(first, token_ids=(1,), logprobs=(-1.0,))) is False
    assert store.samples.add(_sample(0, 1)) is True
    assert store.samples.add(_sample(0, 0)) is True
    assert store.requests.get("req-1").samples_done == 3
    got = store.samples.list("req-1")
    assert [(s.prompt_index, s.sample_index) for s in got] == [(0, 0), (0, 1), (1, 1)]
    assert got[2] == first  # every field round-trips, including spec stats and provenance
    assert got[0].provenance is None  # not asked for: none stored


def test_prune_history_deletes_only_ended_requests_and_events_before_the_cut(
    store: Store,
) -> None:
    store.jobs.create(JOB)
    for rid in ("old-done", "old-failed", "old-open"):
        store.requests.create(_request(rid))
    store.requests.set_status("old-done", RequestStatus.RUNNING, "w0")
    store.samples.add(replace(_sample(0, 0), request_id="old-done"))
    store.requests.set_status("old-done", RequestStatus.COMPLETED, "all samples")
    store.requests.set_status("old-failed", RequestStatus.FAILED, "bad")
    before_cut = len(store.history.list_events(limit=10_000))
    time.sleep(0.01)
    cut = datetime.now(UTC)
    time.sleep(0.01)
    store.requests.create(_request("new-done"))
    store.requests.set_status("new-done", RequestStatus.RUNNING, "w0")
    store.samples.add(replace(_sample(0, 0), request_id="new-done"))
    store.requests.set_status("new-done", RequestStatus.COMPLETED, "all samples")

    assert store.history.prune(cut, budget_seconds=-1) == (0, 0)  # out of time: next run
    assert store.history.prune(cut, batch=1) == (2, before_cut)  # batch=1: several rounds
    for rid in ("old-done", "old-failed"):
        with pytest.raises(NotFound):
            store.requests.get(rid)
    assert store.requests.get("old-open").status is RequestStatus.QUEUED  # open: kept
    assert len(store.samples.list("new-done")) == 1
    assert store.history.stats()["samples_total"] == 1
    assert [e[1] for e in _events(store, "request", "new-done")] == [
        "queued",
        "running",
        "completed",
    ]
    assert _events(store, "request", "old-open") == []  # its events predate the cut
    assert store.history.prune(cut) == (0, 0)


def test_partial_sample_is_replaced_by_complete_one(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    partial = replace(_sample(0, 0, tokens=(7,)), partial=True, finish_reason=FinishReason.ABORTED)
    assert store.samples.add(partial) is True
    assert store.requests.get("req-1").samples_done == 0  # partial samples are not "done"
    _, _, [seen], cursor = store.leases.stream_state("req-1", 0)
    assert seen.partial
    assert store.samples.add(_sample(0, 0)) is True
    assert store.samples.add(partial) is False
    assert store.requests.get("req-1").samples_done == 1
    (only,) = store.samples.list("req-1")
    assert (only.partial, only.token_ids) == (False, (7, 8, 9))
    # A stream that read the partial one reads the complete one after it (a new row id).
    _, _, [after], _ = store.leases.stream_state("req-1", cursor)
    assert (after.partial, after.token_ids) == (False, (7, 8, 9))


def test_an_ended_request_keeps_the_samples_it_streamed(store: Store) -> None:
    """A late complete sample (from a worker already given up on) does not replace the partial
    one stored and streamed in its place once the request ended; a sample not stored yet is
    still recorded (a cancel closes the request in the store before its samples are)."""
    store.jobs.create(JOB)
    store.requests.create(_request())
    lost = replace(_sample(0, 0, tokens=()), partial=True, finish_reason=FinishReason.FAILED)
    assert store.samples.add(replace(lost, logprobs=())) is True
    store.requests.set_status("req-1", RequestStatus.RUNNING, "")
    store.requests.set_status("req-1", RequestStatus.FAILED, "1 of 4 samples failed")
    assert store.samples.add(_sample(0, 0)) is False
    assert store.samples.add(_sample(0, 1)) is True
    got = store.samples.list("req-1")
    assert [(s.sample_index, s.partial) for s in got] == [(0, True), (1, False)]
    assert store.requests.get("req-1").samples_done == 1
    # Still open: a partial one left by a drain is replaced when it runs again.
    store.requests.create(_request("req-2"))
    aborted = replace(_sample(0, 0, tokens=(7,)), partial=True, finish_reason=FinishReason.ABORTED)
    assert store.samples.add(replace(aborted, request_id="req-2")) is True
    assert store.samples.add(replace(_sample(0, 0), request_id="req-2")) is True
    assert not store.samples.list("req-2")[0].partial


def test_add_sample_validates(store: Store) -> None:
    with pytest.raises(NotFound, match="^request_id: "):
        store.samples.add(_sample(0, 0))
    store.jobs.create(JOB)
    store.requests.create(_request())
    with pytest.raises(InvalidArgument, match="^prompt_index: "):
        store.samples.add(_sample(2, 0))
    with pytest.raises(InvalidArgument, match="^sample_index: "):
        store.samples.add(_sample(0, 2))
    # The same refusal on both databases (PostgreSQL's JSON has no NaN, SQLite stored it).
    for bad in (math.nan, -math.inf, math.inf):
        with pytest.raises(InvalidArgument, match=r"^logprobs\[1\]: .*not finite"):
            store.samples.add(replace(_sample(0, 0), logprobs=(-0.5, bad, -0.5)))
    assert store.samples.list("req-1") == []


def test_request_records_the_policy_version_it_was_accepted_on(store: Store) -> None:
    store.jobs.create(JOB)
    store.policies.add(JOB.job_id, "checkpoint", "/ckpt/1")
    req, _ = store.requests.create(_request())
    assert req.policy_version == 1
    store.policies.add(JOB.job_id, "checkpoint", "/ckpt/2")
    again, created = store.requests.create(_request())  # a retry after the update
    assert not created and again.policy_version == 1
    assert store.requests.get("req-1").policy_version == 1
    (listed,) = store.requests.list()
    assert listed.policy_version == 1


def test_cancel_job_racing_create_request_leaves_no_open_request(
    store: Store, tmp_path, monkeypatch
) -> None:
    """`requests.create` paused after it found the job ACTIVE, CancelJob meanwhile: the cancel
    waits for the request (PostgreSQL: the job row is share-locked) and cancels it."""
    from tests.api.support import make_settings
    from tltd.services import build_services
    from tltd.store import convert

    store.jobs.create(JOB)
    reached, go = threading.Event(), threading.Event()
    to_columns = convert.request_columns

    def paused(req):
        reached.set()
        go.wait(5)
        return to_columns(req)

    monkeypatch.setattr(convert, "request_columns", paused)
    # The admission of several statements, whose job read and insert a cancel could come
    # between (PostgreSQL's one-statement admission leaves no such gap: its hook runs first).
    monkeypatch.setattr(store.db, "one_statement", lambda: None)
    creator = threading.Thread(target=store.requests.create, args=(_request(),))
    creator.start()
    assert reached.wait(5)
    jobs = build_services(store, make_settings(tmp_path)).jobs
    canceller = threading.Thread(target=jobs.cancel, args=(JOB.job_id,))
    canceller.start()
    canceller.join(0.5)  # unfixed: the cancel finishes here, before the request exists
    go.set()
    creator.join(10)
    canceller.join(10)
    assert store.jobs.get(JOB.job_id).status is JobStatus.CANCELLED
    assert store.requests.get("req-1").status is RequestStatus.CANCELLED


def _cancel_job_transactions(store: Store, tmp_path, requests: int) -> int:
    """Transactions committed by CancelJob of a job with `requests` open requests: the first
    RUNNING with a sample stored, the second COMPLETED, the rest QUEUED."""
    from sqlalchemy import event

    from tests.api.support import make_settings
    from tltd.services import build_services

    job = replace(JOB, job_id=f"job-{requests}")
    store.jobs.create(job)
    rids = [f"r{requests}-{i:03d}" for i in range(requests)]
    for rid in rids:
        store.requests.create(replace(_request(rid), job_id=job.job_id))
    store.requests.set_status(rids[0], RequestStatus.RUNNING, "running")
    store.samples.add(replace(_sample(0, 1), request_id=rids[0]))
    store.requests.set_status(rids[1], RequestStatus.RUNNING, "running")
    store.requests.set_status(rids[1], RequestStatus.COMPLETED, "all samples finished")
    commits = []

    def count(conn) -> None:
        commits.append(conn)

    event.listen(store.db.engine, "commit", count)
    try:
        build_services(store, make_settings(tmp_path)).jobs.cancel(job.job_id, "over")
    finally:
        event.remove(store.db.engine, "commit", count)
    got = {rid: store.requests.get(rid) for rid in rids}
    assert got[rids[1]].status is RequestStatus.COMPLETED  # ended before: keeps its end
    for rid in [rids[0], *rids[2:]]:
        assert (got[rid].status, got[rid].status_reason) == (
            RequestStatus.CANCELLED, "job cancelled: over"
        )  # fmt: skip
        # Every unit ended, its missing samples stored partial: a stream of it ends.
        _, open_units, samples, _ = store.leases.stream_state(rid, 0)
        assert open_units == 0 and len(samples) == len(PROMPTS) * SAMPLING.n
        stored = {(x.prompt_index, x.sample_index): x for x in samples}
        assert not stored[(0, 1)].partial if rid == rids[0] else stored[(0, 1)].partial
        assert all(
            x.partial and x.finish_reason is FinishReason.CANCELLED and x.error == got[rid]
            .status_reason for k, x in stored.items() if not (rid == rids[0] and k == (0, 1))
        )  # fmt: skip
        events = store.history.list_events("request", rid)
        assert events[-1].new_status == "cancelled"
    return len(commits)


def test_cancel_job_cancels_its_requests_in_a_constant_number_of_transactions(
    store: Store, tmp_path
) -> None:
    """CancelJob ends every open request of the job (status, event, queued units, partial
    samples) in the same transactions whether it has 3 requests or 40."""
    assert _cancel_job_transactions(store, tmp_path, 3) == _cancel_job_transactions(
        store, tmp_path, 40
    )


# ---- drafters -----------------------------------------------------------------------------


def _drafter(version: int = 99) -> DrafterVersion:
    return DrafterVersion(
        job_id=JOB.job_id,
        version=version,
        policy_version=1,
        path="/drafters/x",
        train_steps=100,
        loss=0.25,
        acceptance_length=3.5,
    )


def test_drafter_numbering_and_active(store: Store) -> None:
    store.jobs.create(JOB)
    assert store.drafters.active_version(JOB.job_id) == 0
    d1 = store.drafters.add(_drafter())
    d2 = store.drafters.add(_drafter())
    assert (d1.version, d2.version) == (1, 2)  # dv.version is ignored
    assert (d1.status, d1.active, d1.loss, d1.train_steps) == (
        DrafterStatus.CANDIDATE,
        False,
        0.25,
        100,
    )
    assert store.drafters.active_version(JOB.job_id) == 0  # candidates are not active
    store.drafters.set_status(JOB.job_id, 1, DrafterStatus.PROMOTED, "acceptance 3.5")
    assert store.drafters.active_version(JOB.job_id) == 1
    store.drafters.set_status(JOB.job_id, 2, DrafterStatus.PROMOTED, "acceptance 4.0")
    assert store.drafters.active_version(JOB.job_id) == 2
    assert store.jobs.get(JOB.job_id).drafter_version == 2
    assert [j.drafter_version for j in store.jobs.list()] == [2]
    assert [d.active for d in store.drafters.list(JOB.job_id)] == [False, True]
    assert store.drafters.get(JOB.job_id, 2).active
    # Versions are numbered per job.
    store.jobs.create(replace(JOB, job_id="job-2"))
    assert store.drafters.add(replace(_drafter(), job_id="job-2")).version == 1


def test_pin_unpin_and_retire(store: Store) -> None:
    store.jobs.create(JOB)
    for _ in range(3):
        store.drafters.add(_drafter())
    store.drafters.set_status(JOB.job_id, 1, DrafterStatus.PROMOTED, "")
    store.drafters.set_status(JOB.job_id, 2, DrafterStatus.PROMOTED, "")
    assert store.drafters.pin(JOB.job_id, 1) == 1  # roll back to an older version
    assert store.jobs.get(JOB.job_id).drafter_version == 1
    assert [d.pinned for d in store.drafters.list(JOB.job_id)] == [True, False, False]
    with pytest.raises(FailedPrecondition, match="^version: drafter version 3 .* candidate"):
        store.drafters.pin(JOB.job_id, 3)  # not judged yet
    assert store.drafters.pin(JOB.job_id, 2) == 2  # moves the pin
    assert [d.pinned for d in store.drafters.list(JOB.job_id)] == [False, True, False]
    assert store.drafters.pin(JOB.job_id, 0) == 2  # unpin -> newest promoted
    store.drafters.pin(JOB.job_id, 2)
    retired = store.drafters.set_status(JOB.job_id, 2, DrafterStatus.RETIRED, "regressed")
    assert (retired.pinned, retired.active) == (False, False)  # retiring drops the pin
    assert store.drafters.active_version(JOB.job_id) == 1
    with pytest.raises(FailedPrecondition, match="^version: drafter version 2 .* retired"):
        store.drafters.pin(JOB.job_id, 2)
    store.drafters.set_status(JOB.job_id, 3, DrafterStatus.REJECTED, "worse")
    with pytest.raises(FailedPrecondition, match="rejected"):
        store.drafters.pin(JOB.job_id, 3)
    with pytest.raises(NotFound, match="^version: "):
        store.drafters.pin(JOB.job_id, 42)
    with pytest.raises(FailedPrecondition, match="drafter 'job-1/3' cannot go from rejected"):
        store.drafters.set_status(JOB.job_id, 3, DrafterStatus.PROMOTED, "")
    assert ("candidate", "promoted", "") in _events(store, "drafter", "job-1/1")
    assert ("pinned", "unpinned", "retired: regressed") in _events(store, "drafter", "job-1/2")


def test_candidates_left_by_a_crash_are_rejected(store: Store) -> None:
    """A kill -9 between recording a drafter version and judging it leaves a candidate: the
    start-up sweep rejects it (GC can then collect it); judged versions are left alone."""
    store.jobs.create(JOB)
    for _ in range(2):
        store.drafters.add(_drafter())
    store.drafters.set_status(JOB.job_id, 1, DrafterStatus.PROMOTED, "better")
    why = "evaluation interrupted by a restart"
    assert [d.version for d in store.drafters.reject_candidates(why)] == [2]
    got = store.drafters.list(JOB.job_id)
    assert [d.status for d in got] == [DrafterStatus.PROMOTED, DrafterStatus.REJECTED]
    assert ("candidate", "rejected", why) in _events(store, "drafter", "job-1/2")
    assert store.drafters.reject_candidates(why) == []


# ---- devices and workers ------------------------------------------------------------------


def _gpu(i: int, **kw) -> Device:
    return Device(
        device_id=f"cuda:{i}",
        kind=DeviceKind.CUDA,
        index=i,
        uuid=f"GPU-{i}",
        name="H100",
        memory_total_bytes=80 << 30,
        **kw,
    )


def test_device_upsert_preserves_operator_flags(store: Store) -> None:
    devs = store.devices.upsert([_gpu(0), _gpu(1)])
    assert [d.device_id for d in devs] == ["cuda:0", "cuda:1"]
    store.devices.set_flags("cuda:0", cordoned=True, reason="bad fan")
    store.devices.set_flags("cuda:1", draining=True, reason="maintenance")
    store.devices.set_state("cuda:1", DeviceState.ROLLOUT, "worker w1")
    proc = DeviceProcess(pid=4242, used_memory_bytes=1 << 30)
    devs = store.devices.upsert(
        [
            _gpu(0, memory_used_bytes=5 << 30, utilization=0.5, processes=(proc,)),
            _gpu(1),
        ]
    )
    d0, d1 = devs
    assert (d0.cordoned, d0.draining, d0.memory_used_bytes, d0.utilization) == (
        True,
        False,
        5 << 30,
        0.5,
    )
    assert d0.processes == (proc,)
    assert (d1.cordoned, d1.draining, d1.state) == (False, True, DeviceState.ROLLOUT)
    assert not d0.schedulable and not d1.schedulable
    assert _events(store, "device", "cuda:0") == [
        ("", "idle", "discovered"),
        ("schedulable", "cordoned", "bad fan"),
    ]
    store.devices.set_flags("cuda:0", cordoned=False, reason="fixed")
    assert store.devices.get("cuda:0").schedulable


def test_vanished_device_becomes_unavailable_and_returns(store: Store) -> None:
    store.devices.upsert([_gpu(0), _gpu(1)])
    store.devices.set_flags("cuda:1", cordoned=True, reason="x")
    d0, d1 = store.devices.upsert([_gpu(0)])
    assert d1.state == DeviceState.UNAVAILABLE and d1.state_reason
    assert d0.state == DeviceState.IDLE
    d1 = store.devices.upsert([_gpu(0), _gpu(1)])[1]
    assert (d1.state, d1.cordoned) == (DeviceState.IDLE, True)
    assert [e[:2] for e in _events(store, "device", "cuda:1")][-2:] == [
        ("idle", "unavailable"),
        ("unavailable", "idle"),
    ]


def test_an_unavailable_device_is_made_usable_by_the_inventory_only(store: Store) -> None:
    """Training on a GPU that vanishes: the tick preempts it, and the trainer then gives the
    device back (IDLE). That write must not make the broken GPU schedulable again."""
    store.devices.upsert([_gpu(0), _gpu(1)])
    store.devices.set_state("cuda:1", DeviceState.TRAINING, "drafter training job-1")
    store.devices.upsert([_gpu(0)])  # the refresh no longer sees cuda:1
    for state in (DeviceState.IDLE, DeviceState.ROLLOUT, DeviceState.TRAINING):
        d1 = store.devices.set_state("cuda:1", state, "training gave the device back")
        assert d1.state == DeviceState.UNAVAILABLE and not d1.schedulable
    assert store.devices.get("cuda:1").state == DeviceState.UNAVAILABLE
    assert [e[:2] for e in _events(store, "device", "cuda:1")][-1] == ("training", "unavailable")
    d1 = store.devices.upsert([_gpu(0), _gpu(1)])[1]  # seen again
    assert d1.state == DeviceState.IDLE and d1.schedulable
    assert store.devices.set_state("cuda:1", DeviceState.ROLLOUT, "w").state == DeviceState.ROLLOUT


def test_foreign_device_reason(store: Store) -> None:
    store.devices.upsert([_gpu(0)])
    (d,) = store.devices.upsert([_gpu(0, foreign=True, state_reason="foreign process pid 7")])
    assert d.foreign and d.state_reason == "foreign process pid 7" and not d.schedulable
    (d,) = store.devices.upsert([_gpu(0)])
    assert not d.foreign and d.state_reason == ""
    assert [e[:2] for e in _events(store, "device", "cuda:0")][-2:] == [
        ("ours", "foreign"),
        ("foreign", "ours"),
    ]


def test_worker_lifecycle(store: Store) -> None:
    w = store.workers.upsert(
        Worker(
            worker_id="w0", kind=WorkerKind.ROLLOUT, device_id="cpu:0", job_id=JOB.job_id, pid=123
        )
    )
    assert w.state == WorkerState.STARTING and w.started_at is not None
    store.workers.upsert(
        Worker(worker_id="w1", kind=WorkerKind.DRAFTER_TRAINING, device_id="cpu:1")
    )
    store.workers.set_state("w0", WorkerState.READY, "loaded")
    store.workers.set_state("w0", WorkerState.BUSY, "req-1")
    store.workers.set_state("w0", WorkerState.READY, "done")
    with pytest.raises(FailedPrecondition, match="worker 'w0' cannot go from ready to stopped"):
        store.workers.set_state("w0", WorkerState.STOPPED, "")
    store.workers.set_state("w0", WorkerState.STOPPING, "shutdown")
    store.workers.set_state("w0", WorkerState.STOPPED, "exited 0")
    with pytest.raises(FailedPrecondition):
        store.workers.set_state("w0", WorkerState.READY, "")
    # A stopped worker slot can be started again (a restart), with a new pid.
    w = store.workers.upsert(replace(w, pid=456, state=WorkerState.STARTING))
    assert (w.state, w.pid) == (WorkerState.STARTING, 456)
    hb = store.workers.heartbeat("w0")
    assert hb.last_heartbeat is not None
    assert [x.worker_id for x in store.workers.list()] == ["w0", "w1"]
    assert [x.worker_id for x in store.workers.list("cpu:1")] == ["w1"]
    assert [e[1] for e in _events(store, "worker", "w0")] == [
        "starting",
        "ready",
        "busy",
        "ready",
        "stopping",
        "stopped",
        "starting",
    ]
    store.workers.set_state("w1", WorkerState.FAILED, "crashed")
    assert store.workers.get("w1").state_reason == "crashed"


# ---- events and stats ---------------------------------------------------------------------


def test_list_events_filters_and_limit(store: Store) -> None:
    store.jobs.create(JOB)
    for i in range(3):
        store.requests.create(_request(f"r{i}"))
    events = store.history.list_events()
    assert [e.entity for e in events] == ["job", "request", "request", "request"]
    ids = [e.event_id for e in events]
    assert ids == sorted(ids)
    assert [e.entity_id for e in store.history.list_events(limit=2)] == ["r1", "r2"]  # latest two
    assert [e.entity_id for e in store.history.list_events(entity="request", entity_id="r0")] == [
        "r0"
    ]


def test_stats(store: Store) -> None:
    empty = store.history.stats()
    assert empty["samples_total"] == 0 and empty["mean_accepted_length"] == 0.0
    assert empty["requests_by_status"] == {s.value: 0 for s in RequestStatus}
    store.jobs.create(JOB)
    store.jobs.create(replace(JOB, job_id="gone"))
    store.jobs.set_status("gone", JobStatus.FAILED, "oom")
    store.requests.create(_request())
    store.requests.create(_request("req-2"))
    store.requests.set_status("req-2", RequestStatus.RUNNING, "")
    # Accepted length weighted by draft steps: (2*2.0 + 6*4.0) / 8 = 3.5; plain samples ignored.
    store.samples.add(_sample(0, 0, tokens=(1, 2, 3), speculative=SpeculativeStats(2, 0, 4, 2.0)))
    store.samples.add(_sample(0, 1, tokens=(1,) * 10, speculative=SpeculativeStats(6, 1, 24, 4.0)))
    store.samples.add(_sample(1, 0, tokens=(1, 2)))
    stats = store.history.stats()
    assert stats["requests_by_status"]["queued"] == 1
    assert stats["requests_by_status"]["running"] == 1
    assert stats["samples_total"] == 3
    assert stats["tokens_generated"] == 15
    assert stats["mean_accepted_length"] == pytest.approx(3.5)
    assert stats["jobs_active"] == 1


def test_state_survives_reopen(store: Store) -> None:
    store.jobs.create(JOB)
    store.requests.create(_request())
    store.close()
    reopened = Store(store.url)
    try:
        assert reopened.requests.get("req-1").sampling == SAMPLING
        assert reopened.jobs.get(JOB.job_id).created_at.tzinfo == UTC
    finally:
        reopened.close()


def test_uint64_seeds_and_uint32_job_numbers_round_trip(store):
    """The API's whole uint64 seed range in a signed BIGINT column (two's complement, so a
    seed >= 2**63 is stored negative and read back as given), and uint32 priorities and SD
    batch thresholds beyond a signed INTEGER."""
    big = 2**32 - 1
    job = replace(JOB, priority=big, speculative=SpeculativeConfig(batch_threshold=big))
    store.jobs.create(job)
    got = store.jobs.get(JOB.job_id)
    assert got.priority == big and got.speculative.batch_threshold == big
    for i, seed in enumerate((0, 2**63 - 1, 2**63, 2**64 - 1)):
        req = replace(_request(f"req-{i}"), sampling=replace(SAMPLING, seed=seed))
        stored, created = store.requests.create(req)
        assert created and stored.sampling.seed == seed
        assert store.requests.get(f"req-{i}").sampling.seed == seed
        # A retry with the same seed is the same request (not ALREADY_EXISTS).
        assert store.requests.create(req)[1] is False
    with pytest.raises(AlreadyExists):
        store.requests.create(replace(_request("req-3"), sampling=replace(SAMPLING, seed=7)))


def test_prompt_history_finds_a_prompts_whole_answers_across_requests(store: Store) -> None:
    store.jobs.create(JOB)
    store.jobs.create(replace(JOB, job_id="job-2"))
    store.requests.create(_request("req-1"))  # prompts (1, 2, 3) and (4, 5)
    store.requests.create(replace(_request("req-2"), prompts=((4, 5), (1, 2, 3))))
    store.requests.create(replace(_request("req-3"), job_id="job-2"))  # another job
    for rid, p, s, toks, partial in [
        ("req-1", 0, 0, (10, 11), False),
        ("req-1", 0, 1, (12,), True),  # partial: not an answer
        ("req-1", 1, 0, (20,), False),
        ("req-2", 1, 1, (13, 14), False),  # (1, 2, 3) again, at another index
        ("req-3", 0, 0, (99,), False),
    ]:
        store.samples.add(replace(_sample(p, s, toks), request_id=rid, partial=partial))
    got = store.samples.prompt_history(JOB.job_id, (1, 2, 3), limit=10)
    assert got == [(("req-1", 0, 0), (10, 11)), (("req-2", 1, 1), (13, 14))]  # oldest first
    assert store.samples.prompt_history(JOB.job_id, (1, 2, 3), limit=1) == [
        (("req-2", 1, 1), (13, 14))
    ]
    assert store.samples.prompt_history(JOB.job_id, (4, 5), limit=10) == [(("req-1", 1, 0), (20,))]
    assert store.samples.prompt_history(JOB.job_id, (1, 2), limit=10) == []
