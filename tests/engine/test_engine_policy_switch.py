"""A policy loaded while samples run: they continue on it from the next step, and say where.

The new policy differs from the old one only in the final norm, which shapes the logits and
nothing the KV cache holds: the old KV is then exactly what the new weights would compute, so
the tokens and logprobs after the switch can be checked against the new model token for token
(and those before against the old one)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import make_checkpoint, with_final_norm_changed
from tests.rollout.support import reference_logprobs
from tltd.domain import SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.engine import Engine, EngineConfig, Request

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    old = make_checkpoint(tmp_path_factory.mktemp("m") / "old", "qwen2", vocab=32, seed=1)
    return old, with_final_norm_changed(old, old.parent / "new", seed=5)


@pytest.mark.parametrize("mode", ["off", "fixed"])
def test_running_samples_switch_at_a_step_boundary(ckpts, mode):
    old, new = ckpts
    e = Engine(
        str(old),
        EngineConfig(
            max_batch=8, max_seq_len=96, spec_mode=mode, strategies=(Strategy("ngram", 4),)
        ),
    )
    e.add_request("a", PROMPT, GREEDY)
    outs = []
    while not e.running or len(e.running[0].tokens) < 10:
        outs += e.step()
    switched_at = len(e.running[0].tokens)
    e.load_policy(str(new), 1)
    e.add_request("b", PROMPT, GREEDY)  # waiting: runs on version 1 from its first token
    while e.has_work():
        outs += e.step()
    a, b = sorted(outs, key=lambda o: o.request_id)
    assert a.policy_version == 0 and a.policy_spans == ((0, 0), (switched_at, 1))
    assert b.policy_version == 1 and b.policy_spans == ()
    assert a.to_domain().policy_spans == ((0, 0), (switched_at, 1))

    k = switched_at
    old_lp, old_best = reference_logprobs(old, PROMPT, a.token_ids)
    new_lp, new_best = reference_logprobs(new, PROMPT, a.token_ids)
    got = torch.tensor(a.logprobs)
    torch.testing.assert_close(got[:k], old_lp[:k], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[k:], new_lp[k:], atol=1e-4, rtol=0)
    assert a.token_ids[:k] == old_best[:k].tolist()
    assert a.token_ids[k:] == new_best[k:].tolist()
    # The two policies disagree on these tokens: the check above tells them apart.
    assert not torch.allclose(old_lp[k:], new_lp[k:], atol=1e-2)
    (alone,) = Engine(str(new), EngineConfig(max_batch=8, max_seq_len=96)).generate(
        [Request("b", PROMPT, GREEDY)]
    )
    assert b.token_ids == alone.token_ids


def test_two_loads_without_a_token_between_keep_one_span(ckpts):
    old, new = ckpts
    e = Engine(str(old), EngineConfig(max_batch=8, max_seq_len=96, spec_mode="off"))
    e.add_request("a", PROMPT, GREEDY)
    e.step()  # prefill: one token
    e.load_policy(str(new), 1)
    e.load_policy(str(new), 2)
    e.step()
    e.load_policy(str(old), 3)
    outs = []
    while e.has_work():
        outs += e.step()
    (a,) = outs
    assert a.policy_spans == ((0, 0), (1, 2), (2, 3))
