"""Rollout -> buffer -> training -> publish through the Store -> hot swap into a running engine."""

from __future__ import annotations

import pytest
import torch

from tests.drafter.helpers import make_target_dir, publish
from tltd.domain import DrafterStatus, Job, SamplingParams
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.trainer import Trainer, TrainerConfig
from tltd_workers.drafter.versions import HeldOut
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.datatypes import EngineConfig, Request
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: it must precede the module-scoped model fixtures
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(n, seed, vocab=48):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (4,), generator=g).tolist() for _ in range(n)]


def test_promoted_drafter_hot_swaps_mid_generation_losslessly(store, tmp_path):
    target_dir = make_target_dir(tmp_path / "target", seed=5)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=24)

    # 1. A rollout with hidden states feeds the training buffer.
    collect = Engine(str(target_dir), EngineConfig(spec_mode="off"))
    buf = TrainingBuffer(1 << 24)
    train_prompts = _prompts(16, seed=1)
    outs = collect.generate(
        [
            Request(f"t{i}", p, greedy, return_hidden_states=True)
            for i, p in enumerate(train_prompts)
        ]
    )
    for o in outs:
        if o.sample_index == 0:  # greedy: both samples are the same
            buf.add_output(
                train_prompts[int(o.request_id[1:])],
                o.token_ids,
                step=0,
                policy_version=o.policy_version,
                hidden=o.hidden_states,
            )
    assert len(buf) == 16

    # 2. Train, then publish through the store: promoted over "no learned drafter".
    tr = Trainer(
        EagleDrafter.random_init(collect.model, seed=1),
        buf,
        TrainerConfig(items_per_micro=4, micro_per_step=2, lr=1e-2, warmup_steps=5),
    )
    for _ in range(60):
        tr.train_step()
    held = [
        HeldOut(torch.tensor(p + o.token_ids), len(p))
        for p, o in zip(
            _prompts(4, seed=2),
            collect.generate([Request(f"h{i}", p, greedy) for i, p in enumerate(_prompts(4, 2))])[
                ::2
            ],
            strict=True,
        )
    ]
    store.jobs.create(Job(job_id="job", model_path=str(target_dir)))
    dv = publish(
        store,
        "job",
        tr.drafter,
        held,
        policy_version=0,
        train_steps=tr.step,
        loss=tr.last_loss,
        out_dir=tmp_path / "drafters",
    )
    assert dv.status is DrafterStatus.PROMOTED

    # 3. A running engine (old, untrained drafter) swaps to the promoted one between steps.
    prompts = _prompts(4, seed=3)
    reqs = [Request(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    ref = {
        (o.request_id, o.sample_index): o.token_ids
        for o in Engine(str(target_dir), EngineConfig(spec_mode="off")).generate(reqs)
    }
    cfg = EngineConfig(max_batch=8, spec_mode="fixed", strategies=(Strategy("eagle", 3),))

    def run(swap_after: int | None):
        e = Engine(str(target_dir), cfg)
        e.set_drafter(EagleDrafter.random_init(e.model, seed=7), version=99)
        for r in reqs:
            e.add_request(r.request_id, r.prompt_ids, r.sampling)
        got, steps = [], 0
        while e.has_work():
            if steps == swap_after:
                active = store.drafters.get("job", store.drafters.active_version("job"))
                drafter = EagleDrafter.from_pretrained(active.path, e.model)
                e.set_drafter(drafter, active.version)
            got.extend(e.step())
            steps += 1
        assert swap_after is None or steps > swap_after, "the swap must happen mid-generation"
        return got

    old_only, swapped = run(None), run(3)
    for outs in (old_only, swapped):
        assert {(o.request_id, o.sample_index): o.token_ids for o in outs} == ref
    assert {o.drafter_version for o in swapped} == {dv.version}
    gain = sum(o.accepted_tokens for o in swapped) / sum(o.draft_steps for o in swapped)
    base = sum(o.accepted_tokens for o in old_only) / sum(o.draft_steps for o in old_only)
    assert gain > base, (gain, base)
