"""A new policy version while a long request runs, through a real daemon and real workers.

POLICY_SWITCH_NEXT_STEP: the request's sample continues on the new version from a step
boundary, its policy_spans say where, and the tokens after it are the new policy's. The default
job finishes the request on the version it started with.

The new version differs from the old only in the final norm (which shapes the logits and
nothing in the KV cache), so the old KV kept across the switch is exactly what the new weights
compute and every token's logprob can be checked against one of the two models."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest
import torch

from tests.api.support import sampling
from tests.engine.helpers import with_final_norm_changed
from tests.rollout.support import direct_outputs, reference_logprobs, wait_until
from tltd.domain import SamplingParams
from tltd.v1 import job_pb2, rollout_pb2

PROMPT = [1, 2, 3]
LONG = dict(n=1, temperature=0.0, max_new_tokens=1000, logprob_mode=rollout_pb2.LOGPROB_MODE_RAW)


@pytest.fixture(scope="module")
def norm_changed(ckpt, tmp_path_factory):
    return with_final_norm_changed(ckpt, tmp_path_factory.mktemp("norm") / "policy", seed=3)


def _update_mid_request(d, c, job_id: str, new_policy, switches: bool) -> rollout_pb2.Sample:
    """Run the long request; once its worker has decoded a few tokens, pause that worker
    (SIGSTOP), record `new_policy` as version 1 and, for a job that `switches`, wait until the
    worker was sent the load before it goes on: the request is surely still running when the
    version changes, whatever the machine's speed."""
    rid, got = f"{job_id}-r", []
    t = threading.Thread(
        target=lambda: got.extend(
            c.generate(job_id, [PROMPT], sampling=sampling(**LONG), request_id=rid)
        )
    )
    t.start()

    def worker():
        live = d.supervisor.queue.get(rid)
        wids = set(live.running.values()) if live is not None else set()
        return d.supervisor.handles[wids.pop()] if wids else None

    def decoding() -> bool:  # 10 tokens decoded at least, half of them still to go
        h = worker()
        hb = h.heartbeat if h is not None else None
        total = LONG["max_new_tokens"]
        return hb is not None and total // 2 <= hb.remaining_tokens <= total - 10

    wait_until(decoding, what="the request decoding")
    h = worker()
    os.kill(h.proc.pid, signal.SIGSTOP)
    try:
        assert c.update_policy(job_id, str(new_policy)).version == 1
        if switches:
            wait_until(lambda: h.load is not None and h.load.version == 1, what="load sent")
    finally:
        os.kill(h.proc.pid, signal.SIGCONT)
    t.join(120)
    assert not t.is_alive() and len(got) == 1
    (sample,) = c.get_request(rid, include_samples=True).samples
    assert sample == got[0]  # the stored sample carries the spans too
    return sample


@pytest.fixture
def settings(settings):
    """A heartbeat after about every engine step, so the wait above sees the request mid-way:
    at 0.2 s a quiet machine could decode all 1,000 tokens between two heartbeats."""
    return dataclasses.replace(settings, worker_heartbeat_seconds=0.002)


def test_next_step_job_switches_a_running_sample_to_the_new_version(
    sqlite_daemon, ckpt, norm_changed
):
    d = sqlite_daemon
    with d.client() as c:
        job = c.create_job(
            str(ckpt), job_id="switch", policy_switch=job_pb2.POLICY_SWITCH_NEXT_STEP
        )
        assert job.policy_switch == job_pb2.POLICY_SWITCH_NEXT_STEP
        d.wait_workers_ready(2)
        s = _update_mid_request(d, c, "switch", norm_changed, switches=True)
        # Every worker of the job moves to version 1, busy or not.
        wait_until(
            lambda: {w.policy_version for w in d.supervisor.handles.values()} == {1},
            what="workers on version 1",
        )
    tokens = list(s.token_ids)
    assert len(tokens) == 1000 and s.policy_version == 0
    spans = [(p.first_token, p.policy_version) for p in s.policy_spans]
    assert len(spans) == 2 and spans[0] == (0, 0) and spans[1][1] == 1
    k = spans[1][0]
    assert 1 <= k < len(tokens), spans
    old_lp, old_best = reference_logprobs(ckpt, PROMPT, tokens)
    new_lp, new_best = reference_logprobs(norm_changed, PROMPT, tokens)
    got = torch.tensor(list(s.logprobs))
    torch.testing.assert_close(got[:k], old_lp[:k], atol=2e-4, rtol=0)
    torch.testing.assert_close(got[k:], new_lp[k:], atol=2e-4, rtol=0)
    assert tokens[:k] == old_best[:k].tolist() and tokens[k:] == new_best[k:].tolist()
    assert not torch.allclose(old_lp[k:], new_lp[k:], atol=1e-2)  # the checks tell them apart


def test_default_job_finishes_a_running_request_on_its_start_version(
    sqlite_daemon, ckpt, norm_changed
):
    d = sqlite_daemon
    with d.client() as c:
        job = c.create_job(str(ckpt), job_id="stay")
        assert job.policy_switch == job_pb2.POLICY_SWITCH_FINISH_ON_START_VERSION
        d.wait_workers_ready(2)
        s = _update_mid_request(d, c, "stay", norm_changed, switches=False)
        after = list(c.generate("stay", [PROMPT], sampling=sampling(**LONG)))
    assert s.policy_version == 0 and not s.policy_spans
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=1000)
    assert tuple(s.token_ids) == direct_outputs(ckpt, [PROMPT], params)[0, 0]
    assert [x.policy_version for x in after] == [1] and not after[0].policy_spans
    assert tuple(after[0].token_ids) == direct_outputs(norm_changed, [PROMPT], params)[0, 0]


def test_next_step_is_refused_for_another_backend(sqlite_daemon, ckpt):
    from tltd.v1 import common_pb2
    from tltd_clients.errors import InvalidArgumentError

    with sqlite_daemon.client() as c:
        with pytest.raises(InvalidArgumentError) as err:
            c.create_job(
                str(ckpt),
                backend=common_pb2.BACKEND_SGLANG,
                policy_switch=job_pb2.POLICY_SWITCH_NEXT_STEP,
            )
    assert "policy_switch" in str(err.value) and "torch backend only" in str(err.value)
