"""RolloutClient / AsyncRolloutClient generate against a real daemon with real rollout worker
processes: complete and lossless results as plain values, streaming, retries, policy versions,
and the metrics the supervisor records for every sample."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tests.api.support import make_settings
from tests.rollout.support import InProcessDaemon, direct_outputs, make_checkpoint, wait_until
from tltd.domain import FinishReason, RequestStatus, SamplingParams
from tltd.errors import NotFound
from tltd.metrics import METRICS
from tltd.store import Store
from tltd.v1 import rollout_pb2
from tltd_clients import AsyncRolloutClient, RolloutClient, by_prompt
from tltd_clients.errors import DeadlineExceededError

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


@pytest.fixture
def daemon(migrated_sqlite_url, tmp_path) -> Iterator[InProcessDaemon]:
    sqlite_url = migrated_sqlite_url
    store = Store(sqlite_url)
    settings = make_settings(
        tmp_path,
        cpu_slots=2,
        worker_max_batch=16,
        worker_max_seq_len=128,
        worker_heartbeat_seconds=0.2,
        shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0,
    )
    d = InProcessDaemon(settings, store).start()
    try:
        yield d
    finally:
        d.kill()
        store.close()


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "policy")


def engine_steps() -> float:
    """Engine decode steps the supervisor has counted from worker heartbeats, all devices."""
    return sum(
        s.value
        for family in METRICS.registry.collect()
        for s in family.samples
        if s.name == "tltd_engine_decode_steps_total"
    )


def test_generate_round_trip(daemon, ckpt, tmp_path):
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    steps_before = engine_steps()
    expected = direct_outputs(ckpt, PROMPTS, greedy)
    tokens_before = METRICS.registry.get_sample_value(
        "tltd_rollout_tokens_total", {"job_id": "rc-job"}
    )
    with RolloutClient(daemon.target) as client:
        client.create_job(ckpt, job_id="rc-job")
        samples = client.generate(PROMPTS, sampling=greedy, request_id="rc-1")
        # All samples, in (prompt, sample) order, as plain values.
        assert [(s.prompt_index, s.sample_index) for s in samples] == [
            (p, i) for p in range(3) for i in range(2)
        ]
        assert {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples} == expected
        for s in samples:
            assert isinstance(s.token_ids, list) and len(s.logprobs) == len(s.token_ids)
            assert s.finish_reason in ("stop", "length") and s.policy_version == 0
            assert s.request_id == "rc-1" and not s.partial
        # A retry with the same request id attaches to the finished work: same samples.
        assert client.generate(PROMPTS, sampling=greedy, request_id="rc-1") == samples
        # Streaming yields every sample once; keywords override the params object.
        streamed = list(client.stream(PROMPTS[:1], sampling=greedy, n=3, speculative="off"))
        assert sorted((s.prompt_index, s.sample_index) for s in streamed) == [
            (0, 0),
            (0, 1),
            (0, 2),
        ]
        assert all(s.draft_steps == 0 for s in streamed)
        assert [len(g) for g in by_prompt(samples)] == [2, 2, 2]

        # A new policy: later samples carry its version.
        new = make_checkpoint(tmp_path / "policy-2", seed=7)
        assert client.update_policy(new) == 1
        after = client.generate(PROMPTS[:1], n=1, temperature=0.0, max_new_tokens=10)
        assert after[0].policy_version == 1
        assert tuple(after[0].token_ids) == direct_outputs(new, PROMPTS[:1], greedy)[(0, 0)]

    # The supervisor counted every sample it served (retries attach, they do not recount).
    tokens = METRICS.registry.get_sample_value("tltd_rollout_tokens_total", {"job_id": "rc-job"})
    served = sum(len(s.token_ids) for s in samples + streamed + after)
    assert tokens - (tokens_before or 0) == served
    # Heartbeats carry the engines' counters: the steps that produced them show up too.
    deadline = time.monotonic() + 10
    while engine_steps() - steps_before < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_steps() - steps_before >= 10  # at least max_new_tokens steps were decoded


def test_async_generate_and_stream(daemon, ckpt):
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)

    async def scenario():
        async with AsyncRolloutClient(daemon.target) as client:
            await client.create_job(ckpt, job_id="async-job")
            got = await client.generate(PROMPTS, sampling=sampling, request_id="a-1")
            streamed = [s async for s in client.stream(PROMPTS, sampling=sampling,
                                                       request_id="a-1")]  # fmt: skip
            return got, streamed

    got, streamed = asyncio.run(scenario())
    assert len(got) == 6 and sorted(streamed, key=lambda s: (s.prompt_index, s.sample_index)) == got
    assert all(len(s.logprobs) == len(s.token_ids) > 0 for s in got)


# Enough work that it is still running when the caller gives up: waves of 32 samples.
LONG = SamplingParams(n=32, temperature=1.0, max_new_tokens=80)


def stored(daemon: InProcessDaemon, request_id: str) -> bool:
    try:
        daemon.store.requests.get(request_id)
    except NotFound:
        return False
    return True


def request_status(client: RolloutClient, request_id: str, want: str) -> str:
    """The request's status, polled briefly until it is `want` (cancelling is asynchronous
    only on the worker side; the stored status changes with the CancelRequest call, which a
    loaded machine may make seconds late)."""
    deadline = time.monotonic() + 30
    while True:
        status = client.raw.get_request(request_id).request.status
        name = rollout_pb2.RequestStatus.Name(status).removeprefix("REQUEST_STATUS_").lower()
        if name == want or time.monotonic() > deadline:
            return name
        time.sleep(0.05)


def occupy_workers(client: RolloutClient) -> Iterator:
    """A running request that fills every worker (3 waves of 32 samples on 2 x 16 slots), so
    that a request sent next stays queued behind it; close the returned stream to cancel it."""
    blocker = client.stream(PROMPTS, sampling=LONG)
    next(blocker)
    return blocker


def test_abandoned_streams_are_cancelled_and_ids_are_fresh(daemon, ckpt):
    with RolloutClient(daemon.target) as client:
        client.create_job(ckpt, job_id="abandon", speculative="off")
        # No request_id given: a fresh one per call, exposed before any sample arrives.
        stream = client.stream(PROMPTS, sampling=LONG)
        first_id = client.last_request_id
        assert first_id and first_id.startswith("req-")
        sample = next(stream)
        assert sample.request_id == first_id
        stream.close()  # the caller stops reading: the daemon must stop the work
        assert request_status(client, first_id, "cancelled") == "cancelled"

        for _sample in client.stream(PROMPTS, sampling=LONG):
            break  # same through `break` (CPython closes the generator at once)
        assert client.last_request_id != first_id
        assert request_status(client, client.last_request_id, "cancelled") == "cancelled"

        # A stream read to its end is left alone.
        done = client.generate(PROMPTS[:1], n=1, max_new_tokens=4)
        assert request_status(client, done[0].request_id, "completed") == "completed"

        # A timeout gives up too: typed error, request cancelled (a retry duplicates nothing).
        # Queued behind a request that fills the workers, the deadline surely comes first.
        blocker = occupy_workers(client)
        with pytest.raises(DeadlineExceededError):
            client.generate(PROMPTS, sampling=LONG, timeout=0.3)
        assert request_status(client, client.last_request_id, "cancelled") == "cancelled"
        blocker.close()


def test_async_abandoned_streams_are_cancelled(daemon, ckpt):
    async def scenario() -> tuple[str, str]:
        async with AsyncRolloutClient(daemon.target) as client:
            await client.create_job(ckpt, job_id="async-abandon", speculative="off")
            stream = client.stream(PROMPTS, sampling=LONG)
            closed = client.last_request_id
            assert (await anext(stream)).request_id == closed
            await stream.aclose()
            # A caller's own deadline cancels the iterating task inside the generator. The
            # workers are paused (SIGSTOP) first: the request then cannot get a sample before
            # the deadline, however loaded the machine.
            with paused_workers(daemon):
                stream = client.stream(PROMPTS, sampling=LONG, request_id="async-timeout")
                waiting = asyncio.ensure_future(anext(stream))
                # The deadline passes once the daemon holds the request (on a loaded machine
                # a 0.3 s deadline could pass before the call arrived: nothing would exist to
                # cancel; a deadline during admission is the test further below).
                await asyncio.to_thread(
                    wait_until, lambda: stored(daemon, "async-timeout"), 60, "request stored"
                )
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(waiting, 0.3)
            return closed, client.last_request_id

    closed, timed_out = asyncio.run(scenario())
    assert timed_out == "async-timeout"
    with RolloutClient(daemon.target) as client:
        assert request_status(client, closed, "cancelled") == "cancelled"
        assert request_status(client, timed_out, "cancelled") == "cancelled"


@contextlib.contextmanager
def paused_workers(daemon: InProcessDaemon) -> Iterator[None]:
    """Every rollout worker process stopped (SIGSTOP) for the block, then continued."""
    pids = [h.proc.pid for h in daemon.supervisor.handles.values() if h.proc is not None]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_async_client_built_outside_a_loop(daemon, ckpt):
    client = AsyncRolloutClient(daemon.target)  # e.g. in a trainer's __init__
    info = asyncio.run(client.create_job(ckpt, job_id="outside"))
    assert info.job_id == "outside"

    async def again():  # another loop: the client opens a channel there
        try:
            return await client.generate(PROMPTS[:1], n=1, max_new_tokens=4)
        finally:
            await client.close()

    assert len(asyncio.run(again())) == 1


# A deadline the daemon's admission outlives; a cancel before the daemon even began to store the
# request would store nothing, which is not the case under test.
_ADMISSION_DEADLINE = 1.5


def slow_admission(daemon: InProcessDaemon, monkeypatch) -> threading.Event:
    """Make storing a request take longer than `_ADMISSION_DEADLINE` from the moment it starts;
    the event is set once the daemon is storing one."""
    real_create = daemon.store.requests.admit
    storing = threading.Event()

    def slow_create(req, *args):
        storing.set()
        time.sleep(_ADMISSION_DEADLINE + 0.5)
        return real_create(req, *args)

    monkeypatch.setattr(daemon.store.requests, "admit", slow_create)
    return storing


def test_a_request_abandoned_while_the_daemon_stores_it_is_cancelled(daemon, ckpt, monkeypatch):
    # The caller's deadline passes while the daemon is still storing the request: the client's
    # cancel finds nothing yet, and the admission (which completes without its caller) would
    # then run the request in full for nobody. The client retries the cancel until it lands.
    with RolloutClient(daemon.target) as client:
        client.create_job(ckpt, job_id="slow-admission", speculative="off")
        storing = slow_admission(daemon, monkeypatch)
        with pytest.raises(DeadlineExceededError):
            client.generate(PROMPTS, sampling=LONG, timeout=_ADMISSION_DEADLINE)
        assert storing.is_set()
        assert request_status(client, client.last_request_id, "cancelled") == "cancelled"


def test_async_requests_abandoned_while_the_daemon_stores_them_are_cancelled(
    daemon, ckpt, monkeypatch
):
    # As above, through the asyncio client, both ways an async caller gives up: the call's own
    # timeout (DEADLINE_EXCEEDED) and the task that iterates being cancelled (as
    # asyncio.wait_for does at its timeout), once the daemon is storing the request.
    async def scenario() -> list[str]:
        async with AsyncRolloutClient(daemon.target) as client:
            await client.create_job(ckpt, job_id="slow-admission", speculative="off")
            storing = slow_admission(daemon, monkeypatch)
            with pytest.raises(DeadlineExceededError):
                await client.generate(PROMPTS, sampling=LONG, timeout=_ADMISSION_DEADLINE)
            assert storing.is_set()
            timed_out = client.last_request_id
            storing.clear()
            held = asyncio.ensure_future(
                client.generate(PROMPTS, sampling=LONG, request_id="async-held")
            )
            assert await asyncio.to_thread(storing.wait, 30.0)
            held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await held
            return [timed_out, "async-held"]

    # The workers are frozen meanwhile: on a loaded machine they could otherwise finish every
    # sample between the store write and the client's cancel (retried every 0.1 s).
    sup = daemon.supervisor
    pids = [s.proc.pid for s in sup.handles.values()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        ids = asyncio.run(scenario())
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for rid in ids:
        req = daemon.store.requests.get(rid)  # stored after the caller left, then cancelled
        assert req.status is RequestStatus.CANCELLED, (rid, req.status, req.status_reason)
        assert "abandoned by the client" in req.status_reason
    # The work stopped: nothing of these requests is live or running, and they did not run in
    # full (every sample stored is either one finished before the cancel, or cancelled).
    wait_until(lambda: all(sup.queue.get(rid) is None for rid in ids), what="requests closed")
    wait_until(lambda: all(sup.queue.inflight(w) == 0 for w in sup.handles), what="workers free")
    for rid in ids:
        req, samples = daemon.store.requests.get(rid), daemon.store.samples.list(rid)
        assert req.samples_done < req.samples_total == len(PROMPTS) * LONG.n
        assert all(not s.partial or s.finish_reason is FinishReason.CANCELLED for s in samples)


def test_logprob_modes_and_provenance_through_the_daemon(daemon, ckpt):
    """A real request asks for raw logprobs and per-token provenance: the workers compute
    them, the store keeps them (GetRequest), the stream carries them, and the counts agree
    with each sample's SD counters. Processed logprobs (the default) are another request."""
    import torch
    from transformers import AutoModelForCausalLM

    from tltd.domain import TokenSource
    from tltd_clients.errors import AlreadyExistsError
    from tltd_clients.rollout import _sample_from_pb

    hf = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    kw = dict(n=2, temperature=0.7, top_k=8, max_new_tokens=16, seed=5)
    with RolloutClient(daemon.target) as client:
        client.create_job(ckpt, job_id="pv-job")
        raw = client.generate(
            PROMPTS, request_id="pv-raw", logprob_mode="raw", return_provenance=True, **kw
        )
        processed = client.generate(PROMPTS, request_id="pv-proc", **kw)
        stored = client.raw.get_request("pv-raw", include_samples=True)
        with pytest.raises(AlreadyExistsError, match="sampling"):  # another mode: not a retry
            client.generate(PROMPTS, request_id="pv-raw", logprob_mode="processed", **kw)
    assert stored.request.sampling.logprob_mode == rollout_pb2.LOGPROB_MODE_RAW
    assert stored.request.sampling.return_provenance
    stored_samples = {
        (s.prompt_index, s.sample_index): s for s in map(_sample_from_pb, stored.samples)
    }
    assert stored_samples == {(s.prompt_index, s.sample_index): s for s in raw}
    for s in raw:
        assert s.provenance is not None and len(s.provenance) == len(s.token_ids)
        assert s.provenance[0].source is TokenSource.PLAIN  # from the prefill
        count = {src: sum(p.source is src for p in s.provenance) for src in TokenSource}
        assert count[TokenSource.PLAIN] == 1 + s.plain_steps
        assert count[TokenSource.ACCEPTED] == s.accepted_tokens
        assert count[TokenSource.RESIDUAL] == s.residual_tokens
        assert count[TokenSource.BONUS] == s.bonus_tokens
    assert all(s.provenance is None for s in processed)
    gaps = []
    for s in raw + processed:
        ids = torch.tensor([PROMPTS[s.prompt_index] + s.token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(PROMPTS[s.prompt_index]) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, -len(s.token_ids) :, None])[:, 0]
        gap = float((torch.tensor(s.logprobs) - ref).abs().max())
        if s.provenance is not None:
            assert gap < 1e-4  # raw: log_softmax of the logits
        else:
            gaps.append(gap)  # processed: at temperature 0.7 and top-k 8, not the raw ones
    assert min(gaps) > 1e-2
