"""Per-row SD counters and per-token provenance on a real engine (tiny random model, CPU)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from tests.engine.helpers import make_checkpoint
from tests.torch_device import torch_device
from tltd.domain import SamplingParams, TokenProvenance, TokenSource
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.datatypes import SampleOutput
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig

# Repeated spans give the n-gram drafter matches at some positions and none at others.
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8, 7, 7], [9, 10, 11, 12, 9, 10], [20, 21]]
STOP = 5  # a stop token some samples draw, so that some draft steps end at a stop
K = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Peaked distributions (logit_scale): drafts are often accepted, sometimes not.
    return make_checkpoint(
        tmp_path_factory.mktemp("m") / "m", "llama", vocab=32, seed=2, logit_scale=2.0, tie=False
    )


def _engine(ckpt, drafter: str | None) -> Engine:
    """SD on every decode pass ("fixed", batch always under the threshold), or off (None)."""
    cfg = EngineConfig(
        max_batch=16,
        spec_mode="off" if drafter is None else "fixed",
        strategies=(Strategy(drafter or "ngram", K),),
        device=torch_device(),
    )
    e = Engine(str(ckpt), cfg)
    if drafter == "eagle":
        e.set_drafter(EagleDrafter.random_init(e.model, seed=1), version=3)
    if drafter == "history":  # an earlier epoch of the prompts, for the history to draft from
        sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=30, seed=99)
        for i, p in enumerate(PROMPTS):
            e.add_request(f"earlier{i}", p, sp, prompt_index=i)
        while e.has_work():
            e.step()
        e.stats.reset()
    return e


def _run(
    e: Engine, temperature: float, provenance: bool, plain_request: bool = False
) -> dict[tuple[str, int, int], SampleOutput]:
    sp = SamplingParams(
        n=3,
        temperature=temperature,
        max_new_tokens=30,
        stop_token_ids=(STOP,),
        seed=11,
        return_provenance=provenance,
    )
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, sp, prompt_index=i)
    if plain_request:  # a speculative=False request sharing the verify passes
        e.add_request("plain", PROMPTS[0], sp, speculative=False)
    outs = {}
    while e.has_work():
        outs.update({(o.request_id, o.prompt_index, o.sample_index): o for o in e.step()})
    return outs


@dataclass
class Step:
    """One draft step read back from provenance."""

    drafter: str
    draft_length: int
    accepted: int
    end: TokenSource | None  # RESIDUAL / BONUS, or None: cut by a stop token


def _steps(prov: list[TokenProvenance]) -> tuple[int, list[Step]]:
    """(plain tokens, draft steps) of one sample; checks each step is well formed."""
    plain, steps, cur = 0, [], None
    for p in prov:
        if p.source is TokenSource.PLAIN:
            assert cur is None and (p.drafter, p.draft_length) == ("", 0)
            plain += 1
            continue
        if cur is None:
            cur = Step(p.drafter, p.draft_length, 0, None)
        assert (p.drafter, p.draft_length) == (cur.drafter, cur.draft_length)
        if p.source is TokenSource.ACCEPTED:
            cur.accepted += 1
            assert cur.accepted <= cur.draft_length
        else:
            # The target's own draw: a bonus after a full chain, a residual after a rejection.
            full = cur.accepted == cur.draft_length
            assert p.source is (TokenSource.BONUS if full else TokenSource.RESIDUAL)
            cur.end = p.source
            steps.append(cur)
            cur = None
    if cur is not None:  # ended inside a chain: only a stop token does that
        steps.append(cur)
    return plain, steps


# Greedy rows take the greedy branch of the accept rule. EAGLE runs sampled only: the random
# drafter's greedy chains are almost never accepted in full, so they would give no bonus token.
@pytest.mark.parametrize(
    ("drafter", "temperature"),
    [("ngram", 0.0), ("ngram", 1.0), ("eagle", 1.0), ("history", 1.0)],
)
def test_provenance_counts_equal_the_engine_totals(ckpt, drafter, temperature):
    e = _engine(ckpt, drafter)
    outs = _run(e, temperature, provenance=True, plain_request=drafter == "eagle")
    s = e.stats.summary()
    sources: Counter[TokenSource] = Counter()
    hist: Counter[int] = Counter()
    for o in outs.values():
        assert o.provenance is not None and len(o.provenance) == len(o.token_ids)
        # The first token always comes from the prefill, never from a speculative step.
        assert o.provenance[0].source is TokenSource.PLAIN
        plain, steps = _steps(o.provenance)
        sources.update(p.source for p in o.provenance)
        hist.update(st.accepted + 1 for st in steps)
        # The sample's own counters say the same as its provenance.
        assert plain == 1 + o.plain_steps
        assert len(steps) == o.draft_steps
        assert sum(st.draft_length for st in steps) == o.drafted_tokens
        assert sum(st.accepted for st in steps) == o.accepted_tokens
        assert sum(st.end is TokenSource.BONUS for st in steps) == o.bonus_tokens
        assert sum(st.end is TokenSource.RESIDUAL for st in steps) == o.residual_tokens
        assert {st.drafter for st in steps} <= {drafter}
        assert o.drafter_version == (3 if drafter == "eagle" and steps else 0)
        if steps and steps[-1].end is None:  # a chain cut short: by an accepted stop token
            assert o.token_ids[-1] == STOP
        if o.request_id == "plain":  # speculative=False: plain inside every verify pass
            assert plain == len(o.token_ids) and not steps
    tokens = s["tokens"]
    assert sources[TokenSource.PLAIN] == tokens["first"] + tokens["plain"]
    assert sources[TokenSource.ACCEPTED] == tokens["accepted"]
    assert sources[TokenSource.RESIDUAL] == tokens["residual"]
    assert sources[TokenSource.BONUS] == tokens["bonus"]
    assert sum(sources.values()) == tokens["total"] == sum(len(o.token_ids) for o in outs.values())
    assert tokens["first"] == len(outs)
    assert s["accepted_length_hist"] == dict(sorted(hist.items()))
    assert s["drafted_tokens"] == sum(o.drafted_tokens for o in outs.values())
    assert s["row_steps"]["draft"] == sum(o.draft_steps for o in outs.values())
    assert s["row_steps"]["plain"] == sum(o.plain_steps for o in outs.values())
    # The workload exercises every source (else the equalities above prove little).
    assert min(sources[src] for src in TokenSource) > 0, sources
    assert s["row_steps"]["plain"] > 0


def test_share_counts_rows_without_a_draft_as_plain(ckpt):
    """Every decode pass is a verify pass, but rows the n-gram drafter had nothing for
    decoded plainly in them: the SD share counts only the rows that verified drafts."""
    e = _engine(ckpt, "ngram")
    outs = _run(e, 1.0, provenance=False)
    s = e.stats.summary()
    assert s["steps"]["plain"] == 0 and s["verify_pass_share"] == 1.0
    draft = sum(o.draft_steps for o in outs.values())
    plain = sum(o.plain_steps for o in outs.values())
    assert plain > 0
    assert s["sd_step_share"] == pytest.approx(draft / (draft + plain)) and s["sd_step_share"] < 1


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "history"])
def test_provenance_changes_no_token_and_no_logprob(ckpt, drafter):
    """Greedy: the same tokens with provenance on, off, and without SD at all. Sampled: the
    same draws with provenance on and off (its bookkeeping takes no randomness)."""
    off = _run(_engine(ckpt, None), 0.0, provenance=False)
    greedy_on = _run(_engine(ckpt, drafter), 0.0, provenance=True)
    greedy_no = _run(_engine(ckpt, drafter), 0.0, provenance=False)
    assert greedy_on.keys() == off.keys()
    for key, o in greedy_on.items():
        assert o.token_ids == off[key].token_ids == greedy_no[key].token_ids
        assert o.logprobs == greedy_no[key].logprobs
        assert o.logprobs == pytest.approx(off[key].logprobs, abs=1e-5)
        assert greedy_no[key].provenance is None
    sampled_on = _run(_engine(ckpt, drafter), 1.0, provenance=True)
    sampled_no = _run(_engine(ckpt, drafter), 1.0, provenance=False)
    for key, o in sampled_on.items():
        assert (o.token_ids, o.logprobs) == (sampled_no[key].token_ids, sampled_no[key].logprobs)


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_per_position_acceptance_matches_the_reported_accepted_length(ckpt, drafter):
    e = _engine(ckpt, drafter)
    outs = _run(e, 1.0, provenance=True)
    reached: Counter[int] = Counter()  # draft position j was verified with all before it kept
    accepted: Counter[int] = Counter()
    n_steps = 0
    for o in outs.values():
        _, steps = _steps(o.provenance)
        if steps:
            per_sample = 1 + sum(st.accepted for st in steps) / len(steps)
            assert o.mean_accepted_length == pytest.approx(per_sample)
        for st in steps:
            n_steps += 1
            for j in range(st.draft_length):
                reached[j] += 1
                if j >= st.accepted:
                    break
                accepted[j] += 1
    rate = {j: accepted[j] / reached[j] for j in reached}
    assert all(0.0 <= r <= 1.0 for r in rate.values()) and 0 < rate[0] < 1, rate
    implied = 1 + sum(reached[j] * rate[j] for j in rate) / n_steps
    s = e.stats.summary()
    assert implied == pytest.approx(s["mean_accepted_length"])
    hist = s["accepted_length_hist"]
    assert implied == pytest.approx(sum(k * v for k, v in hist.items()) / sum(hist.values()))
