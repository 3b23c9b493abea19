"""vLLM's server as RL trainers call it, against a real daemon: the completion fields they
send (accepted at no-op values, refused by name otherwise), logprobs in vLLM's shapes, and
the routes beyond the OpenAI API (world size, server info, prefix-cache reset, pause /
resume, token-in/token-out generate)."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.http_api.conftest import JOB
from tests.http_api.support import wait_held, wait_running
from tltd.domain import RequestStatus
from tltd.errors import NotFound

PROMPTS = [[1, 5, 6, 7], [1, 9, 8]]

# TRL 1.16 VLLMClient.generate's body (trl/generation/vllm_client.py), with a seed.
TRL_BODY = {
    "model": JOB,
    "prompt": PROMPTS,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "n": 2,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 6,
    "logprobs": 0,
    "seed": 3,
}


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=60) as c:
        yield c


def test_trls_body_gets_vllms_logprob_shape(http):
    r = http.post("/v1/completions", json=TRL_BODY)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        # logprobs=0: the sampled token alone at every position, as vLLM answers it
        assert lp["top_logprobs"] == [
            {t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)
        ]
        assert lp["text_offset"][0] == 0
        assert c["prompt_token_ids"] == PROMPTS[c["index"] // 2]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 1.1),
        ("min_p", 0.05),
        ("presence_penalty", 0.5),
        ("prompt_logprobs", 129),
        ("logprobs", -1),
        ("min_tokens", 3),
        ("structured_outputs", {"regex": "a+"}),
        ("allowed_token_ids", [1, 2]),
    ],
)
def test_a_value_tltd_cannot_honour_is_refused_by_name(http, field, value):
    r = http.post("/v1/completions", json={**TRL_BODY, field: value})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field


def test_vllm_only_fields_at_their_defaults_are_accepted(http):
    body = {
        **TRL_BODY,
        "n": 1,
        "use_beam_search": False,
        "length_penalty": 1.0,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "bad_words": [],
        "priority": 0,
        "cache_salt": "salt",
        "session_id": "s-1",
        "vllm_xargs": None,
        "thinking_token_budget": None,
        "echo": False,
        "stream": False,
        "truncate_prompt_tokens": 2,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    # truncate_prompt_tokens keeps the last N tokens (vLLM's left truncation)
    assert [c["prompt_token_ids"] for c in r.json()["choices"]] == [p[-2:] for p in PROMPTS]


def test_server_routes(http):
    assert http.get("/get_world_size").json() == {"world_size": 1}
    info = http.get("/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["model_config"]["served_model_name"] == JOB
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    assert isinstance(http.get("/server_info").json()["vllm_config"], str)  # text by default
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert http.get("/is_paused").json() == {"is_paused": False}
    r = http.get("/get_world_size", params={"model": "no-such-job"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokens_in_tokens_out_matches_completions(http):
    params = {"max_tokens": 5, "temperature": 1.0, "seed": 9, "logprobs": 0, "n": 2}
    r = http.post(
        "/inference/v1/generate",
        json={"token_ids": PROMPTS[0], "sampling_params": {**params, "output_kind": 2}},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    completion = http.post(
        "/v1/completions",
        json={"model": JOB, "prompt": PROMPTS[0], "return_token_ids": True, **params},
    ).json()
    assert [c["token_ids"] for c in out["choices"]] == [
        c["token_ids"] for c in completion["choices"]
    ]
    for c, ref in zip(out["choices"], completion["choices"], strict=True):
        content = c["logprobs"]["content"]
        assert [e["logprob"] for e in content] == ref["logprobs"]["token_logprobs"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in c["token_ids"]]
    bad = http.post(
        "/inference/v1/generate",
        json={"token_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_penalty"


def _post_in_thread(url: str, path: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        out["response"] = httpx.post(url + path, json=body, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_pause_keep_holds_new_requests_until_resume(http, http_daemon):
    assert http.post("/pause", params={"mode": "keep"}).json()["mode"] == "keep"
    try:
        assert http.get("/is_paused").json() == {"is_paused": True}
        body = {"model": JOB, "prompt": PROMPTS[0], "max_tokens": 3, "seed": 1}
        body["request_id"] = "vllm-held-1"
        t, out = _post_in_thread(http_daemon.url, "/v1/completions", body)
        wait_held(http)  # refused by the pause, waiting at admission
        with pytest.raises(NotFound):
            http_daemon.store.requests.get("vllm-held-1")  # not stored while paused
    finally:
        assert http.post("/resume").json()["was_paused"] is True
    t.join(60)
    assert out["response"].status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_pause_abort_returns_in_flight_samples_with_abort(http, http_daemon):
    rid = "vllm-abort-1"
    body = {
        "model": JOB,
        "prompt": PROMPTS[1],
        "max_tokens": 480,
        "ignore_eos": True,
        "seed": 2,
        "request_id": rid,
        "return_token_ids": True,
    }
    t, out = _post_in_thread(http_daemon.url, "/v1/completions", body)
    wait_running(http_daemon.store, rid)
    try:
        r = http.post("/pause", params={"mode": "abort"})
        assert r.status_code == 200 and r.json()["requests"] == 1
    finally:
        http.post("/resume")
    t.join(60)
    choice = out["response"].json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert len(choice["token_ids"]) < 480
    assert choice["tltd"]["partial"] is True


def test_pause_wait_returns_once_in_flight_requests_finish(http, http_daemon):
    rid = "vllm-wait-1"
    # Long enough to be seen RUNNING (recorded once it has run 50 ms) before it ends.
    body = {"model": JOB, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True}
    t, out = _post_in_thread(http_daemon.url, "/v1/completions", {**body, "request_id": rid})
    wait_running(http_daemon.store, rid)
    try:
        r = http.post("/pause", params={"mode": "wait", "timeout": "60"})
        assert r.status_code == 200 and r.json()["requests"] == 1
        # Returned only once the request ended: its answer is whole.
        assert http_daemon.store.requests.get(rid).status is RequestStatus.COMPLETED
    finally:
        http.post("/resume")
    t.join(60)
    assert out["response"].json()["choices"][0]["finish_reason"] == "length"


def test_abort_requests_by_id_and_weight_info(http, http_daemon):
    rid = "vllm-abort-2"
    body = {"model": JOB, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True}
    t, out = _post_in_thread(http_daemon.url, "/v1/completions", {**body, "request_id": rid})
    wait_running(http_daemon.store, rid)
    r = http.post("/abort_requests", json={"request_ids": [rid]})
    assert r.json() == {"status": "aborted", "aborted": 1}
    t.join(60)
    assert out["response"].json()["choices"][0]["finish_reason"] == "abort"
    assert http.get("/is_paused").json() == {"is_paused": False}  # no pause involved
    info = http.get("/weight_info").json()
    assert info["policy_version"] == http_daemon.store.jobs.get(JOB).policy_version
