"""A sample resumed from its stored tokens: the same tokens it would have had, drawn with the
same randomness, and on new weights the spans say which version sampled which token."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.engine.helpers import make_checkpoint, with_final_norm_changed
from tests.rollout.support import reference_logprobs
from tltd.domain import FinishReason, SamplingParams, SpeculativeStats
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.engine import Engine, EngineConfig

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 3, 9], [4, 4, 8, 1, 6]]
CUT = 13  # tokens emitted before the pause


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    old = make_checkpoint(tmp_path_factory.mktemp("m") / "old", "qwen2", vocab=32, seed=1)
    return old, with_final_norm_changed(old, old.parent / "new", seed=5)


def _engine(path, mode: str = "off", policy_version: int = 0) -> Engine:
    cfg = EngineConfig(
        max_batch=16, max_seq_len=128, spec_mode=mode, strategies=(Strategy("ngram", 4),)
    )
    e = Engine(str(path), cfg)
    if policy_version:
        e.load_policy(str(path), policy_version)
    return e


def _run(e: Engine, sampling: SamplingParams, n: int) -> dict:
    for p, prompt in enumerate(PROMPTS):
        e.add_request("r", prompt, replace(sampling, n=n), prompt_index=p)
    outs = []
    while e.has_work():
        outs += e.step()
    return {(o.prompt_index, o.sample_index): o for o in outs}


def _paused(o, cut: int = CUT):
    """The sample as stored when it was stopped after `cut` tokens (its counters as if each
    token after the first had come from a plain step)."""
    d = o.to_domain()
    return replace(
        d, token_ids=d.token_ids[:cut], logprobs=d.logprobs[:cut],
        finish_reason=FinishReason.ABORTED, partial=True,
        speculative=SpeculativeStats(plain_steps=cut - 1),
    )  # fmt: skip


def _resume(e: Engine, sampling: SamplingParams, stored: dict) -> dict:
    for (p, i), s in stored.items():
        e.add_request("r", PROMPTS[p], replace(sampling, n=1), prompt_index=p,
                      sample_offset=i, resume=s)  # fmt: skip
    outs = []
    while e.has_work():
        outs += e.step()
    return {(o.prompt_index, o.sample_index): o for o in outs}


@pytest.mark.parametrize(
    ("sampling", "mode"),
    [
        (SamplingParams(temperature=0.0, max_new_tokens=40), "off"),
        (SamplingParams(temperature=0.0, max_new_tokens=40), "fixed"),
        (SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, seed=11), "off"),
    ],
)
def test_a_resumed_sample_goes_on_as_if_never_stopped(ckpts, sampling, mode):
    old, _ = ckpts
    whole = _run(_engine(old, mode), sampling, n=3)
    resumed = _resume(_engine(old, mode), sampling, {k: _paused(o) for k, o in whole.items()})
    assert resumed.keys() == whole.keys()
    for k, o in whole.items():
        r = resumed[k]
        assert r.token_ids == o.token_ids, k  # same draws: key and position carried over
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(o.logprobs),
                                   atol=1e-4, rtol=0)  # fmt: skip
        assert r.finish_reason == o.finish_reason and r.policy_spans == ()
        # The resume's prefill drew one token as a plain step: the count still adds up.
        st = r.to_domain().speculative
        steps = st.plain_steps + st.accepted_tokens + st.residual_tokens + st.bonus_tokens
        assert 1 + steps == len(r.token_ids)


def test_a_sample_resumed_on_new_weights_says_which_version_sampled_which_token(ckpts):
    old, new = ckpts
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    whole = _run(_engine(old), greedy, n=1)
    stored = {k: _paused(o) for k, o in whole.items()}
    resumed = _resume(_engine(new, policy_version=1), greedy, stored)
    for (p, _), r in resumed.items():
        assert r.policy_version == 0 and r.policy_spans == ((0, 0), (CUT, 1))
        assert r.token_ids[:CUT] == whole[(p, 0)].token_ids[:CUT]
        # The tokens after the pause are the new weights' own, on the whole context.
        new_lp, new_best = reference_logprobs(new, PROMPTS[p], r.token_ids)
        assert r.token_ids[CUT:] == new_best[CUT:].tolist()
        torch.testing.assert_close(torch.tensor(r.logprobs[CUT:]), new_lp[CUT:],
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_a_finished_or_malformed_sample_is_not_resumed(ckpts):
    old, _ = ckpts
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    o = _run(_engine(old), greedy, n=1)[(0, 0)]
    e = _engine(old)
    for bad, why in [
        (o.to_domain(), "unfinished"),  # all 40 tokens: it ended at max_new_tokens
        (replace(_paused(o), logprobs=()), "one logprob per token"),
    ]:
        with pytest.raises(ValueError, match=why):
            e.add_request("r", PROMPTS[0], greedy, resume=bad)
