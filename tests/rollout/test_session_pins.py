"""Session metrics through a real daemon (gRPC, real workers, the torch engine): open sessions
pinned per worker (`tltd_session_pins`), turns re-pinned away from their KV
(`tltd_session_repins_total`), and where ListSessions / `tltctl sessions` say a session is
pinned and what its turns reused."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.api.support import make_settings, run_tltctl, sampling
from tests.rollout.support import InProcessDaemon, direct_outputs, wait_until
from tltd.domain import SamplingParams
from tltd.metrics import METRICS

PROMPTS = {"a": [1, 2, 3, 4], "b": [5, 6, 7]}
ENV = [[], [8, 9], [10]]  # the environment's tokens before each turn
GREEDY = dict(temperature=0.0, max_new_tokens=8)


@pytest.fixture
def d(sqlite_store, tmp_path):
    settings = make_settings(
        tmp_path, cpu_slots=2, worker_max_batch=16, worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2, shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0, scheduler_tick_seconds=0.1,
    )  # fmt: skip
    daemon = InProcessDaemon(settings, sqlite_store).start()
    yield daemon
    daemon.kill()


def _value(name: str, **labels: str) -> float:
    """A sample of the process-wide registry (0 when absent)."""
    for family in METRICS.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _pinned(d: InProcessDaemon) -> dict[str, float]:
    """The gauge per worker of this daemon (another test's daemon may have left its own)."""
    return {w: _value("tltd_session_pins", worker_id=w) for w in d.supervisor.handles}


def _expected(ckpt, context: list[int]) -> list[int]:
    out = direct_outputs(ckpt, [context], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    return list(out[(0, 0)])


def test_open_sessions_are_counted_on_their_worker_until_closed(d, ckpt, capsys, monkeypatch):
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        for sid, prompt in PROMPTS.items():
            c.open_session("job", prompt, session_id=sid)
            for i, env in enumerate(ENV):
                c.turn(sid, i, env, sampling=sampling(**GREEDY))
        wait_until(lambda: sum(_pinned(d).values()) == 2, what="2 sessions pinned")
        holders = d.supervisor.queue.holders
        listed = {s.session_id: s for s in c.list_sessions("job")}
        monkeypatch.setenv("TLTD_TARGET", d.target)
        code, out, _ = run_tltctl(capsys, "sessions")
        for sid in PROMPTS:
            s = listed[sid]
            assert (s.num_turns, s.worker_id, s.node_id) == (3, holders[sid], d.store.node_id)
            # Turns 1 and 2 reused all of the session but the last sampled token.
            assert s.reuse_hits == 2 and s.reused_tokens > 0
            row = next(line.split() for line in out.splitlines() if line.startswith(sid))
            assert row[6:9] == [f"{d.store.node_id}/{holders[sid]}", "2", f"({s.reused_tokens})"]
        assert code == 0
        for sid in PROMPTS:
            c.close_session(sid)
        wait_until(lambda: sum(_pinned(d).values()) == 0, what="no session pinned")
        closed = c.list_sessions("job")
    assert all(s.worker_id == "" and s.reuse_hits == 2 for s in closed)  # counters kept
    code, out, _ = run_tltctl(capsys, "sessions", "-o", "json")
    assert {s["worker_id"] for s in json.loads(out)} == {""}


def test_a_turn_whose_worker_died_with_its_kv_is_a_re_pin(d, ckpt):
    gone = _value("tltd_session_repins_total", reason="gone")
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        c.open_session("job", PROMPTS["a"], session_id="r")
        first = c.turn("r", 0, sampling=sampling(**GREEDY)).turn
        holder = d.supervisor.queue.holders["r"]
        os.kill(d.supervisor.handles[holder].proc.pid, signal.SIGKILL)
        wait_until(lambda: d.supervisor.queue.pins.holder("r") == "", what="the KV known lost")
        d.wait_workers_ready(2)
        second = c.turn("r", 1, ENV[1], sampling=sampling(**GREEDY)).turn
        listed = c.list_sessions("job")[0]
    assert _value("tltd_session_repins_total", reason="gone") - gone == 1
    context = PROMPTS["a"] + list(first.token_ids) + ENV[1]
    assert list(second.token_ids) == _expected(ckpt, context)  # prefilled in full
    assert listed.worker_id != "" and listed.reuse_hits == 0
