"""A GPU trainer whose weight group is NCCL gets the daemon's answer (gloo or disk) within 5 s on
vLLM's and SGLang's group routes, instead of waiting out the rendezvous timeout."""

from __future__ import annotations

import datetime
import pickle
import socket
import time

import httpx
import pytest
import torch.distributed as dist

ANSWER_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=120) as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_nccl_trainer_store(port: int):
    """What TRL's init_communicator leaves in its store before NCCL's rendezvous: vLLM's
    NCCLWeightTransferEngine.trainer_init hosts a TCPStore as rank 0 (StatelessProcessGroup)
    and its PyNcclCommunicator broadcasts the NCCL unique id, rank 0's first broadcast, under
    "broadcast_from/0/0". Nothing of a gloo group is ever written."""
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)  # fmt: skip
    store.set("broadcast_from/0/0", pickle.dumps(b"\0" * 128))  # an ncclUniqueId's 128 bytes
    return store


def test_vllm_init_without_a_backend_from_an_nccl_trainer_answers_within_5_s(http):
    port = _free_port()
    store = _vllm_nccl_trainer_store(port)
    # TRL's init_info: no backend field (vLLM's NCCLWeightTransferInitInfo has none).
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    t0 = time.monotonic()
    r = http.post("/init_weight_transfer_engine", json={"init_info": init})
    took = time.monotonic() - t0
    del store
    assert r.status_code == 409, r.text
    assert took < ANSWER_WITHIN_S, f"answered after {took:.1f} s"
    err = r.json()["error"]
    assert err["param"] == "init_info.backend"
    assert "NCCL" in err["message"] and "gloo" in err["message"]
    assert "/update_weights_from_disk" in err["message"]
    # Nothing was joined: the next update names the missing group.
    r = http.post("/start_weight_update", json={})
    assert r.status_code == 404


def test_sglang_init_without_a_backend_is_sglang_s_nccl_and_answered_at_once(http):
    body = {"master_address": "127.0.0.1", "master_port": _free_port(), "rank_offset": 1,
            "world_size": 2, "group_name": "g-nccl"}  # fmt: skip
    t0 = time.monotonic()
    r = http.post("/init_weights_update_group", json=body)
    took = time.monotonic() - t0
    assert r.status_code == 409, r.text
    assert took < ANSWER_WITHIN_S, f"answered after {took:.1f} s"
    err = r.json()["error"]
    assert err["param"] == "backend" and "'nccl'" in err["message"]
    assert "gloo" in err["message"] and "/update_weights_from_disk" in err["message"]
