"""vLLM's one-prompt `POST /inference/v1/generate` as SkyRL and prime-rl send it (one request
per prompt, all at once), against a real daemon: each caller gets exactly its own samples, and
an answer goes out once its samples are in, not after the daemon has recorded the request's
end."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.http_api.conftest import JOB
from tltd.domain import ENDED_STATUSES, RequestStatus

PROMPTS = [[1, 5, 6, 7], [1, 9, 8], [1, 4], [1, 7, 7, 3, 2]]


def _body(i: int, rid: str) -> dict:
    params = {"n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 40 + i, "ignore_eos": True}
    return {"model": JOB, "token_ids": PROMPTS[i], "sampling_params": params, "request_id": rid}


def _ended(store, rid: str, timeout: float = 30.0) -> RequestStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = store.requests.get(rid).status
        if status in ENDED_STATUSES:
            return status
        time.sleep(0.02)
    raise AssertionError(f"request {rid} did not end")


def test_concurrent_one_prompt_requests_each_get_their_own_samples(http_daemon):
    rids = [f"tokens-own-{i}" for i in range(len(PROMPTS))]
    with httpx.Client(base_url=http_daemon.url, timeout=60) as http:

        def post(i: int) -> dict:
            r = http.post("/inference/v1/generate", json=_body(i, rids[i]))
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(post, range(len(PROMPTS))))
    for rid, answer in zip(rids, answers, strict=True):
        assert answer["request_id"] == rid
        assert _ended(http_daemon.store, rid) is RequestStatus.COMPLETED
        stored = http_daemon.store.samples.list(rid)
        assert [c["token_ids"] for c in answer["choices"]] == [list(s.token_ids) for s in stored]
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert all(len(c["token_ids"]) == 5 for c in answer["choices"])


def test_the_answer_goes_out_before_the_request_end_is_recorded(http_daemon, monkeypatch):
    """Recording the end waits here; the caller has its whole answer meanwhile."""
    store, rid = http_daemon.store, "tokens-early-1"
    release, recording = threading.Event(), threading.Event()
    finish_unit = store.leases.finish_unit

    def held(*args, **kwargs):
        recording.set()
        release.wait(30)
        return finish_unit(*args, **kwargs)

    monkeypatch.setattr(store.leases, "finish_unit", held)
    # A sample's own transaction records its unit's end when it can (`sample_batches.store`): here
    # the node's own write does, the one that is held.
    monkeypatch.setattr(store.leases, "end_unit_if_complete", lambda *args: None)
    try:
        r = httpx.post(f"{http_daemon.url}/inference/v1/generate", json=_body(0, rid), timeout=20)
        assert r.status_code == 200, r.text
        # The end is recorded after the answer went out (or while it did): it is held here.
        assert recording.wait(20)
        assert store.requests.get(rid).status is RequestStatus.RUNNING  # its end not recorded
    finally:
        release.set()
        monkeypatch.undo()
    assert _ended(store, rid) is RequestStatus.COMPLETED
    stored = [list(s.token_ids) for s in store.samples.list(rid)]
    assert [c["token_ids"] for c in r.json()["choices"]] == stored
