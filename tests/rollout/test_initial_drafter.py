"""A job started from an offline-fitted EAGLE drafter: validated, stored as version 1, used."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from safetensors.torch import load_file, save_file

from tests.api.support import fails, sampling
from tests.rollout.support import direct_outputs, make_checkpoint, wait_until
from tltd.domain import SamplingParams
from tltd.supervisor.worker_process import Phase
from tltd.v1 import common_pb2, drafter_pb2
from tltd_clients.errors import InvalidArgumentError
from tltd_clients.rollout import RolloutClient

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
FIELD = "speculative.initial_drafter_path"


def _drafter(model_dir: Path, out: Path, seed: int = 3) -> Path:
    from tltd_workers.engine.eagle import EagleDrafter
    from tltd_workers.engine.transformer import load_model

    EagleDrafter.random_init(load_model(model_dir), seed=seed).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def initial_drafter(ckpt, tmp_path_factory) -> Path:
    return _drafter(ckpt, tmp_path_factory.mktemp("initial") / "drafter")


def test_job_starts_from_the_initial_drafter_and_rollouts_use_it(daemon, ckpt, initial_drafter):
    d, sup = daemon, daemon.supervisor
    params = dict(n=2, temperature=0.0, max_new_tokens=40)
    with d.client() as c:
        job = c.create_job(str(ckpt), job_id="job", initial_drafter=initial_drafter)
        assert job.drafter_version == 1
        assert job.speculative.initial_drafter_path == str(initial_drafter.resolve())
        assert c.get_job("job").drafter_version == 1
        listed = c.list_drafters("job")
        assert listed.active_version == 1 and len(listed.drafters) == 1
        v1 = listed.drafters[0]
        assert v1.status == drafter_pb2.DRAFTER_STATUS_PROMOTED and v1.active
        assert v1.policy_version == 0
        # A copy in the daemon's own storage, not the caller's directory.
        stored = Path(v1.path)
        assert stored.is_relative_to(Path(d.settings.data_dir))
        assert (stored / "model.safetensors").read_bytes() == (
            initial_drafter / "model.safetensors"
        ).read_bytes()
        # A retry with the same parameters is the same job, with no second version.
        again = c.create_job(str(ckpt), job_id="job", initial_drafter=initial_drafter)
        assert again.drafter_version == 1 and len(c.list_drafters("job").drafters) == 1
        d.wait_workers_ready(2)
        wait_until(
            lambda: all(
                s.drafter_version == 1 and s.phase is Phase.READY for s in sup.handles.values()
            ),
            what="initial drafter loaded by every worker",
        )
        got = list(c.generate("job", PROMPTS, sampling=sampling(**params)))
    # A random drafter is mostly rejected, but the output is still exactly the target's.
    by_key = {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in got}
    assert by_key == direct_outputs(ckpt, PROMPTS, SamplingParams(**params))
    assert any(s.drafter_version == 1 for s in got)  # EAGLE steps ran with version 1


def _legacy(src: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    (out / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    norm = tensors["layer.post_attention_layernorm.weight"]
    tensors["layer.input_layernorm.weight"] = norm.clone()
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_bad_initial_drafters_are_invalid_arguments_naming_the_field(
    sqlite_daemon, ckpt, initial_drafter, tmp_path
):
    d = sqlite_daemon
    other = make_checkpoint(tmp_path / "wide", hidden=64)
    wide = _drafter(other, tmp_path / "wide-drafter")
    not_drafter = tmp_path / "not-drafter"
    not_drafter.mkdir()
    (not_drafter / "config.json").write_text(json.dumps({"hidden_size": 32}))
    save_file({}, str(not_drafter / "model.safetensors"))
    cases = {
        str(tmp_path / "missing"): "not a directory",
        str(ckpt): "not an EAGLE drafter config",  # a policy, not a drafter
        str(not_drafter): "not an EAGLE drafter config",
        str(wide): "hidden size 64",
        str(_legacy(initial_drafter, tmp_path / "legacy")): "input norm",
    }
    with d.client() as c:
        for i, (path, why) in enumerate(cases.items()):
            with fails(grpc.StatusCode.INVALID_ARGUMENT, FIELD, why):
                c.create_job(str(ckpt), job_id=f"bad-{i}", initial_drafter=path)
        for spec in (
            common_pb2.SpeculativeConfig(mode=common_pb2.SPECULATIVE_MODE_OFF),
            common_pb2.SpeculativeConfig(drafter="ngram"),
            common_pb2.SpeculativeConfig(drafter="history"),
        ):
            with fails(grpc.StatusCode.INVALID_ARGUMENT, FIELD, "learned drafter"):
                c.create_job(
                    str(ckpt), job_id="bad-mode", speculative=spec, initial_drafter=initial_drafter
                )
        # Nothing was created, and the daemon keeps serving.
        assert [j.job_id for j in c.list_jobs()] == []
    with RolloutClient(d.target) as rc:  # the trainer-side client passes it the same way
        job = rc.create_job(ckpt, job_id="good", initial_drafter=initial_drafter)
        assert job.drafter_version == 1
        with pytest.raises(InvalidArgumentError, match=FIELD):
            rc.create_job(ckpt, job_id="bad-rc", initial_drafter=tmp_path / "missing")
    versions = Path(d.settings.data_dir) / "drafters"
    assert sorted(p.name for p in versions.iterdir()) == ["good"]  # no stray copies
