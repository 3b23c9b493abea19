"""TRL 1.16's VLLMClient (GRPOTrainer's vllm_mode="server") against a real `tltd` daemon:
token-id prompts with n > 1, seeds, stop ids and logprobs in vLLM's shapes, server info,
world size and the prefix-cache reset, with nothing of the client changed but its "is vLLM
installed" check."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.http_api.conftest import JOB
from tltd_clients import RolloutClient

PROMPTS = [[1, 5, 6, 7], [1, 9, 8]]
DRIVER = Path(__file__).with_name("drive_trl.py")


@pytest.fixture(scope="module")
def trl_run(http_daemon) -> dict:
    python = os.environ["TLTD_TRL_PYTHON"]
    assert Path(python).is_file(), f"TLTD_TRL_PYTHON={python} is not a python executable"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [python, str(DRIVER), http_daemon.url, json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_it_is_trl_1_16_and_it_addresses_the_job(trl_run):
    assert trl_run["trl_version"] == "1.16.0"
    assert trl_run["model"] == JOB
    assert trl_run["world_size"] == 1
    info = trl_run["server_info"]
    assert info["model_config"]["served_model_name"] == JOB
    assert info["weight_transfer_config"] is None  # TRL's CUDA weight path says so up front
    assert trl_run["reset"] is True


def test_generate_with_token_ids_n_and_logprobs(trl_run, http_daemon):
    first = trl_run["first"]
    assert first["prompt_ids"] == PROMPTS
    assert len(first["completion_ids"]) == 2 * 3
    assert all(0 < len(c) <= 8 for c in first["completion_ids"])  # EOS (2) may end one
    # logprobs=0: one entry per position, the sampled token's, parsed by TRL itself.
    for ids, lps, lp_ids in zip(
        first["completion_ids"], first["logprobs"], first["logprob_token_ids"], strict=True
    ):
        assert lp_ids == [[t] for t in ids]
        assert all(len(p) == 1 and p[0] <= 0.0 for p in lps)
    # The same request over gRPC (same seed, SD off) gives the same tokens and logprobs.
    with RolloutClient(http_daemon.target, JOB) as c:
        grpc_samples = c.generate(
            PROMPTS, n=3, temperature=1.0, max_new_tokens=8, seed=7, stop_token_ids=[2]
        )
    for s in grpc_samples:
        i = s.prompt_index * 3 + s.sample_index
        assert first["completion_ids"][i] == list(s.token_ids)
        assert [p[0] for p in first["logprobs"][i]] == pytest.approx(list(s.logprobs), abs=1e-6)


def test_the_same_seed_gives_the_same_ids(trl_run):
    assert trl_run["again"]["completion_ids"] == trl_run["first"]["completion_ids"]
    assert trl_run["other_seed"]["completion_ids"] != trl_run["first"]["completion_ids"]


def test_stop_ids_end_a_sample_at_the_stop_token(trl_run):
    stop = trl_run["stop_id"]
    for full, cut in zip(
        trl_run["first"]["completion_ids"], trl_run["stopped"]["completion_ids"], strict=True
    ):
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert cut == expected


def test_no_logprobs_when_none_are_asked(trl_run):
    assert trl_run["no_logprobs"]["logprobs"] is None
    assert len(trl_run["no_logprobs"]["completion_ids"]) == 1
