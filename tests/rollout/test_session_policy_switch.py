"""A policy version recorded while a session's turn runs, on a job with POLICY_SWITCH_NEXT_STEP:
the turn is not aborted, it goes on under the new version from a decode step, and the session's
per-token versions say which version sampled which token (checked against both models)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
import torch

from tests.api.support import sampling
from tests.engine.helpers import with_final_norm_changed
from tests.rollout.support import reference_logprobs, wait_until
from tltd.v1 import job_pb2, rollout_pb2

PROMPT = [1, 2, 3]
ENV = [4, 5]
FIRST = dict(temperature=0.0, max_new_tokens=8, logprob_mode=rollout_pb2.LOGPROB_MODE_RAW)
LONG = dict(temperature=0.0, max_new_tokens=900, logprob_mode=rollout_pb2.LOGPROB_MODE_RAW)


@pytest.fixture
def settings(settings):
    """A heartbeat after about every step, so that the turn is seen mid-way (as in
    test_policy_switch)."""
    return dataclasses.replace(settings, worker_heartbeat_seconds=0.002)


def _switch_mid_turn(d, c, new_policy):
    """Turn 1 runs; once decoding, its worker is paused, version 1 recorded and the load sent
    before it goes on: the switch surely lands inside the turn."""
    rid, got = "session:s:1:0", []
    t = threading.Thread(
        target=lambda: got.append(c.turn("s", 1, ENV, sampling=sampling(**LONG)).turn)
    )
    t.start()

    def worker():
        live = d.supervisor.queue.get(rid)
        wids = set(live.running.values()) if live is not None else set()
        return d.supervisor.handles[wids.pop()] if wids else None

    def decoding() -> bool:
        h = worker()
        hb = h.heartbeat if h is not None else None
        total = LONG["max_new_tokens"]
        return hb is not None and total // 2 <= hb.remaining_tokens <= total - 10

    wait_until(decoding, what="turn 1 decoding")
    h = worker()
    os.kill(h.proc.pid, signal.SIGSTOP)
    try:
        assert c.update_policy("switch", str(new_policy)).version == 1
        wait_until(lambda: h.load is not None and h.load.version == 1, what="load sent")
    finally:
        os.kill(h.proc.pid, signal.SIGCONT)
    t.join(120)
    assert not t.is_alive() and len(got) == 1  # not aborted
    return got[0]


def test_a_policy_switch_inside_a_turn_is_in_the_sessions_versions(daemon, ckpt, tmp_path_factory):
    new = with_final_norm_changed(ckpt, tmp_path_factory.mktemp("norm") / "policy", seed=3)
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="switch", policy_switch=job_pb2.POLICY_SWITCH_NEXT_STEP)
        daemon.wait_workers_ready(2)
        c.open_session("switch", PROMPT, session_id="s")
        t0 = c.turn("s", 0, sampling=sampling(**FIRST)).turn
        t1 = _switch_mid_turn(daemon, c, new)
        session = c.close_session("s")
    spans = [(p.first_token, p.policy_version) for p in t1.policy_spans]
    assert len(spans) == 2 and spans[0] == (0, 0) and spans[1][1] == 1
    k = spans[1][0]
    tokens = list(t1.token_ids)
    assert 1 <= k < len(tokens) == LONG["max_new_tokens"]
    # The turn's tokens, as the session holds them, and their versions.
    traj = session.trajectory
    start = len(PROMPT) + len(t0.token_ids) + len(ENV)
    assert list(traj.token_ids)[start:] == tokens
    versions = list(traj.policy_versions)
    assert versions[: len(PROMPT)] == [-1] * len(PROMPT)
    assert versions[len(PROMPT) : start - len(ENV)] == [0] * len(t0.token_ids)
    assert versions[start - len(ENV) : start] == [-1] * len(ENV)
    assert versions[start:] == [0] * k + [1] * (len(tokens) - k)
    # Each token's logprob is that of the version the session says sampled it.
    context = PROMPT + list(t0.token_ids) + ENV
    old_lp, _ = reference_logprobs(ckpt, context, tokens)
    new_lp, _ = reference_logprobs(new, context, tokens)
    got = torch.tensor(list(traj.logprobs)[start:])
    torch.testing.assert_close(got[:k], old_lp[:k], atol=2e-4, rtol=0)
    torch.testing.assert_close(got[k:], new_lp[k:], atol=2e-4, rtol=0)
