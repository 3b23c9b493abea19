"""The HTTP door's session dialects against a real daemon: SGLang's /open_session,
/generate with session_params and /close_session (plain HTTP), and an OpenAI conversation
keyed by X-Session-ID (the `openai` client) with /finish_session. A 3-turn greedy session
through each gives the trajectory the gRPC session API gives; bad input is a 400 naming the
field, and the daemon goes on serving."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.support import sampling
from tests.http_api.conftest import JOB

# SGLang's bodies, checked against sglang's own types and session controller by
# tests/sglang_contract/test_http_contract.py
CASES = json.loads(
    (Path(__file__).resolve().parents[1] / "sglang_contract" / "http_cases.json").read_text()
)["sessions"]

PROMPT = [1, 5, 6, 7]
ENV = [[8, 9, 10], [11, 12]]  # the environment's answers after turns 0 and 1
N = 6
SG_SAMPLING = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(http_daemon) -> dict:
    """The 3-turn greedy session over gRPC, closed: its trajectory as the dialects return it."""
    with http_daemon.client() as c:
        c.open_session(JOB, PROMPT, session_id="grpc-ref")
        for i, env in enumerate([[], *ENV]):
            c.turn("grpc-ref", i, env, sampling=sampling(temperature=0.0, max_new_tokens=N))
        t = c.close_session("grpc-ref").trajectory
    return {
        "token_ids": list(t.token_ids),
        "loss_mask": list(t.loss_mask),
        "logprobs": list(t.logprobs),
        "policy_versions": list(t.policy_versions),
        "prompt_length": t.prompt_length,
    }


def _same_trajectory(got: dict, want: dict) -> None:
    assert got["token_ids"] == want["token_ids"]
    assert got["loss_mask"] == want["loss_mask"]
    assert got["policy_versions"] == want["policy_versions"]
    assert got["prompt_length"] == want["prompt_length"] == len(PROMPT)
    # within float32 rounding: the turns may be batched differently
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)
    mask = [0] * 4 + [1] * N + [0] * 3 + [1] * N + [0] * 2 + [1] * N
    assert got["loss_mask"] == mask


def _post(http, path: str, body: dict, status: int = 200):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json() if r.content else None


def _refused(http, path: str, body: dict, param: str, status: int = 400) -> None:
    err = _post(http, path, body, status)["error"]
    assert err["param"] == param, err


def _turn(sid: str, ids: list[int], **params) -> dict:
    return {
        "input_ids": ids,
        "session_params": {"id": sid, **params},
        "sampling_params": SG_SAMPLING,
        "return_logprob": True,
    }


def test_sglang_session_with_rids_gives_the_grpc_trajectory(http, http_daemon, reference):
    sid = _post(http, "/open_session", CASES["open_rids"])
    assert sid == "sg-rids"
    outs = [_post(http, "/generate", body) for body in CASES["turns_rids"]]
    ids = [o["meta_info"]["id"] for o in outs]
    assert ids == [f"session:{sid}:{k}:0" for k in range(3)]  # the rids the bodies name
    retry = _post(http, "/generate", CASES["turns_rids"][2])
    assert retry["output_ids"] == outs[2]["output_ids"] and retry["meta_info"]["id"] == ids[2]
    assert [len(o["output_ids"]) for o in outs] == [N] * 3
    assert outs[2]["meta_info"]["prompt_tokens"] == len(PROMPT) + 2 * N + 5  # the whole context
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    closed = _post(http, "/close_session", {"session_id": sid})
    assert closed["status"] == "closed" and closed["num_turns"] == 3
    _same_trajectory(closed["trajectory"], reference)
    sampled = [lp for lp, m in zip(closed["trajectory"]["logprobs"], reference["loss_mask"],
                                   strict=True) if m]  # fmt: skip
    assert sampled == logprobs
    with http_daemon.client() as c:  # the same session over gRPC
        assert list(c.get_session(sid).trajectory.token_ids) == reference["token_ids"]


def test_a_streaming_sglang_session_continues_without_rids(http, reference):
    sid = _post(http, "/open_session", CASES["open_streaming"])
    for body in CASES["turns_streaming"]:
        _post(http, "/generate", body)
    _same_trajectory(_post(http, "/close_session", {"session_id": sid})["trajectory"], reference)


def _events(http, path: str, body: dict, headers: dict | None = None) -> list:
    """A streamed answer's events ([DONE] last)."""
    with http.stream("POST", path, json=body, headers=headers or {}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x[len("data: "):] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streamed_turns_answer_the_whole_turn_in_one_event(http, reference):
    """SGLang's `stream` and OpenAI's: each turn arrives whole as one event, the same turns as
    unstreamed (the trajectory the gRPC session gives)."""
    sid = _post(http, "/open_session", {"capacity_of_str_len": 64, "session_id": "sg-streamed"})
    rid = None
    for ids in [PROMPT, *ENV]:
        (out,) = _events(http, "/generate", {**_turn(sid, ids, rid=rid), "stream": True})
        assert len(out["output_ids"]) == N
        rid = out["meta_info"]["id"]
    _same_trajectory(_post(http, "/close_session", {"session_id": sid})["trajectory"], reference)
    conversation = list(PROMPT)
    body = {"model": JOB, "max_tokens": N, "temperature": 0.0, "logprobs": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    for env in [[], *ENV]:
        conversation += env
        chunk, usage = _events(http, "/v1/completions", {**body, "prompt": conversation},
                               {"X-Session-ID": "oa-streamed"})  # fmt: skip
        assert chunk["choices"][0]["prompt_token_ids"] == conversation
        assert usage["usage"]["completion_tokens"] == N and not usage["choices"]
        conversation += chunk["choices"][0]["token_ids"]
    r = http.post("/finish_session", headers={"X-Session-ID": "oa-streamed"})
    _same_trajectory(r.json()["trajectory"], reference)


def test_sglang_refusals_name_the_field(http):
    _refused(http, "/open_session", {"session_id": "x"}, "capacity_of_str_len")
    _refused(http, "/open_session", {"capacity_of_str_len": 9, "timeout": 5.0}, "timeout")
    sid = _post(http, "/open_session", {"capacity_of_str_len": 64, "session_id": "sg-bad"})
    _refused(http, "/generate", _turn("nope", PROMPT), "session_params.id", 404)
    _refused(http, "/generate", {**_turn(sid, PROMPT), "session_params": {}}, "session_params.id")
    _refused(http, "/generate", _turn(sid, PROMPT, colour=1), "session_params.colour")
    _refused(http, "/generate", _turn(sid, PROMPT, drop_previous_output=True),
             "session_params.drop_previous_output")  # fmt: skip
    _refused(http, "/generate", {**_turn(sid, PROMPT), "rid": "mine"}, "rid")
    _refused(http, "/generate", _turn(sid, [[1, 2], [3]]), "input_ids")
    _refused(http, "/generate", _turn(sid, []), "input_ids")  # a first request needs tokens
    first = _post(http, "/generate", _turn(sid, PROMPT))["meta_info"]["id"]
    second = _post(http, "/generate", _turn(sid, ENV[0], rid=first))["meta_info"]["id"]
    _refused(http, "/generate", _turn(sid, [9]), "session_params.rid")  # a new first request
    _refused(http, "/generate", _turn(sid, [9], rid="nope"), "session_params.rid")
    _refused(http, "/generate", _turn(sid, [9], rid=first), "session_params.rid")  # a branch
    _refused(http, "/generate", _turn(sid, [9], rid=first, replace=True), "session_params.replace")
    _refused(http, "/generate", _turn(sid, [9], rid=second, offset=3), "session_params.offset")
    bad_n = {**_turn(sid, [9], rid=second), "sampling_params": {**SG_SAMPLING, "n": 2}}
    _refused(http, "/generate", bad_n, "sampling_params.n")
    _post(http, "/close_session", {"session_id": sid})
    _refused(http, "/generate", _turn(sid, [9], rid=second), "session_params.id", 409)
    # the daemon goes on serving: a plain /generate still runs
    assert http.get("/health").status_code == 200
    assert len(_post(http, "/generate", {"input_ids": [1, 5], "sampling_params": SG_SAMPLING})
               ["output_ids"]) == N  # fmt: skip


@pytest.fixture(scope="module")
def oai(http_daemon):
    with openai.OpenAI(base_url=f"{http_daemon.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _complete(oai, sid: str, prompt: list[int], extra_body: dict | None = None, **kw):
    return oai.completions.create(
        model=JOB,
        prompt=prompt,
        **({"max_tokens": N, "temperature": 0.0, "logprobs": 0} | kw),
        extra_headers={"X-Session-ID": sid},
        extra_body={"ignore_eos": True, **(extra_body or {})},
    ).choices[0]


def test_openai_conversation_gives_the_grpc_trajectory(oai, http, reference):
    conversation, answers = list(PROMPT), []
    for env in [[], *ENV]:
        conversation += env
        choice = _complete(oai, "oa-1", conversation)
        assert choice.model_extra["prompt_token_ids"] == conversation
        answers.append(choice)
        conversation += choice.model_extra["token_ids"]
    again = _complete(oai, "oa-1", PROMPT + answers[0].model_extra["token_ids"] + ENV[0])
    assert again.model_extra["token_ids"] == answers[1].model_extra["token_ids"]  # a retry
    assert again.model_extra["tltd"]["turn_index"] == 1
    r = http.post("/finish_session", headers={"X-Session-ID": "oa-1"})
    assert r.status_code == 200, r.text
    _same_trajectory(r.json()["trajectory"], reference)
    sampled = [lp for a in answers for lp in a.logprobs.token_logprobs]
    assert [lp for lp, m in zip(r.json()["trajectory"]["logprobs"], reference["loss_mask"],
                                strict=True) if m] == sampled  # fmt: skip


def _bad(oai, param: str, sid: str, prompt, **kw) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _complete(oai, sid, prompt, **kw)
    assert info.value.body["param"] == param, info.value.body


def test_openai_conversation_refusals_name_the_field(oai, http):
    _complete(oai, "oa-bad", PROMPT)
    _bad(oai, "prompt", "oa-bad", [1, 5, 6, 8])  # does not extend the stored tokens
    _bad(oai, "prompt", "oa-bad", [PROMPT, PROMPT])
    _bad(oai, "n", "oa-bad", PROMPT, n=2)
    _bad(oai, "logprobs", "oa-bad", PROMPT, logprobs=3)
    _bad(oai, "request_id", "oa-bad", PROMPT, extra_body={"request_id": "r-1"})
    r = http.post("/finish_session", json={"session_id": "oa-bad"},
                  headers={"X-Session-ID": "other"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    assert http.post("/finish_session", json={"session_id": "oa-bad"}).status_code == 200
    with pytest.raises(openai.ConflictError) as info:  # closed: no more turns
        _complete(oai, "oa-bad", PROMPT)
    assert info.value.body["param"] == "X-Session-ID"
    assert http.post("/finish_session", json={"session_id": "none"}).status_code == 404
    # the daemon goes on serving
    assert len(_complete(oai, "oa-after", PROMPT).model_extra["token_ids"]) == N
