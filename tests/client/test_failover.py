"""A client given several daemons: round-robin, failover with the same request id when a
daemon dies mid-stream (two real `tltd serve` processes, one killed with SIGKILL), each sample
delivered once, and a clear error when every endpoint is down."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path

import pytest

from tests.conftest import _fresh_pg_database
from tests.rollout.support import ServeProcess, direct_outputs
from tltd.domain import FinishReason, SamplingParams
from tltd_clients import (
    AllEndpointsUnavailableError,
    AsyncRolloutClient,
    Backoff,
    RolloutClient,
    RolloutSample,
)
from tltd_clients.client import TltClient
from tltd_clients.endpoints import Delivered, Rotation, channel_options, split_targets
from tltd_clients.errors import UnavailableError
from tltd_clients.rollout import _in_order

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [3, 1, 4, 1, 5]]
# Greedy; one sample at a time per daemon (worker_max_batch 1) so that a stream is still
# running after its first sample arrives, and short, so the test stays quick.
PARAMS = dict(n=2, temperature=0.0, max_new_tokens=24)
TOTAL = len(PROMPTS) * PARAMS["n"]
FAST = Backoff(initial=0.05, maximum=0.5)


def _by_key(samples: list[RolloutSample]) -> dict:
    return {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples}


def _free_port() -> int:
    """A port nothing listens on (bound, then released): a daemon that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples_stored(db: Path, request_id: str) -> int | None:
    """Samples a daemon's SQLite file holds for a request; None when it has no such request."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as conn:
        q = "SELECT 1 FROM rollout_requests WHERE request_id = ?"
        if conn.execute(q, (request_id,)).fetchone():
            q = "SELECT count(*) FROM samples WHERE request_id = ?"
            return conn.execute(q, (request_id,)).fetchone()[0]
    return None


def _kill_node(d: ServeProcess) -> None:
    """kill -9 of the daemon's whole process group (the daemon and its workers at once)."""
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.wait()


@pytest.fixture
def b_env() -> dict[str, str]:
    """Settings of daemon B beyond the shared ones (a test parametrizes it to change them)."""
    return {}


@pytest.fixture
def two_daemons(request, tmp_path, ckpt, b_env) -> Iterator[list[ServeProcess]]:
    """Two daemons, each with its own database (SQLite files, or two fresh PostgreSQL
    databases when parametrized with "postgresql") and one CPU worker, each holding the job
    "job" on the same checkpoint; B's settings also take `b_env`."""
    backend = getattr(request, "param", "sqlite")
    daemons: list[ServeProcess] = []
    with ExitStack() as stack:
        try:
            for name in ("a", "b"):
                home = tmp_path / name
                home.mkdir()
                if backend == "postgresql":
                    template = request.getfixturevalue("_pg_template")
                    url = stack.enter_context(_fresh_pg_database(template))
                else:
                    shutil.copyfile(request.getfixturevalue("_sqlite_template"), home / "tltd.db")
                    url = f"sqlite:///{home / 'tltd.db'}"
                env = {"worker_max_batch": "1", "shutdown_grace_seconds": "2"}
                env |= b_env if name == "b" else {}
                d = ServeProcess(home, url, name, cpu_slots=1, **env)
                daemons.append(d)
            for d in daemons:
                with TltClient(d.target, timeout=120) as c:  # loads the model: slow on busy CI
                    c.create_job(str(ckpt), job_id="job")
                d.wait_workers_ready("job", n=1)
            yield daemons
        finally:
            for d in daemons:
                if d.proc.poll() is None:
                    os.killpg(d.proc.pid, signal.SIGKILL)
                d.kill()


@pytest.mark.parametrize(
    "two_daemons",
    ["sqlite", pytest.param("postgresql", marks=[pytest.mark.postgres, pytest.mark.slow])],
    indirect=True,
)
def test_kill9_mid_stream_fails_over_and_delivers_each_sample_once(two_daemons, ckpt, caplog):
    """New calls alternate between the endpoints. A stream then starts on daemon A, whose
    process group is killed with SIGKILL after the first sample: the client re-sends the same
    request id to B and the caller gets every sample exactly once, equal to an undisturbed
    (in-process) run; later calls skip the dead endpoint.

    The two daemons do not share a database, so B does not know A's work and re-runs the
    request from scratch; the samples A already delivered are dropped by the client. Greedy
    outputs are deterministic, so the samples from A and from B agree with one reference."""
    a, b = two_daemons
    caplog.set_level(logging.WARNING, logger="tltd_clients.failover")
    short = PARAMS | {"max_new_tokens": 4}
    short_ref = direct_outputs(ckpt, PROMPTS[:1], SamplingParams(**short))
    received: list[RolloutSample] = []
    with RolloutClient([a.target, b.target], job_id="job", backoff=FAST) as client:
        served = []
        for i in range(2):
            assert _by_key(client.generate(PROMPTS[:1], request_id=f"rr-{i}", **short)) == short_ref
            served.append(client.raw.target)
        assert served == [a.target, b.target]  # round-robin

        stream = client.stream(PROMPTS, request_id="failover-1", **PARAMS)  # on A
        received.append(next(stream))
        with TltClient(a.target) as c:
            on_a = c.get_request("failover-1").request.samples_done
        _kill_node(a)
        t0 = time.monotonic()
        received.extend(stream)
        took = time.monotonic() - t0
        assert client.raw.target == b.target  # the endpoint that served the end

        for i in range(2, 4):  # A is dead: every call lands on B, passing A over at once
            assert _by_key(client.generate(PROMPTS[:1], request_id=f"rr-{i}", **short)) == short_ref
            assert client.raw.target == b.target
        assert client.job().job_id == "job"
    failovers = [r.getMessage() for r in caplog.records if r.name == "tltd_clients.failover"]
    assert len(failovers) == 1, failovers  # only the stream's: later calls skipped A
    assert on_a < TOTAL  # A died with work left: the rest came from B
    keys = [(s.prompt_index, s.sample_index) for s in received]
    assert len(keys) == TOTAL and len(set(keys)) == TOTAL  # each sample exactly once
    assert _by_key(received) == direct_outputs(ckpt, PROMPTS, SamplingParams(**PARAMS))
    assert all(s.request_id == "failover-1" for s in received)
    with TltClient(b.target) as c:  # B served the same request id
        assert c.get_request("failover-1").request.samples_done == TOTAL
    assert a.target in failovers[0] and "failover-1" in failovers[0]
    assert took < 60


@pytest.mark.slow
def test_async_client_fails_over_mid_stream(two_daemons, ckpt):
    """AsyncRolloutClient: the same failover, each sample once, outputs as undisturbed."""
    a, b = two_daemons
    # Longer samples and SD off (greedy siblings are what the drafters copy best): A must
    # still have work when the client's loop, maybe late on a loaded machine, kills it.
    params = PARAMS | {"max_new_tokens": 96}

    async def run() -> list[RolloutSample]:
        got: list[RolloutSample] = []
        async with AsyncRolloutClient([a.target, b.target], job_id="job", backoff=FAST) as c:
            stream = c.stream(PROMPTS, request_id="failover-async", speculative="off", **params)
            async for s in stream:
                got.append(s)
                if len(got) == 1:
                    await asyncio.to_thread(_kill_node, a)
        return got

    received = asyncio.run(run())
    keys = [(s.prompt_index, s.sample_index) for s in received]
    assert len(keys) == TOTAL and len(set(keys)) == TOTAL
    assert _by_key(received) == direct_outputs(ckpt, PROMPTS, SamplingParams(**params))
    with TltClient(b.target) as c:
        assert c.get_request("failover-async").request.samples_done == TOTAL


@pytest.mark.slow
def test_a_frozen_node_is_noticed_by_keepalive_and_the_stream_fails_over(two_daemons, ckpt, caplog):
    """SIGSTOP of A's process group mid-stream: its connection stays open but nothing
    answers, as with a node that vanished from the network. Keepalive pings (every 2 s here,
    unanswered after 2 s) close the connection and the stream moves to B: noticed after about
    4 s (gRPC's own one-minute ping timeout, left at its default, made it 62 s)."""
    a, b = two_daemons
    received: list[RolloutSample] = []
    targets = [a.target, b.target]
    with RolloutClient(targets, job_id="job", backoff=FAST, keepalive=2.0) as client:
        stream = client.stream(PROMPTS, request_id="frozen-1", **PARAMS)
        received.append(next(stream))
        caplog.set_level(logging.WARNING, logger="tltd_clients.failover")
        os.killpg(a.proc.pid, signal.SIGSTOP)
        t0 = time.time()
        received.extend(stream)
    keys = [(s.prompt_index, s.sample_index) for s in received]
    assert len(keys) == TOTAL and len(set(keys)) == TOTAL
    assert _by_key(received) == direct_outputs(ckpt, PROMPTS, SamplingParams(**PARAMS))
    with TltClient(b.target) as c:
        assert c.get_request("frozen-1").request.samples_done == TOTAL
    failover = next(r for r in caplog.records if r.name == "tltd_clients.failover")
    assert "ping timeout" in failover.getMessage() and a.target in failover.getMessage()
    noticed = failover.created - t0
    print(f"frozen node noticed after {noticed:.1f}s (keepalive 2 s)")
    assert noticed < 30  # 4 s measured; the slack is for a loaded CI machine


@pytest.mark.slow
# B runs 16 samples at once: it re-runs the whole request, which one at a time took minutes.
@pytest.mark.parametrize("b_env", [{"worker_max_batch": "16"}], ids=["b-batch-16"])
def test_a_draining_node_hands_the_stream_over(two_daemons, ckpt):
    """SIGTERM to A mid-stream: A drains (grace 2 s), returns its running samples partial
    (ABORTED) and ends the stream UNAVAILABLE; the client moves to B, whose complete samples
    follow the partial ones, and `generate` returns one complete sample per key, equal to an
    undisturbed run (B re-runs the request: the daemons do not share a database)."""
    a, b = two_daemons
    # 60 samples of 400 tokens on A's one-sample worker: the work outlasts the 2 s grace on a
    # quiet machine too (5 samples of 600 tokens ended inside it there).
    params = dict(n=12, temperature=0.0, max_new_tokens=400)
    seen: list[RolloutSample] = []

    with RolloutClient([a.target, b.target], job_id="job", backoff=FAST) as client:
        stream = client.stream(PROMPTS, request_id="drained-1", **params)
        seen.append(next(stream))
        a.proc.send_signal(signal.SIGTERM)
        seen.extend(stream)
        assert a.wait(30) == 0
    aborted = [s for s in seen if s.finish_reason == FinishReason.ABORTED]
    assert aborted and all(s.partial for s in aborted)  # A's tokens so far were delivered
    complete = [s for s in seen if s.finish_reason != FinishReason.ABORTED]
    keys = [(s.prompt_index, s.sample_index) for s in complete]
    total = len(PROMPTS) * params["n"]
    assert len(keys) == total and len(set(keys)) == total  # each once
    ref = direct_outputs(ckpt, PROMPTS, SamplingParams(**params))
    assert _by_key(complete) == ref
    assert _by_key(_in_order(seen)) == ref  # what generate() returns: the complete ones
    with TltClient(b.target) as c:
        assert c.get_request("drained-1").request.samples_done == total


@pytest.mark.slow
def test_a_resolver_target_round_robins_and_fails_over(two_daemons, ckpt, tmp_path):
    """`ipv4:A,B` is resolved by gRPC itself (as `dns:///host:port` is), one channel with the
    round_robin policy: the client kills whichever daemon the stream is on, and the retry on
    the same channel goes to the other."""
    a, b = two_daemons
    target = f"ipv4:{a.target},{b.target}"
    assert split_targets(target) == [target]
    assert ("grpc.service_config", '{"loadBalancingConfig": [{"round_robin": {}}]}') in (
        channel_options(target)
    )
    received: list[RolloutSample] = []
    with RolloutClient(target, job_id="job", backoff=FAST) as client:
        stream = client.stream(PROMPTS, request_id="failover-dns", **PARAMS)
        received.append(next(stream))
        # Freeze both at once, so that the owner cannot finish the request while the test
        # looks for it (asking each over gRPC took long enough on a loaded machine); each
        # daemon's own SQLite file says whether it holds the request.
        for d in (a, b):
            os.killpg(d.proc.pid, signal.SIGSTOP)
        stored = [_samples_stored(tmp_path / name / "tltd.db", "failover-dns") for name in "ab"]
        assert stored.count(None) == 1, stored  # exactly one daemon holds the request
        owner, survivor = (a, b) if stored[0] is not None else (b, a)
        _kill_node(owner)
        os.killpg(survivor.proc.pid, signal.SIGCONT)
        received.extend(stream)
    assert max(n for n in stored if n is not None) < TOTAL  # the owner died with work left
    keys = [(s.prompt_index, s.sample_index) for s in received]
    assert len(keys) == TOTAL and len(set(keys)) == TOTAL
    assert _by_key(received) == direct_outputs(ckpt, PROMPTS, SamplingParams(**PARAMS))
    with TltClient(survivor.target) as c:
        assert c.get_request("failover-dns").request.samples_done == TOTAL


def test_every_endpoint_down_is_a_clear_error_after_bounded_retries():
    down = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    with RolloutClient(down, job_id="job", retries=3, backoff=FAST) as client:
        t0 = time.monotonic()
        with pytest.raises(AllEndpointsUnavailableError) as info:
            client.generate(PROMPTS[:1], request_id="nowhere", **PARAMS)
        assert time.monotonic() - t0 < 10
        with pytest.raises(AllEndpointsUnavailableError, match="CreateJob"):
            client.create_job("/models/x", job_id="job")
    message = str(info.value)
    assert "every endpoint is unavailable after 3 retries" in message
    assert "nowhere" in message and all(t in message for t in down)
    assert isinstance(info.value, UnavailableError)  # callers catching UNAVAILABLE still do

    async def run_async() -> None:
        async with AsyncRolloutClient(down, job_id="job", retries=2, backoff=FAST) as c:
            with pytest.raises(AllEndpointsUnavailableError, match="after 2 retries"):
                await c.generate(PROMPTS[:1], **PARAMS)

    asyncio.run(run_async())


def test_split_targets():
    assert split_targets("h1:1, h2:2") == ["h1:1", "h2:2"]
    assert split_targets(["h1:1", "h2:2"]) == ["h1:1", "h2:2"]
    assert split_targets("dns:///tltd.svc:50051") == ["dns:///tltd.svc:50051"]
    with pytest.raises(ValueError, match="no endpoint"):
        split_targets([])
    with pytest.raises(ValueError, match="retries"):
        RolloutClient("127.0.0.1:1", retries=-1)


def test_delivered_admits_each_sample_once_and_a_complete_one_after_a_partial():
    def s(p: int, i: int, reason: FinishReason) -> RolloutSample:
        return RolloutSample("r", p, i, [1], [0.0], reason, 0, 0)

    d = Delivered()
    assert d.admit(s(0, 0, FinishReason.LENGTH))
    assert not d.admit(s(0, 0, FinishReason.LENGTH))  # re-run elsewhere: dropped
    assert d.admit(s(0, 1, FinishReason.ABORTED))  # a drained node's tokens so far
    assert not d.admit(s(0, 1, FinishReason.ABORTED))
    assert d.admit(s(0, 1, FinishReason.STOP))  # the complete sample replaces it
    assert not d.admit(s(0, 1, FinishReason.ABORTED))
    assert len(d) == 2
    partial, done = s(0, 1, FinishReason.ABORTED), s(0, 1, FinishReason.STOP)
    first = s(0, 0, FinishReason.LENGTH)
    assert _in_order([partial, done, first]) == [first, done]
    # A bounded call's carried group is another request's: the same indices are new samples.
    carried = RolloutSample("earlier", 0, 0, [2], [0.0], FinishReason.STOP, 0, 0)
    assert d.admit(carried) and len(d) == 3
    assert _in_order([first, carried]) == [carried, first]


def test_rotation_passes_over_an_endpoint_that_failed_lately():
    r = Rotation(3, cooldown=5.0)
    assert [r.start(0.0), r.start(0.0), r.start(0.0), r.start(0.0)] == [0, 1, 2, 0]
    assert r.after(1, now=1.0) == 2  # 1 failed: retry on 2
    assert [r.start(2.0), r.start(2.0), r.start(2.0)] == [2, 0, 2]  # 1 passed over
    assert [r.start(6.5), r.start(6.5)] == [0, 1]  # its cooldown is over: back in turn
    for i in range(3):
        r.after(i, now=10.0)
    assert r.start(11.0) in (0, 1, 2)  # all failed lately: tried all the same
