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
    assert info["weight_transfer_config"] == {"backend": "gloo"}
    # TRL's weight sync is vLLM's NCCL engine, built from vLLM's own helpers: without vLLM
    # installed (a CPU host) it stops in the client before any group is made.
    assert trl_run["init_communicator"].startswith("NameError: name 'get_ip'")
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
        # Within float32 rounding: the two calls may be batched differently across the two
        # workers, and a row's sums then round differently in the last bits (1.2e-6 seen).
        assert [p[0] for p in first["logprobs"][i]] == pytest.approx(list(s.logprobs), abs=1e-5)


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


def _reference(text_model, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_top_logprobs_parsed_by_trl(trl_run, text_model):
    """logprobs=3: per position the sampled token and the 3 most likely, as TRL sorts them,
    the values the model's own."""
    top3 = trl_run["top3"]
    for prompt, ids, lps, lp_ids in zip(
        top3["prompt_ids"],
        top3["completion_ids"],
        top3["logprobs"],
        top3["logprob_token_ids"],
        strict=True,
    ):
        dist = _reference(text_model, prompt + ids)
        for i, (tok, values, toks) in enumerate(zip(ids, lps, lp_ids, strict=True)):
            row = dist[len(prompt) - 1 + i]
            best = row.topk(3).indices.tolist()
            assert toks[:3] == best and tok in toks
            assert len(toks) == (3 if tok in best else 4)
            assert values == pytest.approx([float(row[t]) for t in toks], abs=1e-4)


def test_sequence_logprobs_for_distillation(trl_run, text_model):
    """get_sequence_logprobs (prompt logprobs at TRL's default top 100 of a 54-token vocab):
    the completion region's scores, padded by TRL to 100 with -inf."""
    got = trl_run["sequence_logprobs"]
    for k, seq in enumerate(trl_run["sequences"]):
        start = len(PROMPTS[k])
        dist = _reference(text_model, seq)
        assert len(got["logprobs"][k]) == len(seq) - start
        for j, pos in enumerate(range(start, len(seq))):
            row = dist[pos - 1]
            values, toks = got["logprobs"][k][j], got["logprob_token_ids"][k][j]
            vocab = row.shape[0]
            assert len(values) == 100 and values[vocab:] == [float("-inf")] * (100 - vocab)
            assert toks[:vocab] == row.argsort(descending=True).tolist()
            assert values[:vocab] == pytest.approx(
                row.sort(descending=True).values.tolist(), abs=1e-4
            )
            assert got["actual_logprobs"][k][j][0] == pytest.approx(float(row[seq[pos]]), abs=1e-4)


def test_no_logprobs_when_none_are_asked(trl_run):
    assert trl_run["no_logprobs"]["logprobs"] is None
    assert len(trl_run["no_logprobs"]["completion_ids"]) == 1
