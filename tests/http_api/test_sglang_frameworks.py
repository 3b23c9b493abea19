"""SGLang's server as slime, AReaL and SkyRL 0.3 call it, against a real daemon: their exact
/generate bodies (tests/sglang_contract/http_cases.json, taken from their sources), and the
weight-update dance around them (pause, abort, update from disk, continue), with every sample
accounted for and the versions recorded."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.http_api.conftest import JOB
from tests.http_api.support import wait_running
from tltd.domain import RequestStatus
from tltd.errors import NotFound

BODIES = json.loads(
    (Path(__file__).resolve().parents[1] / "sglang_contract" / "http_cases.json").read_text()
)["framework_bodies"]


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=60) as c:
        yield c


def test_slime_body(http):
    out = http.post("/generate", json=BODIES["slime"]).json()
    pairs = out["meta_info"]["output_token_logprobs"]  # slime reads [logprob, id, text]
    assert [p[1] for p in pairs] == out["output_ids"] and all(p[0] <= 0 for p in pairs)
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_areal_body(http):
    out = http.post("/generate", json=BODIES["areal"]).json()
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"]) > 0


def test_skyrl_batch_body(http):
    out = http.post("/generate", json=BODIES["skyrl"]).json()
    assert isinstance(out, list) and len(out) == 2  # one output per prompt, in order
    assert all(o["output_ids"] and o["meta_info"]["finish_reason"]["type"] for o in out)


def test_an_image_is_refused_by_name(http):
    r = http.post("/generate", json={**BODIES["areal"], "image_data": ["data:image/png;base64,"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"


def test_control_routes(http):
    assert http.get("/flush_cache").status_code == 200  # slime GETs it
    assert http.post("/flush_cache").status_code == 200  # SkyRL POSTs it
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_server_info").json()
    assert info["served_model_name"] == JOB and info["tltd"]["job_id"] == JOB
    assert http.get(f"/jobs/{JOB}/server_info").json()["tp_size"] == 1
    r = http.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


def _generate_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        out["response"] = httpx.post(url + "/generate", json=body, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _long_body(rid: str, prompt: list[int], max_new: int) -> dict:
    return {
        "input_ids": prompt,
        "image_data": [],
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 1.0},
    }


def test_areal_weight_update_dance(http, http_daemon, text_model):
    """AReaL's loop: pause (abort) -> the in-flight sample returns with finish reason abort
    and its tokens so far -> update from disk -> continue -> the client resubmits prompt +
    tokens for the rest, which runs on the new version."""
    store, prompt, max_new = http_daemon.store, [1, 9, 8], 480
    before = store.get_job(JOB).policy_version
    t, out = _generate_in_thread(http_daemon.url, _long_body("areal-1", prompt, max_new))
    wait_running(store, "areal-1")
    assert http.post("/pause_generation", json={}).json()["aborted"] == 1
    t.join(60)
    first = out["response"].json()
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    got = [p[1] for p in first["meta_info"]["output_token_logprobs"]]
    assert 0 < len(got) < max_new and got == first["output_ids"]
    assert first["meta_info"]["weight_version"] == str(before)

    update = {
        "model_path": str(text_model),
        "abort_all_requests": True,
        "weight_version": "step-1",
        "flush_cache": True,
    }
    r = http.post("/update_weights_from_disk", json=update)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert http.get("/get_weight_version").json() == {
        "weight_version": "step-1",
        "policy_version": before + 1,
    }
    http.post("/continue_generation", json={})

    rest = _long_body("areal-2", prompt + got, max_new - len(got))
    second = http.post("/generate", json=rest).json()
    assert second["meta_info"]["finish_reason"]["type"] == "length"
    assert len(got) + len(second["output_ids"]) == max_new  # every token accounted for
    assert second["meta_info"]["weight_version"] == str(before + 1)
    # The store keeps both, each once: the aborted one cancelled with its partial sample.
    assert store.get_request("areal-1").status is RequestStatus.CANCELLED
    (partial,) = store.list_samples("areal-1")
    assert partial.partial and list(partial.token_ids) == got
    assert partial.policy_version == before


def test_pause_in_place_holds_new_requests_and_abort_request_by_rid(http, http_daemon):
    store = http_daemon.store
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        t, out = _generate_in_thread(http_daemon.url, _long_body("held-1", [1, 5], 480))
        t.join(1.0)
        assert t.is_alive()  # held before admission: not even stored
        with pytest.raises(NotFound):
            store.get_request("held-1")
    finally:
        http.post("/continue_generation", json={})
    wait_running(store, "held-1")
    r = http.post("/abort_request", json={"rid": "held-1"})
    assert r.json() == {"success": True, "aborted": 1}
    t.join(60)
    assert out["response"].json()["meta_info"]["finish_reason"]["type"] == "abort"
