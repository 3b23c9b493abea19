"""SGLang's server as slime, AReaL and SkyRL 0.3 call it, against a real daemon: their exact
/generate bodies (tests/sglang_contract/http_cases.json, taken from their sources), and the
weight-update dance around them (pause, abort, update from disk, continue), with every sample
accounted for and the versions recorded; and the distributed weight update with a real
trainer process as rank 0 of a gloo group it hosts (the daemon joins, receives the trainer's
buckets, and the full set becomes one policy version that later samples carry, while a
request in flight across it finishes on the version it started with)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.http_api.conftest import JOB
from tests.http_api.support import wait_held, wait_running
from tltd.domain import RequestStatus
from tltd.errors import NotFound

TRAINER = Path(__file__).with_name("gloo_trainer.py")
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
    before = store.jobs.get(JOB).policy_version
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
    assert store.requests.get("areal-1").status is RequestStatus.CANCELLED
    (partial,) = store.samples.list("areal-1")
    assert partial.partial and list(partial.token_ids) == got
    assert partial.policy_version == before


def test_pause_in_place_holds_new_requests_and_abort_request_by_rid(http, http_daemon):
    store = http_daemon.store
    assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    try:
        t, out = _generate_in_thread(http_daemon.url, _long_body("held-1", [1, 5], 480))
        wait_held(http)  # refused by the pause, waiting at admission
        with pytest.raises(NotFound):  # held before admission: not even stored
            store.requests.get("held-1")
    finally:
        http.post("/continue_generation", json={})
    wait_running(store, "held-1")
    r = http.post("/abort_request", json={"rid": "held-1"})
    assert r.json() == {"success": True, "aborted": 1}
    t.join(60)
    assert out["response"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meta(weights: dict, names: list[str]) -> dict:
    return {
        "names": names,
        "dtypes": ["bfloat16"] * len(names),
        "shapes": [list(weights[n].shape) for n in names],
        "group_name": "g1",
        "weight_version": "step-7",
    }


def test_a_gloo_group_update_becomes_a_version(http, http_daemon, text_model, tmp_path):
    store = http_daemon.store
    before = store.jobs.get(JOB).policy_version
    weights = load_file(str(text_model / "model.safetensors"))
    names = sorted(weights)
    buckets = [names[: len(names) // 2], names[len(names) // 2 :]]  # slime sends buckets
    port, out = _free_port(), tmp_path / "sent.safetensors"
    trainer = subprocess.Popen(
        [
            sys.executable,
            str(TRAINER),
            str(text_model),
            str(port),
            "g1",
            str(out),
            json.dumps(buckets),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # A request in flight across the update: the job pauses in place around it.
        flight: dict = {}
        body = {
            "input_ids": [1, 5, 6],
            "rid": "across-1",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        }
        t = threading.Thread(
            target=lambda: flight.update(
                r=httpx.post(http_daemon.url + "/generate", json=body, timeout=120)
            )
        )
        t.start()
        wait_running(store, "across-1")
        assert http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        init = {
            "master_address": "127.0.0.1",
            "master_port": str(port),  # AReaL sends a string
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g1",
            "backend": "gloo",
        }
        assert http.post("/init_weights_update_group", json=init).json()["success"] is True
        first = http.post("/update_weights_from_distributed", json=_meta(weights, buckets[0]))
        assert first.json()["pending"] == len(buckets[1]) and "policy_version" not in first.json()
        done = http.post("/update_weights_from_distributed", json=_meta(weights, buckets[1])).json()
        assert done["policy_version"] == before + 1 and done["weight_version"] == "step-7"
        assert trainer.wait(60) == 0, trainer.stderr.read()
        assert http.post("/destroy_weights_update_group", json={"group_name": "g1"}).json()[
            "success"
        ]
        http.post("/continue_generation", json={})
    finally:
        if trainer.poll() is None:
            trainer.kill()
    t.join(120)
    across = flight["r"].json()
    assert across["meta_info"]["weight_version"] == str(before)  # finished on its start version
    assert len(across["output_ids"]) == 300
    assert store.requests.get("across-1").status is RequestStatus.COMPLETED
    # The version holds exactly what the trainer sent (cast to the checkpoint's dtype).
    version = store.policies.get(JOB, before + 1)
    got = load_file(str(Path(version.path) / "model.safetensors"))
    sent = load_file(str(out))
    assert set(got) == set(sent) == set(weights)
    assert all(torch.equal(got[n], sent[n]) for n in names)
    # Samples from now on run on it.
    after = http.post(
        "/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}}
    )
    assert after.json()["meta_info"]["weight_version"] == str(before + 1)


def test_group_errors_name_their_field(http):
    r = http.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 2,
            "backend": "nccl",
        },
    )
    assert r.status_code == 409 and r.json()["error"]["param"] == "backend"
    r = http.post(
        "/update_weights_from_distributed",
        json={"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[1]], "group_name": "nope"},
    )
    assert r.status_code == 404 and r.json()["error"]["param"] == "group_name"
    r = http.post("/update_weights_from_tensor", json={"serialized_named_tensors": []})
    assert r.status_code == 400


def test_keep_pause_leaves_the_job_paused_after_an_update(http, text_model):
    body = {"model_path": str(text_model), "keep_pause": True, "torch_empty_cache": True}
    assert http.post("/update_weights_from_disk", json=body).json()["success"] is True
    assert http.get("/get_server_info").json()["paused"] is True
    assert http.post("/continue_generation", json={"torch_empty_cache": False}).status_code == 200
    assert http.get("/get_server_info").json()["paused"] is False
