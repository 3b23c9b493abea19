"""The torch worker keeps the cost model and each job's SD gate state across its engines."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.rollout.support import make_checkpoint
from tltd.contract.rollout_messages import EngineSpec, LoadModel
from tltd_workers.rollout.worker import GATE_STATES_KEPT, RolloutWorker


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


def test_a_job_that_comes_back_continues_its_gate_state(ckpt):
    here, _there = mp.Pipe()
    w = RolloutWorker(here, heartbeat_seconds=1.0)
    spec = EngineSpec(max_batch=4, max_seq_len=64)
    w.load(LoadModel("a", str(ckpt), 1, spec))
    assert w.engine is not None
    costs, state_a = w.engine.costs, w.engine.gate_state
    assert costs is not None and state_a is not None
    w.load(LoadModel("b", str(ckpt), 1, spec))
    assert w.engine.costs is costs  # same architecture on the same device: measured once
    assert w.engine.gate_state is not state_a
    w.load(LoadModel("a", str(ckpt), 2, spec))
    assert w.engine.gate_state is state_a and w.engine.policy_version == 2
    w.load(LoadModel("a", str(ckpt), 2, EngineSpec(max_batch=4, max_seq_len=64, gate="threshold")))
    assert w.engine.gate_state is not state_a  # another gate: another bandit
    for i in range(GATE_STATES_KEPT):
        w.load(LoadModel(f"other{i}", str(ckpt), 1, spec))
    assert "a" not in w.gate_states and len(w.gate_states) == GATE_STATES_KEPT
