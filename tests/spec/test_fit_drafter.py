"""Tests for the offline EAGLE drafter fitting script (tiny random target, real engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from examples.task.tokenizer import VOCAB_SIZE, save_tokenizer
from examples.task.workload import rollout_prompts
from scripts.fit_drafter import collate, eagle_loss, main, rollout, train
from tests.engine.helpers import make_checkpoint
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import load_model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-target")
    make_checkpoint(path, vocab=VOCAB_SIZE, hidden=64, layers=2, tie=False, logit_scale=3.0)
    save_tokenizer(path)
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_collate_aligns_inputs_targets_and_the_response_mask(target_dir: Path) -> None:
    model = load_model(target_dir)
    prompts = [p for _, p in rollout_prompts(2, 5, target_dir)]
    examples = rollout(model, prompts, 2, max_new_tokens=12, temperature=0.0, seed=0)
    hidden, next_tok, target, mask = collate(examples)
    for i, e in enumerate(examples):
        n = len(e.hidden) - 1
        assert torch.equal(hidden[i, :n], e.hidden[:-1]) and torch.equal(
            target[i, :n], e.hidden[1:]
        )
        assert next_tok[i, :n].tolist() == e.tokens[1 : n + 1].tolist()
        # Greedy rollout: the target state at t + 1 predicts token t + 2 by argmax, i.e. the
        # CE label of drafter position t is the token after its input token.
        greedy = model.logits(target[i, :n]).argmax(-1)
        resp = mask[i, :n]
        assert resp.sum() == len(e.tokens) - e.prompt_len
        assert greedy[resp].tolist() == e.tokens[e.prompt_len :].tolist()
        assert not mask[i, n:].any()


def test_training_lowers_the_eagle_loss(target_dir: Path) -> None:
    model = load_model(target_dir)
    prompts = [p for _, p in rollout_prompts(4, 1, target_dir)]
    examples = rollout(model, prompts, 2, max_new_tokens=24, temperature=1.0, seed=0)
    drafter = EagleDrafter.random_init(model, seed=0)
    batch = collate(examples)
    before, _ = eagle_loss(drafter, *batch)
    train(drafter, examples, steps=40, batch_size=8, lr=3e-3, noise=0.0, seed=0)
    with torch.no_grad():
        after, m = eagle_loss(drafter, *batch)
    assert after.item() < 0.8 * before.item()
    # The target's embeddings / lm_head are not the drafter's parameters and stay frozen.
    names = {n for n, _ in drafter.named_parameters()}
    assert names and not any("embed" in n or "lm_head" in n for n in names)


def test_main_saves_a_loadable_drafter(target_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "eagle"
    args = ["--model", str(target_dir), "--out", str(out), "--prompts", "2", "--samples", "2"]
    args += ["--max-new-tokens", "16", "--steps", "3", "--eval-prompts", "1", "--threads", "1"]
    assert main(args) == 0
    assert {"config.json", "model.safetensors", "fit.json"} <= {p.name for p in out.iterdir()}
    model = load_model(target_dir)
    drafter = EagleDrafter.from_pretrained(out, model)
    assert sum(p.numel() for p in drafter.parameters()) > 0
