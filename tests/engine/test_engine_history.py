"""The history drafter in the engine: lossless greedy output across epochs and whatever the
history holds, drafts long where a prompt's earlier answers repeat, named in provenance."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.engine.helpers import make_checkpoint
from tltd.domain import SamplingParams, TokenSource
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.costs import BucketCost, CostModel
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig, Request

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8], [9, 10, 11, 12, 9, 10], [3, 14, 15, 9, 2, 6]]
GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, return_provenance=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("m") / "m", "qwen2", vocab=32, seed=3, logit_scale=2.0
    )


def _engine(ckpt, mode="fixed", k=16, eagle_k=0) -> Engine:
    strategies = (Strategy("history", k),) + ((Strategy("eagle", eagle_k),) if eagle_k else ())
    cfg = EngineConfig(max_batch=16, max_seq_len=64, spec_mode=mode, strategies=strategies)
    e = Engine(str(ckpt), cfg)
    if eagle_k:
        e.set_drafter(EagleDrafter.random_init(e.model, seed=1), version=1)
    return e


def _epoch(e: Engine, tag: str, sampling=GREEDY, history=None):
    for i, p in enumerate(PROMPTS):
        e.add_request(f"{tag}{i}", p, sampling, prompt_index=i, history=(history or {}).get(i, ()))
    outs = []
    while e.has_work():
        outs.extend(e.step())
    return {(o.prompt_index, o.sample_index): o for o in outs}


def test_greedy_is_token_identical_over_epochs_and_the_second_drafts_from_the_first(ckpt):
    ref = _epoch(_engine(ckpt, "off"), "a")
    e = _engine(ckpt)
    first = _epoch(e, "a")
    e.stats.reset()
    second = _epoch(e, "b")
    for key, o in ref.items():
        assert first[key].token_ids == second[key].token_ids == o.token_ids, key
        torch.testing.assert_close(second[key].logprobs, o.logprobs, atol=1e-4, rtol=0)
    s = e.stats.summary()
    # Epoch 2 repeats epoch 1's greedy answers: every history draft is kept, up to k at once.
    assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] > 8, s
    prov = [p for o in second.values() for p in o.provenance[1:]]
    assert {p.drafter for p in prov if p.source is not TokenSource.PLAIN} == {"history"}
    assert sum(p.source is TokenSource.ACCEPTED for p in prov) == s["tokens"]["accepted"]


def test_greedy_history_steps_draft_short_walks_with_eagle_and_stay_token_identical(ckpt):
    """Where a row's history walk is shorter than HISTORY_MIN_DRAFT, the same verify pass
    drafts it with EAGLE: both drafters appear in provenance, the output stays the target's."""
    ref = _epoch(_engine(ckpt, "off"), "a")
    e = _engine(ckpt, k=8, eagle_k=4)
    junk = {i: [((f"x{i}", 0), [5, 6] * 20)] for i in range(len(PROMPTS))}
    first = _epoch(e, "a", history=junk)  # the history is ready at once but matches little
    second = _epoch(e, "b")
    drafters = set()
    for key, o in ref.items():
        assert first[key].token_ids == second[key].token_ids == o.token_ids, key
        torch.testing.assert_close(second[key].logprobs, o.logprobs, atol=1e-4, rtol=0)
        for got in (first[key], second[key]):
            drafters |= {p.drafter for p in got.provenance if p.source is not TokenSource.PLAIN}
    assert drafters == {"history", "eagle"}


@pytest.mark.parametrize("draft_ms", [1e-6, 1e6], ids=["cheap-eagle", "ruinous-eagle"])
def test_a_history_step_drafts_its_other_rows_with_eagle_only_where_that_pays(ckpt, draft_ms):
    """Under the measured gate, a history step's short-walk rows take EAGLE drafts only when
    the bucket's costs say they pay (costs.fallback_pays): with EAGLE drafting nearly free
    they do, with it ruinous none does (EAGLE rows come from EAGLE's own arm alone). The
    output is the target's either way."""
    ref = _epoch(_engine(ckpt, "off"), "a")
    strategies = (Strategy("history", 8), Strategy("eagle", 4))
    costs = CostModel({b: BucketCost(10.0, {5: 10.0}, draft_ms) for b in (1, 2, 4, 8, 16)}, 64)
    cfg = EngineConfig(max_batch=16, max_seq_len=64, spec_mode="adaptive", strategies=strategies)
    e = Engine(str(ckpt), cfg, costs=costs)
    e.set_drafter(EagleDrafter.random_init(e.model, seed=1), version=1)
    junk = {i: [((f"x{i}", 0), [5, 6] * 20)] for i in range(len(PROMPTS))}
    got = _epoch(e, "a", history=junk)  # the history is ready at once but matches little
    for key, o in ref.items():
        assert got[key].token_ids == o.token_ids, key
    s = e.stats.summary()
    eagle_rows = s["per_drafter"].get("eagle", {}).get("draft_rows", 0)
    eagle_arm_rows = s["per_strategy"].get("eagle/k4", {}).get("draft_rows", 0)
    assert s["per_strategy"]["history/k8"]["steps"] > 0, s  # history steps ran
    if draft_ms < 1:
        assert eagle_rows > eagle_arm_rows, s  # history steps drafted rows with EAGLE
    else:
        assert eagle_rows == eagle_arm_rows, s  # none did


def test_answers_handed_in_at_admission_draft_a_fresh_engine(ckpt):
    """A restarted worker's engine is given the prompt's stored answers with the request."""
    ref = _epoch(_engine(ckpt, "off"), "a")
    stored = {i: [((f"a{i}", j), list(ref[(i, j)].token_ids)) for j in range(2)] for i in range(4)}
    e = _engine(ckpt)
    got = _epoch(e, "b", history=stored)
    assert all(got[key].token_ids == o.token_ids for key, o in ref.items())
    s = e.stats.summary()
    assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] > 8, s


def test_greedy_is_token_identical_whatever_the_history_holds(ckpt):
    ref = _epoch(_engine(ckpt, "off"), "a")
    g = torch.Generator().manual_seed(0)
    junk = {
        i: [((f"x{i}", j), torch.randint(0, 32, (40,), generator=g).tolist()) for j in range(3)]
        + [((f"y{i}", 0), list(p) * 5)]
        for i, p in enumerate(PROMPTS)
    }
    e = _engine(ckpt, k=8)
    got = _epoch(e, "b", history=junk)
    assert all(got[key].token_ids == o.token_ids for key, o in ref.items())
    s = e.stats.summary()
    assert s["drafted_tokens"] > 0 and s["acceptance_rate"] < 1.0  # wrong drafts were made


def test_sampled_seeded_history_drafts_keep_the_targets_logprobs(ckpt):
    """Sampled rows drafted from history: each token's logprob is the target's at it."""
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=5)
    e = _engine(ckpt, k=8)
    _epoch(e, "a", sp)
    outs = _epoch(e, "b", sp)
    assert e.stats.summary()["tokens"]["accepted"] > 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    for (i, _), o in list(outs.items())[:4]:
        ids = torch.tensor([PROMPTS[i] + list(o.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0, len(PROMPTS[i]) - 1 : -1], -1)
        want = logp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-4, rtol=0)


def test_auto_jobs_get_history_arms_and_requests_are_checked(ckpt):
    e = Engine(str(ckpt), EngineConfig(max_batch=8, max_seq_len=64, cost_budget_s=0))
    assert e.history is not None
    assert {s.drafter for s in e.config.strategies} == {"ngram", "eagle", "history"}
    out = e.generate([Request("r", PROMPTS[0], SamplingParams(n=2, max_new_tokens=8, seed=1))])
    assert len(out) == 2 and e.history.answers(tuple(PROMPTS[0])) == 2
    off = Engine(str(ckpt), EngineConfig(max_batch=8, max_seq_len=64, spec_mode="off"))
    assert off.history is None


def test_load_predicts_what_is_left_from_the_prompts_answers(ckpt):
    e = _engine(ckpt)
    first = _epoch(e, "a")
    lengths = [len(first[(0, j)].token_ids) for j in range(2)]
    longer = replace(GREEDY, max_new_tokens=60)  # answers so far are <= 40 tokens
    e.add_request("again", PROMPTS[0], longer)
    e.add_request("new", [30, 31, 30], longer)
    want = 2 * round(sum(lengths) / 2) + 2 * 60
    assert e.load().remaining_tokens == want and e.load().samples == 4
    e.step()  # both prefilled: one token each emitted
    assert e.load().remaining_tokens == want - 4
