"""The agentic demo (examples/agent_demo.py) through a real `tltd serve`: the shipped policy
calls the calculator in real multi-turn sessions, and the trajectories the daemon returns hold
the environment's tokens masked out, the sampled ones in, with behaviour logprobs the trainer
reproduces and versions that follow the pushes."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.agent_demo import QUICK, Episode, sampled_versions, summary, to_scored, train
from examples.grpo_demo import MODEL, Daemon
from examples.grpo_trainer import GRPOTrainer
from examples.task import decode, load_tokenizer
from examples.task.calculator import calculator


def test_the_calculator_adds_the_line_it_is_called_on_in_the_task_digit_order():
    assert calculator("care 7\n7100+8300=") == "5500"  # 17 + 38 = 55, digits reversed
    assert calculator("0017+0038=", style="sum") == "0055"
    assert calculator("9999+9999=", style="sum") == "9998"  # four digits, as the lines keep
    assert calculator("answer:") == "" and calculator("12+3=") == ""  # no operands: nothing


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    work = tmp_path_factory.mktemp("agent-demo")
    daemon = Daemon(work, QUICK.cpu_slots)
    try:
        yield train(QUICK, daemon, MODEL, work)
    finally:
        assert daemon.stop() == 0


def _check_trajectory(ep: Episode, tok) -> int:
    """The daemon's trajectory is the prompt, then per turn the environment's tokens (mask 0,
    logprob 0, version -1) and the policy's (mask 1); each environment input is the
    calculator's answer to the text before it. Returns the environment tokens seen."""
    p = ep.prompt_length
    assert ep.loss_mask[:p] == [0] * p and ep.versions[:p] == [-1] * p
    pos, env = p, 0
    for inputs, sampled in zip(ep.inputs, ep.outputs, strict=True):
        assert ep.token_ids[pos : pos + len(inputs)] == inputs
        if inputs:
            assert decode(tok, inputs) == calculator(decode(tok, ep.token_ids[p:pos]))
        assert ep.loss_mask[pos : pos + len(inputs)] == [0] * len(inputs)
        assert ep.logprobs[pos : pos + len(inputs)] == [0.0] * len(inputs)
        assert ep.versions[pos : pos + len(inputs)] == [-1] * len(inputs)
        env += len(inputs)
        pos += len(inputs)
        assert ep.loss_mask[pos : pos + sampled] == [1] * sampled
        pos += sampled
    assert pos == len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs) == len(ep.versions)
    assert ep.sampled() + ep.environment() == len(ep.token_ids) - p
    versions = [v for v, m in zip(ep.versions, ep.loss_mask, strict=True) if m]
    assert versions == sorted(versions)  # non-decreasing per token
    return env


def test_sessions_mask_the_calculator_tokens_and_train_on_the_sampled_ones(outcome):
    run, tok = outcome.run, load_tokenizer(MODEL)
    assert len(run.episodes) == QUICK.steps
    env = sum(_check_trajectory(ep, tok) for step in run.episodes for ep in step)
    calls = sum(ep.calls for step in run.episodes for ep in step)
    assert calls > 0 and env == 4 * calls  # the tool was called, 4 digits each time
    assert all(ep.turns == ep.calls + 1 or ep.sampled() >= QUICK.max_new_tokens
               for step in run.episodes for ep in step)  # fmt: skip
    # Step 0 ran on the initial version; step 1 on the one its update pushed.
    (low0, high0), (low1, high1) = (sampled_versions(step) for step in run.episodes)
    assert low0 == high0 and low1 == high1 == high0 + 1


def test_the_trainer_reproduces_the_behaviour_logprobs_on_sampled_tokens_only(outcome):
    # The initial weights sampled step 0: on its sampled tokens the trainer's logprobs are the
    # daemon's, and the loss covers those tokens and no others.
    scored = to_scored(outcome.run.episodes[0])
    trainer = GRPOTrainer(MODEL)
    assert trainer.logprob_gap(scored) < 1e-3
    for s in scored:
        _, mask = trainer.token_logprobs([s])
        assert mask[0].tolist() == s.loss_mask
    assert all(row.logprob_gap < 1e-3 for row in outcome.rows)
    line = summary(outcome)
    assert "held-out reward" in line and "environment tokens masked out" in line
    assert (
        len(outcome.before.rewards)
        == len(outcome.after.rewards)
        == (QUICK.held_out_prompts * QUICK.held_out_n)
    )
    assert Path(MODEL).exists()
