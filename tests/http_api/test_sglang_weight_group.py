"""SGLang's distributed weight update against a real daemon, with a real trainer process as
rank 0 of a gloo group it hosts: the daemon joins by /init_weights_update_group, receives the
trainer's buckets by /update_weights_from_distributed, and the full set becomes one policy
version that later samples carry; a request in flight across the update finishes on the
version it started with (pause in_place), nothing lost."""

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
from tests.http_api.support import wait_running
from tltd.domain import RequestStatus

TRAINER = Path(__file__).with_name("gloo_trainer.py")


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=120) as c:
        yield c


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
    before = store.get_job(JOB).policy_version
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
    assert store.get_request("across-1").status is RequestStatus.COMPLETED
    # The version holds exactly what the trainer sent (cast to the checkpoint's dtype).
    version = store.get_policy_version(JOB, before + 1)
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
