"""The demo's GRPO trainer without the daemon: advantages, the clipped loss, an update on real
engine rollouts (the trainer's recomputed logprobs equal the engine's), and checkpoints that
both transformers and the engine load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from examples.grpo_trainer import GRPOTrainer, Scored, clipped_pg_loss, group_advantages
from examples.task.tokenizer import VOCAB_SIZE, save_tokenizer
from tests.engine.helpers import make_checkpoint
from tltd.domain import SamplingParams
from tltd_workers.engine.engine import Engine, EngineConfig, Request


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def policy_dir(tmp_path) -> Path:
    path = make_checkpoint(tmp_path / "policy", vocab=VOCAB_SIZE, hidden=32, tie=False, seed=3)
    save_tokenizer(path)
    return path


def test_group_advantages_are_normalised_per_group():
    adv = group_advantages([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0], [0.0, 3.0]])
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    assert adv[0] == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    assert sum(adv[0]) == pytest.approx(0.0)
    assert adv[1] == [0.0, 0.0, 0.0]  # all equal: no signal, not 0/0
    assert adv[2] == [0.0]
    assert adv[3] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], rel=1e-5)


def test_clipped_loss_is_the_policy_gradient_at_ratio_one_and_clips_beyond():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[2.0], [-1.0]])
    loss, clipped = clipped_pg_loss(lp, lp.detach(), adv, mask, clip=0.2)
    # ratio 1: loss = -(mean over tokens of A) summed over samples = -(2) - (-1) = -1
    assert float(loss.detach()) == pytest.approx(-1.0)
    loss.backward()
    # d loss / d logp = -A / |o| on real tokens, 0 on padding
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert not clipped.any()
    # A positive-advantage token whose probability already rose 50% is clipped: no gradient.
    new = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, clipped = clipped_pg_loss(new, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert clipped.all() and float(new.grad) == 0.0


def test_token_level_loss_weighs_every_token_alike():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([[2.0], [-1.0]])
    loss, _ = clipped_pg_loss(lp, lp.detach(), adv, mask, clip=0.2, token_level=True)
    # Summed over tokens (the caller divides by the batch's tokens): -(2 + 2) - (-1) = -3
    assert float(loss.detach()) == pytest.approx(-3.0)
    loss.backward()
    # d loss / d logp = -A on every real token, whatever its sample's length
    torch.testing.assert_close(lp.grad, torch.tensor([[-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]]))


def _engine_rollouts(model_dir: Path) -> list[Scored]:
    engine = Engine(str(model_dir), EngineConfig(max_batch=8, max_seq_len=64, spec_mode="off"))
    prompts = [[1, 10, 11, 12], [1, 20, 21]]
    reqs = [
        Request("r", p, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=5),
                prompt_index=i)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    outs = sorted(engine.generate(reqs), key=lambda o: (o.prompt_index, o.sample_index))
    # A made-up reward (even first token) just to get a mix of advantages.
    rewards = [[float(o.token_ids[0] % 2 == 0) for o in outs if o.prompt_index == i]
               for i in range(len(prompts))]  # fmt: skip
    adv = group_advantages(rewards)
    return [
        Scored(prompts[o.prompt_index], o.token_ids, o.logprobs,
               rewards[o.prompt_index][o.sample_index], adv[o.prompt_index][o.sample_index])
        for o in outs
    ]  # fmt: skip


def test_update_on_engine_rollouts_and_a_loadable_checkpoint(policy_dir, tmp_path):
    batch = _engine_rollouts(policy_dir)
    trainer = GRPOTrainer(policy_dir, lr=1e-2, micro_batch_tokens=40)
    lp, mask = trainer.token_logprobs(batch)
    for row, s in enumerate(batch):
        # The trainer's recomputation equals what the engine returned (temperature 1).
        assert lp[row, : len(s.token_ids)].tolist() == pytest.approx(s.rollout_logprobs, abs=1e-4)
        assert mask[row].sum() == len(s.token_ids)
    assert trainer.logprob_gap(batch) < 1e-4
    wrong = [Scored(s.prompt_ids, s.token_ids, [x - 0.5 for x in s.rollout_logprobs], 0.0)
             for s in batch]  # fmt: skip
    assert trainer.logprob_gap(wrong) == pytest.approx(0.5, abs=1e-4)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.update(batch)
    used = [s for s in batch if s.advantage != 0]
    assert stats.samples_used == len(used) > 0
    assert stats.max_logprob_gap < 1e-4 and stats.clipped_fraction == 0.0
    assert stats.grad_norm > 0 and math.isfinite(stats.loss)
    assert stats.tokens == sum(len(s.token_ids) for s in used)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

    # The update moved probability towards positive-advantage samples.
    with torch.no_grad():
        after, _ = trainer.token_logprobs(used)
    for row, s in enumerate(used):
        gained = float(after[row, : len(s.token_ids)].sum()) - sum(s.rollout_logprobs)
        assert gained * s.advantage > 0, (s.advantage, gained)

    ckpt = trainer.save(tmp_path / "ckpt")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(ckpt))
    ids = torch.tensor([batch[0].prompt_ids + batch[0].token_ids])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        assert torch.allclose(reloaded(input_ids=ids).logits, expected, atol=1e-5)
    # The daemon's engine loads the same checkpoint: its greedy choice is the trained policy's.
    s = used[0]
    engine = Engine(str(ckpt), EngineConfig(max_batch=4, max_seq_len=64, spec_mode="off"))
    context = s.prompt_ids + s.token_ids[:1]
    out = engine.generate(
        [Request("g", context, SamplingParams(temperature=0.0, max_new_tokens=1))]
    )
    with torch.no_grad():
        greedy = int(trainer.model(input_ids=torch.tensor([context])).logits[0, -1].argmax())
    assert out[0].token_ids == [greedy]


def test_an_update_with_no_signal_changes_nothing(policy_dir):
    batch = [Scored([1, 5], [6, 7], [-1.0, -1.0], 1.0, 0.0)] * 3
    trainer = GRPOTrainer(policy_dir)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.update(batch)
    assert (stats.samples_used, stats.tokens, stats.grad_norm) == (0, 0, 0.0)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_the_kl_penalty_holds_the_policy_near_where_it_started(policy_dir):
    batch = _engine_rollouts(policy_dir)
    drift = {}
    for kl in (0.0, 5.0):
        trainer = GRPOTrainer(policy_dir, lr=1e-2, micro_batch_tokens=40, kl_coef=kl)
        for _ in range(3):  # the penalty is 0 at the first step: it pulls back on later ones
            trainer.update(batch)
        with torch.no_grad():
            now, mask = trainer.token_logprobs(batch)
            start, _ = trainer.token_logprobs(batch, GRPOTrainer(policy_dir).model)
        drift[kl] = float(((now - start).abs() * mask).sum())
    assert 0 < drift[5.0] < drift[0.0], drift
