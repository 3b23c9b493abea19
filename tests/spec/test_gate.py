"""The gate's memory: acceptance estimates, the reset rule on new versions, verdicts."""

from __future__ import annotations

import pytest

from tltd_workers.engine.bandit import PLAIN, BucketedEpsilonGreedy, Strategy
from tltd_workers.engine.gate import (
    CHECK_POSITIONS,
    DEFAULT_ACCEPTANCE,
    MAX_DROP,
    PRIOR_POSITIONS,
    Acceptance,
    GateState,
    verdicts,
)

NG4, EA4 = Strategy("ngram", 4), Strategy("eagle", 4)


def _state() -> GateState:
    return GateState(BucketedEpsilonGreedy([NG4, EA4], (1, 8), plain_arm=True))


def _steps(state: GateState, drafter: str, alpha_num: int, steps: int) -> None:
    """`steps` SD steps of one row drafting 4: `alpha_num` accepted (rejected when < 4)."""
    for _ in range(steps):
        state.observe(drafter, [4], [alpha_num])


def test_acceptance_is_accepted_over_tried_positions_with_a_prior():
    a = Acceptance()
    assert a.alpha == DEFAULT_ACCEPTANCE and a.coverage == 1.0
    a.observe([4, 4, 0], [4, 1, 0])  # all kept; 1 kept then a rejection; nothing drafted
    assert (a.accepted, a.rejected, a.rows, a.drafting_rows) == (5, 1, 3, 2)
    assert a.alpha == pytest.approx((5 + DEFAULT_ACCEPTANCE * PRIOR_POSITIONS) / (6 + 16))
    assert a.coverage == pytest.approx((2 + 4) / (3 + 4))
    for _ in range(2000):
        a.observe([4], [1])  # one kept, then rejected: alpha -> 1/2
    assert a.alpha == pytest.approx(0.5, abs=0.01)
    assert a.tokens_per_step(4) == pytest.approx((1 - 0.5**5) / 0.5, abs=0.05)


def test_the_first_versions_seen_change_nothing():
    s = _state()
    _steps(s, "ngram", 3, 10)
    before = s.acceptance["ngram"].alpha
    s.sync(policy_version=3, drafter_version=0)
    s.sync(policy_version=3, drafter_version=0)
    assert s.acceptance["ngram"].alpha == before and s.acceptance["ngram"].baseline is None


def test_a_new_drafter_version_demotes_eagle_state_and_keeps_ngram():
    s = _state()
    s.sync(1, 1)
    _steps(s, "eagle", 4, 50)  # drafter version 1 accepts everything
    _steps(s, "ngram", 1, 50)
    s.bandit.record(1, EA4, 5.0, 1.0)
    s.bandit.record(1, NG4, 2.0, 1.0)
    eagle_alpha, ngram = s.acceptance["eagle"].alpha, s.acceptance["ngram"].alpha
    s.sync(1, 0)  # drafter unloaded: no change
    s.sync(1, 1)  # the same version again: no change
    assert s.acceptance["eagle"].alpha == eagle_alpha
    assert s.bandit.snapshot()[1]["eagle/k4"]["median_reward"] == 5.0
    s.sync(1, 2)
    e = s.acceptance["eagle"]
    assert e.prior == pytest.approx(eagle_alpha) and e.alpha == pytest.approx(eagle_alpha)
    assert e.accepted == e.rejected == 0  # the old version's evidence is now only a prior
    snap = s.bandit.snapshot()[1]
    assert snap["eagle/k4"]["median_reward"] is None  # measured with another drafter
    assert snap["ngram/k4"]["median_reward"] == 2.0
    assert s.acceptance["ngram"].alpha == ngram
    # The new version's own observations outweigh the prior within a few steps.
    _steps(s, "eagle", 0, 30)
    assert s.acceptance["eagle"].alpha < 0.4


def test_the_first_prompt_with_earlier_answers_restarts_the_history_state_once():
    hi = Strategy("history", 8)
    s = GateState(BucketedEpsilonGreedy([NG4, hi], (1, 8), plain_arm=True))
    s.observe("history", [8, 8], [1, 0])  # first epoch: siblings only, drafts mostly wrong
    s.bandit.record(1, hi, 1.5, 1.0)
    s.bandit.record(1, NG4, 2.0, 1.0)
    assert s.untried({"history"}) is None
    s.history_arrived()
    assert s.untried({"history"}) == "history"  # measured afresh, now with a history
    assert s.acceptance["history"].alpha == DEFAULT_ACCEPTANCE
    snap = s.bandit.snapshot()[1]
    assert snap["history/k8"]["median_reward"] is None and snap["ngram/k4"]["median_reward"] == 2.0
    s.observe("history", [8], [8])
    s.bandit.record(1, hi, 9.0, 1.0)
    s.history_arrived()  # later epochs keep what the history arm measured
    assert s.bandit.snapshot()[1]["history/k8"]["median_reward"] == 9.0


def test_a_new_policy_keeps_state_unless_acceptance_falls_by_more_than_max_drop():
    s = _state()
    s.sync(1, 0)
    _steps(s, "ngram", 3, 40)  # 3 of 4 kept: alpha ~ 0.75
    s.bandit.record(1, NG4, 4.0, 1.0)
    s.sync(2, 0)
    before = s.acceptance["ngram"].alpha
    _steps(s, "ngram", 2, CHECK_POSITIONS)  # 2 of 3 tried kept: 0.67 > (1 - 0.25) x 0.75
    assert 2 / 3 > (1 - MAX_DROP) * before
    assert s.acceptance["ngram"].baseline is None  # checked, and kept
    assert s.acceptance["ngram"].accepted == 40 * 3 + CHECK_POSITIONS * 2
    assert s.bandit.snapshot()[1]["ngram/k4"]["median_reward"] == 4.0

    s.sync(3, 0)
    before = s.acceptance["ngram"].alpha
    _steps(s, "ngram", 0, CHECK_POSITIONS)  # nothing kept any more: dropped
    a = s.acceptance["ngram"]
    assert a.baseline is None and (a.accepted, a.rejected) == (0, CHECK_POSITIONS)
    assert a.alpha < (1 - MAX_DROP) * before
    assert s.bandit.snapshot()[1]["ngram/k4"]["median_reward"] is None


def test_a_policy_check_waits_for_enough_positions():
    s = _state()
    s.sync(1, 0)
    _steps(s, "ngram", 3, 40)
    s.sync(2, 0)
    _steps(s, "ngram", 0, CHECK_POSITIONS - 1)
    assert s.acceptance["ngram"].baseline is not None  # not decided yet
    assert s.acceptance["ngram"].accepted == 120


def test_a_drafter_is_untried_until_it_ran_since_it_was_set():
    s = _state()
    assert s.untried({"ngram", "eagle"}) == "eagle" and s.untried({"ngram"}) == "ngram"
    _steps(s, "eagle", 2, 1)
    _steps(s, "ngram", 0, 1)  # one step, good or bad, is a measurement
    assert s.untried({"ngram", "eagle"}) is None
    s.sync(0, 5)  # a new drafter version
    assert s.untried({"ngram", "eagle"}) == "eagle"


def test_fits_and_tokens_per_step():
    s = _state()
    assert s.fits([NG4, EA4], (1, 8), plain_arm=True)
    assert not s.fits([NG4], (1, 8), plain_arm=True)
    assert not s.fits([NG4, EA4], (1, 8, 16), plain_arm=True)
    assert not s.fits([NG4, EA4], (1, 8), plain_arm=False)
    tokens = s.tokens_per_step()
    assert tokens[NG4] == pytest.approx((1 - 0.5**5) / 0.5)
    assert s.snapshot()["eagle"]["tokens_per_step"] == {4: tokens[EA4]}


def test_verdicts_compare_predicted_and_measured_gain():
    def arm(pred, med, est):
        return {"count": 1, "median_reward": med, "predicted_reward": pred, "estimate": est}

    snap = {
        1: {PLAIN: arm(100.0, None, 100.0), "ngram/k4": arm(200.0, 150.0, 160.0)},
        64: {PLAIN: arm(100.0, 120.0, 115.0), "ngram/k4": arm(110.0, 90.0, 95.0)},
        128: {PLAIN: arm(None, None, None), "ngram/k4": arm(None, None, None)},
        256: {PLAIN: arm(100.0, None, None), "ngram/k4": arm(120.0, None, None)},  # unvisited
    }
    v = verdicts(snap)
    assert v[1] == {
        "predicted_arm": "ngram/k4",
        "predicted_gain": 2.0,
        "measured_arm": "ngram/k4",
        "measured_gain": None,  # plain never measured there
        "speculates": True,
    }
    assert v[64]["predicted_gain"] == pytest.approx(1.1)
    assert v[64]["measured_arm"] == PLAIN and v[64]["measured_gain"] == pytest.approx(0.75)
    assert not v[64]["speculates"]
    assert v[128]["predicted_arm"] is None and not v[128]["speculates"]
    assert v[256]["speculates"]  # as predicted, until measured
