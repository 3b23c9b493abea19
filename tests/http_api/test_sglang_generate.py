"""SGLang-compatible /generate, /update_weights_from_disk, /get_model_info and /health with a
plain HTTP client, in the request and response shapes SGLang documents."""

from __future__ import annotations

import httpx
import pytest

from tests.http_api.conftest import JOB
from tests.http_api.support import make_text_checkpoint, sse_events
from tltd_clients import RolloutClient


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=120) as c:
        yield c


def _gen(http, path="/generate", **body):
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_single_prompt_returns_one_object_with_slime_keys(http):
    out = _gen(
        http,
        input_ids=[1, 5, 6],
        return_logprob=True,
        sampling_params={
            "max_new_tokens": 6,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [2],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
            "sampling_seed": 5,
        },
    )
    assert isinstance(out, dict)
    meta = out["meta_info"]
    pairs = meta["output_token_logprobs"]
    assert [p[1] for p in pairs] == out["output_ids"] and 1 <= len(pairs) <= 6
    assert all(isinstance(p[0], float) and p[0] <= 0 for p in pairs)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["prompt_tokens"] == 3
    assert meta["weight_version"] == "0"
    for key in (
        "spec_verify_ct",
        "spec_accept_token_num",
        "spec_draft_token_num",
        "spec_accept_rate",
        "spec_accept_length",
    ):
        assert key in meta
    assert isinstance(out["text"], str)


def test_batch_with_n_is_prompt_major(http):
    outs = _gen(
        http,
        input_ids=[[1, 5, 6], [1, 7]],
        return_logprob=True,
        sampling_params={"max_new_tokens": 4, "n": 2, "ignore_eos": True},
    )
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 3, 2, 2]
    assert all(len(o["output_ids"]) == 4 for o in outs)
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for o in outs)
    # A single prompt with n > 1 is a list too (SGLang expands it into a batch).
    assert len(_gen(http, input_ids=[1, 5], sampling_params={"max_new_tokens": 2, "n": 3})) == 3


def test_text_input(http):
    out = _gen(http, text="12+3=", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert isinstance(out["text"], str) and out["meta_info"]["prompt_tokens"] == 5


def test_streaming_one_event_per_sample(http):
    body = {
        "input_ids": [[1, 5, 6], [1, 7]],
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "n": 2, "sampling_seed": 9},
    }
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert sorted(e["index"] for e in events) == [0, 1, 2, 3]
    batch = _gen(http, **(body | {"stream": False}))  # same seed: the same samples
    assert {e["index"]: e["output_ids"] for e in events} == {
        o["index"]: o["output_ids"] for o in batch
    }


def test_update_weights_moves_the_version_of_the_next_samples(http, http_daemon, tmp_path):
    ckpt = make_text_checkpoint(tmp_path / "step-1")
    before = _gen(http, input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
    r = http.post(
        "/update_weights_from_disk", json={"model_path": str(ckpt), "weight_version": "step-1"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    new = r.json()["weight_version"]
    assert int(new) == int(before["meta_info"]["weight_version"]) + 1
    after = _gen(http, input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
    assert after["meta_info"]["weight_version"] == new
    assert http.get("/get_model_info").json()["weight_version"] == new
    with RolloutClient(http_daemon.target, JOB) as c:  # the same policy service as gRPC
        assert c.raw.get_policy(JOB).version == int(new)
    bad = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "none")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"


def test_model_info_and_health(http, text_model):
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(text_model.resolve()) and info["is_generation"] is True
    assert info["job_id"] == JOB
    assert http.get(f"/jobs/{JOB}/get_model_info").json() == info
    assert http.get("/health").status_code == 200


def test_bad_input_is_400_naming_the_field_and_the_daemon_keeps_serving(http):
    cases = [
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (
            {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
            "sampling_params.temperature",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        (
            {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}},
            "sampling_params.frequency_penalty",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        (
            {"input_ids": [1, 2], "sampling_params": {"sampling_seed": -1}},
            "sampling_params.sampling_seed",
        ),
        ({"input_ids": [[1, 2], [3, 100]]}, "input_ids[1][1]"),
        ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
        ({"input_ids": "12"}, "input_ids"),
        ({"input_ids": [1, 2], "text": "1"}, "input_ids"),
        ({"input_ids": [1, 2], "top_logprobs_num": 129}, "top_logprobs_num"),
        ({"input_ids": [1, 2], "image_data": "x.png"}, "image_data"),
        ({"input_ids": [1, 2], "rid": "no spaces please"}, "rid"),
    ]
    for body, param in cases:
        r = http.post("/generate", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    for raw in (b"{", b"[1, 2", b"\xff\xfe", b""):
        r = http.post("/generate", content=raw)
        assert r.status_code == 400 and r.json()["error"]["param"] == "body", (raw, r.text)
    assert http.post("/update_weights_from_disk", json={}).json()["error"]["param"] == "model_path"
    assert http.get("/no-such-path").status_code == 404
    assert _gen(http, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})["output_ids"]


def test_a_second_active_job_needs_the_job_in_the_url(http, http_daemon, text_model):
    with RolloutClient(http_daemon.target) as c:
        c.create_job(text_model, job_id="http-other", speculative="off", online_training=False)
        try:
            r = http.post("/generate", json={"input_ids": [1, 2]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "job"
            r = http.post(
                "/jobs/http-other/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
            )
            assert r.status_code == 200 and r.json()["meta_info"]["id"]
            assert http.post("/jobs/nope/generate", json={"input_ids": [1]}).status_code == 404
        finally:
            c.raw.cancel_job("http-other", "test over")
    cancelled = http.post("/jobs/http-other/generate", json={"input_ids": [1, 2]})
    assert cancelled.status_code == 409  # FAILED_PRECONDITION: the job is cancelled
