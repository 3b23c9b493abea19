"""UpdatePolicy records only checkpoints its workers can load, checked without loading them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.api.support import fails
from tests.rollout.support import make_checkpoint

C = grpc.StatusCode
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    """A real tiny Qwen2 (tied embeddings: no lm_head.weight in its file)."""
    return make_checkpoint(tmp_path_factory.mktemp("policy") / "policy")


@pytest.fixture
def job(client, policy) -> Path:
    client.create_job(str(policy), job_id="job")
    return policy


def _copy(policy: Path, dest: Path) -> Path:
    shutil.copytree(policy, dest)
    return dest


def _with_tensors(policy: Path, dest: Path, change) -> Path:
    """A copy of the policy whose tensors are `change(state_dict)`."""
    _copy(policy, dest)
    sd = load_file(str(dest / WEIGHTS))
    change(sd)
    save_file(sd, str(dest / WEIGHTS), metadata={"format": "pt"})
    return dest


def test_copies_of_the_policy_are_accepted(client, job, tmp_path):
    assert client.update_policy("job", str(_copy(job, tmp_path / "same"))).version == 1

    def half(sd):  # trainers often save bf16: the workers cast it to their dtype
        sd.update({k: v.to(torch.bfloat16) for k, v in sd.items()})

    assert (
        client.update_policy("job", str(_with_tensors(job, tmp_path / "bf16", half))).version == 2
    )

    def sharded(dest: Path) -> Path:  # the engine reads every *.safetensors of the directory
        sd = load_file(str(dest / WEIGHTS))
        (dest / WEIGHTS).unlink()
        names = sorted(sd)
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            save_file(
                {k: sd[k] for k in part}, str(dest / f"model-0000{i + 1}-of-00002.safetensors")
            )
        return dest

    assert client.update_policy("job", str(sharded(_copy(job, tmp_path / "shards")))).version == 3


def test_a_checkpoint_of_another_model_kind_is_refused(client, job, tmp_path):
    """A drafter checkpoint (config.json without hidden_size) was recorded, and every worker
    then failed to load it (KeyError: 'hidden_size')."""
    from tltd_workers.engine.eagle import EagleDrafter
    from tltd_workers.engine.transformer import load_model

    drafter = tmp_path / "drafter"
    EagleDrafter.random_init(load_model(job), seed=0).save_pretrained(drafter)
    with fails(C.INVALID_ARGUMENT, "checkpoint.path: ", "hidden_size"):
        client.update_policy("job", str(drafter))
    config = json.loads((job / "config.json").read_text())
    del config["num_attention_heads"]
    partial = _copy(job, tmp_path / "partial")
    (partial / "config.json").write_text(json.dumps(config))
    with fails(C.INVALID_ARGUMENT, "checkpoint.path: ", "num_attention_heads"):
        client.update_policy("job", str(partial))
    assert client.get_job("job").policy_version == 0


def test_truncated_or_malformed_weights_are_refused(client, job, tmp_path):
    size = (job / WEIGHTS).stat().st_size
    cases = {
        "header": 1000,  # cut inside the JSON header (the reported failure)
        "data": size - 4,  # header whole, the last tensor's bytes short
        "tiny": 5,  # not even the header length
    }
    for name, keep in cases.items():
        dest = _copy(job, tmp_path / name)
        with (dest / WEIGHTS).open("r+b") as f:
            f.truncate(keep)
        with fails(C.INVALID_ARGUMENT, "checkpoint.path: ", str(dest / WEIGHTS)):
            client.update_policy("job", str(dest))
    grown = _copy(job, tmp_path / "grown")
    with (grown / WEIGHTS).open("ab") as f:
        f.write(b"\0" * 8)  # bytes no tensor owns: not what was saved
    with fails(C.INVALID_ARGUMENT, "checkpoint.path: ", "truncated?"):
        client.update_policy("job", str(grown))
    garbage = _copy(job, tmp_path / "garbage")
    (garbage / WEIGHTS).write_bytes((16).to_bytes(8, "little") + b"not json at all!")
    with fails(C.INVALID_ARGUMENT, "checkpoint.path: ", "safetensors"):
        client.update_policy("job", str(garbage))
    assert client.get_job("job").policy_version == 0


def test_every_tensor_is_checked_against_the_model(client, job, tmp_path):
    layer = "model.layers.1."

    def drop(sd):
        del sd[layer + "mlp.down_proj.weight"]

    def reshape(sd):
        sd[layer + "self_attn.k_proj.weight"] = torch.zeros(4, 32)

    def integer(sd):
        sd[layer + "mlp.up_proj.weight"] = sd[layer + "mlp.up_proj.weight"].to(torch.int32)

    def deeper(sd):  # a third layer the two-layer workers would silently ignore
        sd["model.layers.2.mlp.down_proj.weight"] = sd[layer + "mlp.down_proj.weight"].clone()

    def renamed(sd):
        sd["fc.weight"] = sd.pop("model.norm.weight")

    cases = [
        (drop, "model.layers.1.mlp.down_proj.weight is missing"),
        (reshape, "model.layers.1.self_attn.k_proj.weight has shape (4, 32)"),
        (integer, "model.layers.1.mlp.up_proj.weight has dtype I32"),
        (deeper, "model.layers.2.mlp.down_proj.weight is not a tensor of the job's model"),
        (renamed, "model.norm.weight is missing"),
    ]
    for i, (change, needle) in enumerate(cases):
        dest = _with_tensors(job, tmp_path / f"case-{i}", change)
        with fails(C.INVALID_ARGUMENT, "checkpoint.path: ", needle):
            client.update_policy("job", str(dest))
    assert client.get_job("job").policy_version == 0
    # The refusals left nothing behind: a good checkpoint is still version 1.
    assert client.update_policy("job", str(_copy(job, tmp_path / "good"))).version == 1


def test_create_job_checks_its_model_weights_too(client, policy, tmp_path):
    from examples.task.workload import MODEL_DIR
    from tltd.services.checkpoints import check_model_weights

    check_model_weights(Path(MODEL_DIR), "model_path")  # the shipped policy passes
    truncated = _copy(policy, tmp_path / "truncated")
    with (truncated / WEIGHTS).open("r+b") as f:
        f.truncate(1000)
    with fails(C.INVALID_ARGUMENT, "model_path: ", "not a whole safetensors file"):
        client.create_job(str(truncated))

    def drop(sd):
        del sd["model.norm.weight"]

    with fails(C.INVALID_ARGUMENT, "model_path: ", "model.norm.weight is missing"):
        client.create_job(str(_with_tensors(policy, tmp_path / "no-norm", drop)))
    assert client.list_jobs() == []
