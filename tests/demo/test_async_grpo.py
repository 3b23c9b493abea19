"""The asynchronous run's pieces with known answers: the decoupled loss's truncated weights and
each token's staleness from the sample's policy spans."""

from __future__ import annotations

import math

import torch

from examples.async_grpo import decoupled_pg_loss, token_staleness
from tltd_clients import RolloutSample


def test_decoupled_loss_weighs_each_token_by_its_truncated_importance_weight():
    lp = torch.log(torch.tensor([[0.3, 0.6]])).requires_grad_()
    # The behaviour policy gave the tokens 0.2 (weight 1.5) and 0.2 (weight 3, truncated at 2).
    behaviour = torch.log(torch.tensor([[0.2, 0.2]]))
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    loss, clipped = decoupled_pg_loss(cap=2.0)(lp, behaviour, adv, mask, 0.2, token_level=True)
    assert math.isclose(float(loss), -(1.5 + 2.0), rel_tol=1e-6)  # the ratio is 1 at the start
    loss.backward()
    # d loss / d log p = -w * A per token: the correction scales the policy gradient.
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.5, -2.0]]))
    assert not clipped.any()


def test_token_staleness_follows_the_policy_spans():
    def sample(tokens: int, version: int, spans: list[tuple[int, int]]) -> RolloutSample:
        return RolloutSample("r", 0, 0, [1] * tokens, [0.0] * tokens, "stop", version, 0,
                             policy_spans=spans)  # fmt: skip

    # One sample from version 3 alone, one switched from 2 to 4 at its third token.
    got = token_staleness([sample(2, 3, []), sample(5, 2, [(0, 2), (3, 4)])], version=4)
    assert got == [1, 1, 2, 2, 2, 0, 0]
