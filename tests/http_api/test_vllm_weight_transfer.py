"""vLLM's weight-transfer routes against a real daemon, with a real trainer process as rank 0
of a gloo group it hosts (torch's init_process_group): init, start, updates in buckets,
finish; the update becomes one policy version holding what was sent (and the current
version's tensors for the rest), seen on later samples; bad bodies refused by name."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.http_api.conftest import JOB

TRAINER = Path(__file__).with_name("vllm_trainer.py")


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=120) as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _update_info(weights: dict, names: list[str]) -> dict:
    return {
        "update_info": {
            "names": names,
            "dtype_names": ["bfloat16"] * len(names),  # as the trainer broadcasts them
            "shapes": [list(weights[n].shape) for n in names],
        }
    }


def test_a_bracketed_update_becomes_one_version(http, http_daemon, text_model, tmp_path):
    store = http_daemon.store
    before = store.jobs.get(JOB).policy_version
    old = load_file(str(Path(store.policies.get(JOB, before).path) / "model.safetensors"))
    weights = load_file(str(text_model / "model.safetensors"))
    names = sorted(weights)
    kept = names[-2:]  # not sent: vLLM keeps the parameters an update leaves out
    sent_names = names[:-2]
    buckets = [sent_names[: len(sent_names) // 2], sent_names[len(sent_names) // 2 :]]
    port, out = _free_port(), tmp_path / "sent.safetensors"
    trainer = subprocess.Popen(
        [sys.executable, str(TRAINER), str(text_model), str(port), str(out), json.dumps(buckets)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        info = http.get("/server_info", params={"config_format": "json"}).json()
        assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
        init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1}
        r = http.post("/init_weight_transfer_engine", json={"init_info": {**init, "world_size": 2}})
        assert r.status_code == 200, r.text
        assert http.post("/start_weight_update", json={}).status_code == 200
        for bucket in buckets:
            r = http.post("/update_weights", json=_update_info(weights, bucket))
            assert r.status_code == 200, r.text
            assert r.json()["received"] == len(bucket)
        assert store.jobs.get(JOB).policy_version == before  # nothing until finish
        done = http.post("/finish_weight_update", json={"weight_version": "step-3"})
        assert done.status_code == 200, done.text
        assert done.json()["policy_version"] == before + 1
        assert trainer.wait(60) == 0, trainer.stderr.read()
    finally:
        if trainer.poll() is None:
            trainer.kill()
    version = store.policies.get(JOB, before + 1)
    got = load_file(str(Path(version.path) / "model.safetensors"))
    sent = load_file(str(out))
    assert set(sent) == set(sent_names) and set(got) == set(names)
    assert all(torch.equal(got[n], sent[n]) for n in sent_names)
    assert all(torch.equal(got[n], old[n]) for n in kept)
    assert http.get("/weight_info").json() == {
        "weight_version": "step-3",
        "policy_version": before + 1,
    }
    # Later samples run on it.
    after = http.post(
        "/v1/completions", json={"model": JOB, "prompt": [1, 5], "max_tokens": 2}
    ).json()
    assert after["choices"][0]["tltd"]["policy_version"] == before + 1
    # A second update on the same group: start .. finish with nothing sent carries all over.
    assert http.post("/start_weight_update", json={}).status_code == 200
    again = http.post("/finish_weight_update", json={}).json()
    assert again["policy_version"] == before + 2 and again["weight_version"] == str(before + 2)
    same = load_file(str(Path(store.policies.get(JOB, before + 2).path) / "model.safetensors"))
    assert all(torch.equal(same[n], got[n]) for n in names)


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/init_weight_transfer_engine", {}, 400, "init_info"),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 1,
                    "world_size": 2,
                    "packed": True,
                }
            },
            400,
            "init_info.packed",
        ),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 0,
                    "world_size": 2,
                }
            },
            400,
            "init_info.rank_offset",
        ),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "master_address": "127.0.0.1",
                    "master_port": 1,
                    "rank_offset": 1,
                    "world_size": 2,
                    "backend": "nccl",
                }
            },
            409,
            "init_info.backend",
        ),
        (
            "/update_weights",
            {"update_info": {"names": ["a"], "dtype_names": [], "shapes": [[1]]}},
            400,
            "update_info.names",
        ),
        (
            "/update_weights",
            {
                "update_info": {
                    "names": ["a"],
                    "dtype_names": ["f"],
                    "shapes": [[1]],
                    "packed": True,
                }
            },
            400,
            "update_info.packed",
        ),
    ],
)
def test_bad_bodies_are_refused_by_name(http, path, body, status, field):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_an_update_without_a_group_or_a_start_says_what_to_do(http_daemon, text_model):
    """On a fresh job (no group joined) every step names what is missing."""
    with httpx.Client(base_url=http_daemon.url, timeout=60) as c:
        from tltd_clients import RolloutClient

        with RolloutClient(http_daemon.target) as rc:
            rc.create_job(text_model, job_id="nogroup", speculative="off", online_training=False)
        q = {"model": "nogroup"}
        r = c.post("/start_weight_update", params=q, json={})
        assert r.status_code == 404 and r.json()["error"]["param"] == "init_info"
        assert "/init_weight_transfer_engine" in r.json()["error"]["message"]
        r = c.post("/update_weights", params=q, json=_update_info({"a": torch.zeros(1)}, ["a"]))
        assert r.status_code == 404 and r.json()["error"]["param"] == "init_info"
