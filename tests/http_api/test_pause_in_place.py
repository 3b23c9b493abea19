"""A pause that keeps requests in place, against a real daemon whose job switches running
samples to a new policy version between steps: vLLM's `/pause?mode=keep` (SkyRL's fully
asynchronous loop) freezes a running completion until `/resume`, after which it ends whole,
token for token what an unpaused run gives; SGLang's `in_place` pause, a weight update and
`/continue_generation` give a sample whose `output_versions` switch at the token it was frozen
at; an abort while frozen returns the output so far at once (AReaL resubmits it). Every wait is
on an event: the request running, the worker's heartbeats, the answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from tests.http_api.support import HttpDaemon, start_http_daemon, wait_running
from tltd.contract.rollout_messages import Heartbeat
from tltd.domain import RequestStatus

JOB = "keep-job"
PROMPT = [1, 9, 8]
MAX = 900  # tokens: long enough to be paused mid-sample


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, text_model) -> Iterator[HttpDaemon]:
    tmp = tmp_path_factory.mktemp("keep-daemon")
    d = start_http_daemon(tmp, text_model, JOB, 1024, policy_switch="next_step")
    try:
        yield d
    finally:
        d.kill()
        d.store.close()


@pytest.fixture(scope="module")
def http(daemon):
    with httpx.Client(base_url=daemon.url, timeout=120) as c:
        yield c


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=fn()))
    t.start()
    return t, out


def _heartbeats(daemon: HttpDaemon, count: int, timeout: float = 60.0) -> list[Heartbeat]:
    """The worker's latest heartbeat, then its next `count` (it sends one every 0.2 s)."""
    (handle,) = [h for h in daemon.supervisor.handles.values() if h.alive]
    beats = [handle.heartbeat]
    deadline = time.monotonic() + timeout
    while len(beats) <= count:
        assert time.monotonic() < deadline, "the worker stopped sending heartbeats"
        if handle.heartbeat is not beats[-1]:
            beats.append(handle.heartbeat)
        time.sleep(0.005)
    return beats


def _tokens(hb: Heartbeat) -> int:
    return hb.stats["tokens"]["total"]  # type: ignore[index]


def _idle_tokens(daemon: HttpDaemon) -> int:
    """The worker's token count once it runs nothing (a heartbeat after its last step)."""
    for _ in range(100):
        hb = _heartbeats(daemon, 1)[-1]
        if hb.running_samples == 0:
            return _tokens(hb)
    raise AssertionError("the worker did not go idle")


def _assert_frozen(daemon: HttpDaemon) -> int:
    """Several heartbeats after the pause: frozen, and not one token more; the count."""
    beats = _heartbeats(daemon, 4)
    assert all(b.frozen for b in beats)
    assert len({_tokens(b) for b in beats}) == 1, [_tokens(b) for b in beats]
    return _tokens(beats[0])


def test_vllm_pause_keep_freezes_a_completion_until_resume(daemon, http):
    oai = OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
    body = dict(model=JOB, prompt=PROMPT, max_tokens=MAX, temperature=1.0, seed=4)
    extra = {"ignore_eos": True, "return_token_ids": True}
    rid = "keep-vllm-1"
    t, out = _in_thread(
        lambda: oai.completions.create(**body, extra_body={**extra, "request_id": rid})
    )
    wait_running(daemon.store, rid)
    r = http.post("/pause", params={"mode": "keep"})
    assert r.json() == {"status": "paused", "mode": "keep", "requests": 1, "frozen_workers": 1}
    try:
        _assert_frozen(daemon)
        assert daemon.store.requests.get(rid).status is RequestStatus.RUNNING
    finally:
        assert http.post("/resume").json()["was_paused"] is True
    t.join(120)
    (choice,) = out["result"].choices
    ids = choice.model_extra["token_ids"]
    assert choice.finish_reason == "length" and len(ids) == MAX
    assert choice.model_extra["tltd"]["partial"] is False
    # Continued where it stood: the same seeded request, never paused, gives the same tokens.
    again = oai.completions.create(**body, extra_body={**extra, "request_id": rid + "-again"})
    assert again.choices[0].model_extra["token_ids"] == ids


def _generate_body(rid: str) -> dict:
    return {
        "input_ids": PROMPT,
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": MAX, "ignore_eos": True, "sampling_seed": 9},
    }


def test_sglang_in_place_update_and_continue_give_per_token_versions(daemon, http, text_model):
    store, rid = daemon.store, "keep-sgl-1"
    v0, before = store.jobs.get(JOB).policy_version, _idle_tokens(daemon)
    t, out = _in_thread(
        lambda: httpx.post(daemon.url + "/generate", json=_generate_body(rid), timeout=120)
    )
    wait_running(store, rid)
    r = http.post("/pause_generation", json={"mode": "in_place"}).json()
    assert r["status"] == "ok" and r["aborted"] == 0 and r["frozen_workers"] == 1
    frozen_at = _assert_frozen(daemon) - before  # the sample's tokens at the freeze
    assert 0 < frozen_at < MAX
    update = {"model_path": str(text_model), "weight_version": "w1", "flush_cache": False}
    assert http.post("/update_weights_from_disk", json=update).json()["success"] is True
    assert http.post("/continue_generation", json={}).json()["status"] == "ok"
    t.join(120)
    got = out["result"].json()
    meta = got["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(got["output_ids"]) == MAX
    v1 = v0 + 1
    assert meta["output_versions"] == [v0] * frozen_at + [v1] * (MAX - frozen_at)
    assert meta["weight_versions"] == [  # SGLang's own spans
        {"version": str(v0), "start": 0, "end": frozen_at},
        {"version": str(v1), "start": frozen_at, "end": MAX},
    ]
    assert meta["weight_version"] == str(v1)  # SGLang's: the last token's
    assert len(meta["output_token_logprobs"]) == MAX
    (sample,) = store.samples.list(rid)
    assert sample.policy_spans == ((0, v0), (frozen_at, v1))


def test_an_abort_while_frozen_returns_the_output_so_far(daemon, http):
    store, rid = daemon.store, "keep-sgl-2"
    v, before = store.jobs.get(JOB).policy_version, _idle_tokens(daemon)
    t, out = _in_thread(
        lambda: httpx.post(daemon.url + "/generate", json=_generate_body(rid), timeout=120)
    )
    wait_running(store, rid)
    assert http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    try:
        frozen_at = _assert_frozen(daemon) - before
        r = http.post("/abort_request", json={"rid": rid})
        assert r.json() == {"success": True, "aborted": 1}
        t.join(120)  # answered while the job is still paused
        got = out["result"].json()
    finally:
        http.post("/continue_generation", json={})
    meta = got["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert len(got["output_ids"]) == frozen_at  # what it had at the freeze, no more
    assert [p[1] for p in meta["output_token_logprobs"]] == got["output_ids"]
    assert meta["output_versions"] == [v] * frozen_at
    assert meta["weight_versions"] == [{"version": str(v), "start": 0, "end": frozen_at}]
    assert store.requests.get(rid).status is RequestStatus.CANCELLED
