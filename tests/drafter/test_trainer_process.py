"""The drafter-training worker as a real spawned process: preempt, resume, restart from disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.drafter.helpers import (
    fill_buffer,
    load_target,
    make_target_dir,
    new_drafter,
    rollout_samples,
)
from tests.torch_device import torch_device
from tltd.contract.drafter_messages import (
    Checkpointed,
    DeviceFree,
    Idle,
    Measure,
    Measured,
    Preempt,
    SetPolicy,
    Stepped,
    TrainerSpec,
    TrainingSample,
)
from tltd.domain import DrafterStatus, Job
from tltd.drafter_training.process import TrainerProcess
from tltd.drafter_training.versions import record
from tltd.store import Store
from tltd.store.migrate import upgrade
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.forward import target_hidden
from tltd_workers.drafter.trainer import Trainer, TrainerConfig, latest_checkpoint

CFG = TrainerConfig(items_per_micro=2, micro_per_step=3, warmup_steps=3, lr=3e-3, row_len=64)
STEPS = 14


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: it must precede the module-scoped model fixtures
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _payload(target, samples):
    return [
        TrainingSample(tuple(t), rs, hidden=target_hidden(target, [torch.tensor(t)])[0])
        for t, rs in samples
    ]


@pytest.mark.slow
def test_preempted_k_times_and_restarted_ends_like_uninterrupted(tmp_path, sqlite_url):
    model_dir = make_target_dir(tmp_path / "target")
    target = load_target(model_dir)
    samples = rollout_samples(target, 10, seed=2)

    # Reference: uninterrupted, in this process, same seed and data.
    buf = TrainingBuffer(1 << 24)
    fill_buffer(buf, target, samples)
    ref = Trainer(new_drafter(target, seed=0), buf, CFG)
    ref_ids = [ref.train_step().item_ids for _ in range(STEPS)]

    spec = TrainerSpec(
        model_path=str(model_dir),
        checkpoint_dir=str(tmp_path / "ckpt"),
        trainer=CFG,
        drafter_seed=0,
        device=torch_device(),
    )
    payload = _payload(target, samples)
    w = TrainerProcess(spec)
    latencies = []
    try:
        assert w.start().step == 0
        w.add(payload)
        w.train(STEPS)
        for k in range(3):  # preempt while training, idle, resume in the same process
            while len(w.steps) < 2 * (k + 1):
                w.wait_for(Stepped)
            latencies.append(w.preempt())
            w.wait_for(Checkpointed)
            w.train(STEPS)
        while len(w.steps) < 9:
            w.wait_for(Stepped)
        latencies.append(w.preempt())
        stopped = w.stop()  # exit; a new process resumes from the checkpoint on disk
    finally:
        w.kill()
    assert stopped.step == len(w.steps)

    w2 = TrainerProcess(spec)
    try:
        ready = w2.start()
        assert ready.step == len(w.steps) and ready.resumed_from
        w2.add(payload)  # the buffer is volatile: the daemon re-feeds the same samples
        w2.train(STEPS)
        assert w2.wait_for(Idle).reason == "max_steps"
        # The worker measures a candidate; the daemon records it as a version.
        upgrade(sqlite_url)
        store = Store(sqlite_url)
        store.jobs.create(Job(job_id="j", model_path=str(model_dir)))
        held = tuple(TrainingSample(tuple(t), rs) for t, rs in rollout_samples(target, 3, seed=8))
        m = w2.measure(Measure(held, policy_version=2, out_dir=str(tmp_path / "versions")))
        assert m.train_steps == STEPS and m.baseline == 1.0 and m.held_out == 3
        dv = record(store, "j", m)
        assert dv.version == 1 and dv.train_steps == STEPS and dv.policy_version == 2
        assert dv.status in (DrafterStatus.PROMOTED, DrafterStatus.REJECTED)
        assert store.drafters.get("j", 1).acceptance_length == m.acceptance >= 1.0
        store.close()
        w2.stop()
    finally:
        w2.kill()

    got_ids = [tuple(s.item_ids) for s in w.steps + w2.steps]
    assert [s.step for s in w.steps + w2.steps] == list(range(1, STEPS + 1))
    assert got_ids == ref_ids, "an item was trained twice or skipped"
    final = load_file(str(latest_checkpoint(spec.checkpoint_dir) / "model.safetensors"))
    assert set(final) == set(ref.params)
    for n, p in ref.params.items():
        torch.testing.assert_close(final[n], p.detach().cpu(), atol=1e-5, rtol=1e-4)
    assert all(lat < 10 for lat in latencies)  # sanity only; timing lives in the benchmark


def test_a_new_policy_loaded_in_place_measures_as_a_trainer_spawned_on_it(tmp_path):
    """`SetPolicy` replaces the running trainer's target weights in place (the drafter shares
    its embeddings and LM head): its drafter then measures as the same drafter in a trainer
    started on the new policy does, and not as on the old policy."""
    old_dir = make_target_dir(tmp_path / "old", seed=0)
    new_dir = make_target_dir(tmp_path / "new", seed=1)
    old = load_target(old_dir)
    train = [TrainingSample(tuple(t), rs) for t, rs in rollout_samples(old, 10, seed=2)]
    held = tuple(TrainingSample(tuple(t), rs) for t, rs in rollout_samples(old, 3, seed=8))

    def spec(model_dir, name, drafter=None):
        return TrainerSpec(
            model_path=str(model_dir), checkpoint_dir=str(tmp_path / name), trainer=CFG,
            drafter_path=drafter, drafter_seed=0, device=torch_device(),
        )  # fmt: skip

    def measure(w, version, name):
        return w.measure(Measure(held, policy_version=version, out_dir=str(tmp_path / name)))

    in_place = TrainerProcess(spec(old_dir, "in-place"))
    try:
        in_place.start()
        # A low-priority process: the OS gives it only the CPU that rollouts leave.
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, in_place.proc.pid) == min(19, ours + 19)
        in_place.add(train)
        in_place.train(STEPS)
        assert in_place.wait_for(Idle).reason == "max_steps"
        before = measure(in_place, 0, "m0")
        in_place.send(SetPolicy(str(new_dir), 1))
        after = measure(in_place, 1, "m1")
        in_place.stop()
    finally:
        in_place.kill()
    fresh = TrainerProcess(spec(new_dir, "fresh", drafter=after.path))
    try:
        fresh.start()
        expected = measure(fresh, 1, "m2")
        fresh.stop()
    finally:
        fresh.kill()
    assert before.acceptance > 1.0  # the drafter learnt the old policy
    assert after.acceptance == expected.acceptance != before.acceptance


def test_a_preempt_during_a_measurement_gives_it_up_and_frees_the_device(tmp_path):
    """Measuring a candidate takes seconds on a CPU; a preempt arriving meanwhile frees the
    device between held-out samples, reports no measurement and leaves no version behind; the
    next Measure is answered."""
    model_dir = make_target_dir(tmp_path / "target")
    target = load_target(model_dir)
    held = tuple(TrainingSample(tuple(t), rs) for t, rs in rollout_samples(target, 3, seed=8))
    spec = TrainerSpec(
        model_path=str(model_dir), checkpoint_dir=str(tmp_path / "ckpt"), trainer=CFG,
        drafter_seed=0, device=torch_device(),
    )  # fmt: skip
    out = tmp_path / "versions"
    w = TrainerProcess(spec)
    try:
        w.start()
        w.send(Measure(held, policy_version=0, out_dir=str(out)))
        w.send(Preempt())  # in the pipe before the measurement's first sample
        w.wait_for(DeviceFree)
        assert not any(isinstance(e, Measured) for e in w.events)
        assert not out.exists() or not any(out.iterdir())
        m = w.measure(Measure(held, policy_version=0, out_dir=str(out)))
        assert m.held_out == 3 and [p.name for p in out.iterdir()] == [Path(m.path).name]
        w.stop()
    finally:
        w.kill()
