"""A session's KV kept between its turns, through a real daemon (gRPC, real workers, the torch
engine): turns after the first reuse it on the worker that ran the session's last turn and
sample the tokens a stateless re-send of the whole sequence gives; a policy update between
turns prefills that turn in full on the new weights; with the cache off nothing is reused and
the tokens are the same."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.api.support import make_settings, sampling
from tests.rollout.support import InProcessDaemon, direct_outputs, wait_until
from tltd.domain import SamplingParams
from tltd.metrics import METRICS

PROMPT = [1, 2, 3, 4]
ENV = [[], [5, 6, 7], [8, 9], [10]]  # what the environment answers before each turn
GREEDY = dict(temperature=0.0, max_new_tokens=12)


def _expected(path, context: list[int]) -> list[int]:
    """The greedy continuation of the whole `context`, prefilled in full in this process."""
    out = direct_outputs(path, [context], SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    return list(out[(0, 0)])


def _prefix_totals(d: InProcessDaemon) -> dict[str, int]:
    """The prefix cache counters summed over the daemon's workers (their last heartbeats)."""
    out = {"hits": 0, "misses": 0, "reused_tokens": 0}
    for stats in d.supervisor.worker_stats().values():
        cache = stats.get("prefix_cache") or {}
        for k in out:
            out[k] += int(cache.get(k, 0))
    return out


def _metric(name: str, **labels: str) -> float:
    """A counter summed over devices (the daemon's process-wide registry)."""
    total = 0.0
    for family in METRICS.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture
def daemon_with(sqlite_store, tmp_path):
    made: list[InProcessDaemon] = []

    def start(**kw) -> InProcessDaemon:
        settings = make_settings(
            tmp_path, cpu_slots=2, worker_max_batch=16, worker_max_seq_len=1024,
            worker_heartbeat_seconds=0.2, shutdown_grace_seconds=10.0,
            device_refresh_seconds=3600.0, **kw,
        )  # fmt: skip
        made.append(InProcessDaemon(settings, sqlite_store).start())
        return made[-1]

    yield start
    for d in made:
        d.kill()


def _session(c, ckpt, session_id: str, before_turn=None) -> list:
    c.open_session("job", PROMPT, session_id=session_id)
    turns = []
    for i, env in enumerate(ENV):
        if before_turn is not None:
            before_turn(i)
        turns.append(c.turn(session_id, i, env, sampling=sampling(**GREEDY)).turn)
    return turns


def _check_tokens(turns, paths) -> list[int]:
    context = list(PROMPT)
    for turn, env, path in zip(turns, ENV, paths, strict=True):
        context += env
        assert list(turn.token_ids) == _expected(path, context)
        context += list(turn.token_ids)
    return context


def test_turns_after_the_first_reuse_the_kv_and_sample_the_same_tokens(daemon_with, ckpt):
    d = daemon_with()
    hits_before = _metric("tltd_prefix_cache_lookups_total", result="hit")
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        turns = _session(c, ckpt, "s")
        closed = c.close_session("s")
    _check_tokens(turns, [ckpt] * 4)
    # Every turn after the first found its KV on the worker that ran the turn before.
    wait_until(lambda: _prefix_totals(d)["hits"] == 3, what="3 prefix cache hits")
    totals = _prefix_totals(d)
    assert totals["misses"] == 1  # the first turn: nothing kept yet
    # Each reusing turn reused all of the session but the previous turn's last token.
    kept = [len(PROMPT) + 12 - 1, len(PROMPT) + 3 + 24 - 1, len(PROMPT) + 5 + 36 - 1]
    assert totals["reused_tokens"] == sum(kept)
    wait_until(
        lambda: _metric("tltd_prefix_cache_lookups_total", result="hit") - hits_before == 3,
        what="the hits in the daemon's metrics",
    )
    assert list(closed.trajectory.policy_versions).count(0) == 48


def test_a_policy_update_between_turns_runs_that_turn_in_full_on_the_new_weights(
    daemon_with, ckpt, ckpt2
):
    d = daemon_with()
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")

        def update_before_turn_2(i: int) -> None:
            if i == 2:
                assert c.update_policy("job", str(ckpt2)).version == 1

        turns = _session(c, ckpt, "s", update_before_turn_2)
        session = c.get_session("s")
    assert [t.policy_version for t in turns] == [0, 0, 1, 1]
    _check_tokens(turns, [ckpt, ckpt, ckpt2, ckpt2])
    # Turn 1 and turn 3 reused; turn 2 (after the update) prefilled in full.
    wait_until(lambda: _prefix_totals(d)["hits"] == 2, what="2 prefix cache hits")
    assert _prefix_totals(d)["misses"] == 2
    versions = [v for v in session.trajectory.policy_versions if v >= 0]
    assert versions == [0] * 24 + [1] * 24


def test_with_the_cache_off_nothing_is_reused_and_the_tokens_are_the_same(daemon_with, ckpt):
    d = daemon_with(worker_prefix_cache_mb=0)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        turns = _session(c, ckpt, "s")
    _check_tokens(turns, [ckpt] * 4)
    wait_until(lambda: _prefix_totals(d)["misses"] == 4, what="4 prefix cache misses")
    assert _prefix_totals(d)["hits"] == 0


def test_turns_follow_their_kv_to_the_worker_that_ran_the_first_turn(daemon_with, ckpt):
    """The first turn goes to the least loaded worker (the other one is held busy); the later
    turns follow it there although the other one is free again and first by id."""
    d = daemon_with()
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        busy = _busy_worker(d, c)
        try:
            c.open_session("job", PROMPT, session_id="s")
            first = c.turn("s", 0, sampling=sampling(**GREEDY)).turn
        finally:
            os.kill(d.supervisor.handles[busy].proc.pid, signal.SIGCONT)
        holder = d.supervisor.queue.holders["s"]
        assert holder != busy
        c.close_session("busy")  # its long turn is cancelled: both workers are free
        wait_until(lambda: d.supervisor.queue.inflight(busy) == 0, what="the busy worker free")
        turns = [first]
        for i, env in enumerate(ENV[1:], start=1):
            turns.append(c.turn("s", i, env, sampling=sampling(**GREEDY)).turn)
            assert d.supervisor.queue.holders["s"] == holder
    _check_tokens(turns, [ckpt] * 4)
    wait_until(lambda: _prefix_totals(d)["hits"] == 3, what="3 prefix cache hits")


def _busy_worker(d: InProcessDaemon, c) -> str:
    """Start a long turn of another session and stop its worker process (SIGSTOP): the
    worker holds work and takes no step; returns its id."""
    # Another prompt: a first turn of PROMPT would follow it (sessions of one prompt share it).
    c.open_session("job", [9, 8, 7], session_id="busy")
    long = sampling(temperature=0.0, max_new_tokens=900)
    t = threading.Thread(target=lambda: _ignore(lambda: c.turn("busy", 0, sampling=long)))
    t.start()

    def running_on() -> str | None:
        live = d.supervisor.queue.get("session:busy:0:0")
        return next(iter(live.running.values()), None) if live is not None else None

    wait_until(lambda: running_on() is not None, what="the long turn running")
    wid = running_on()
    os.kill(d.supervisor.handles[wid].proc.pid, signal.SIGSTOP)
    return wid


def _ignore(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - cancelled by the close: the test does not read it
        pass
