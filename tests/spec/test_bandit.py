"""Tests for the bucketed epsilon-greedy strategy chooser (BEG) and the fixed ablation."""

from __future__ import annotations

import math

import pytest

from tltd_workers.engine.bandit import (
    PLAIN,
    BucketedEpsilonGreedy,
    FixedStrategy,
    NoStrategyAvailable,
    Strategy,
)

NG2, NG4, EA4 = Strategy("ngram", 2), Strategy("ngram", 4), Strategy("eagle", 4)


def _tried(beg: BucketedEpsilonGreedy, batch: int, rewards: dict[Strategy, float]) -> None:
    for s, r in rewards.items():
        beg.record(batch, s, accepted_tokens=r, step_seconds=float(batch))  # reward == r


def test_bucket_mapping() -> None:
    beg = BucketedEpsilonGreedy([NG2])
    sizes = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 500)
    expected = (1, 2, 4, 4, 8, 8, 16, 16, 32, 32, 32, 32)
    assert tuple(beg.bucket(b) for b in sizes) == expected
    with pytest.raises(ValueError):
        beg.bucket(0)


def test_reward_is_throughput() -> None:
    beg = BucketedEpsilonGreedy([NG2])
    beg.record(4, NG2, accepted_tokens=3.0, step_seconds=0.5)
    assert beg.snapshot()[4]["ngram/k2"] == {"count": 1, "median_reward": 24.0}
    assert beg.snapshot()[1]["ngram/k2"] == {"count": 0, "median_reward": None}


def test_untried_strategies_go_first_per_bucket() -> None:
    beg = BucketedEpsilonGreedy([NG2, NG4, EA4], epsilon=0.0)
    seen = []
    for _ in range(3):
        s = beg.choose(1)
        seen.append(s)
        beg.record(1, s, 1.0, 1.0)
    assert seen == [NG2, NG4, EA4]
    assert beg.choose(8) == NG2  # another bucket starts untried


def test_greedy_picks_the_best_median_not_the_best_mean() -> None:
    beg = BucketedEpsilonGreedy([NG2, NG4], epsilon=0.0)
    for r in (10.0, 10.0, 10.0, 1000.0):  # NG2: median 10, mean 257
        beg.record(1, NG2, r, 1.0)
    for r in (20.0, 20.0, 20.0, 20.0):  # NG4: median 20, mean 20
        beg.record(1, NG4, r, 1.0)
    assert beg.choose(1) == NG4


def test_window_forgets_old_rewards() -> None:
    beg = BucketedEpsilonGreedy([NG2, NG4], epsilon=0.0, window=5)
    _tried(beg, 2, {NG2: 50.0, NG4: 30.0})
    for _ in range(4):
        beg.record(2, NG2, 50.0, 2.0)
    assert beg.choose(2) == NG2
    for _ in range(5):  # the drafter got worse: 5 fresh rewards fill NG2's window
        beg.record(2, NG2, 10.0, 2.0)
    assert beg.choose(2) == NG4
    assert beg.snapshot()[2]["ngram/k2"]["count"] == 10


def test_exploration_rate_is_epsilon() -> None:
    eps, n = 0.1, 20_000
    beg = BucketedEpsilonGreedy([NG2, NG4, EA4], epsilon=eps, seed=123)
    _tried(beg, 1, {NG2: 1.0, NG4: 5.0, EA4: 2.0})
    off_best = sum(beg.choose(1) != NG4 for _ in range(n))
    # Exploring draws uniformly from all 3, so it leaves the best with prob eps * 2/3.
    p = eps * 2 / 3
    sd = math.sqrt(n * p * (1 - p))
    assert abs(off_best - n * p) < 4 * sd


def test_exploration_is_deterministic_for_a_seed() -> None:
    def draws(seed: int) -> list[Strategy]:
        beg = BucketedEpsilonGreedy([NG2, NG4], epsilon=0.5, seed=seed)
        _tried(beg, 1, {NG2: 1.0, NG4: 2.0})
        return [beg.choose(1) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_availability_filter() -> None:
    beg = BucketedEpsilonGreedy([EA4, NG2], epsilon=0.0)
    _tried(beg, 1, {EA4: 100.0, NG2: 1.0})
    assert beg.choose(1) == EA4
    assert beg.choose(1, available={"ngram"}) == NG2
    assert beg.drafters == {"ngram", "eagle"}
    with pytest.raises(NoStrategyAvailable):
        beg.choose(1, available=set())


def test_epsilon_exploration_respects_availability() -> None:
    beg = BucketedEpsilonGreedy([EA4, NG2, NG4], epsilon=1.0, seed=0)
    _tried(beg, 1, {EA4: 1.0, NG2: 1.0, NG4: 1.0})
    assert {beg.choose(1, available=("ngram",)) for _ in range(200)} == {NG2, NG4}


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        BucketedEpsilonGreedy([])
    with pytest.raises(ValueError):
        BucketedEpsilonGreedy([NG2], buckets=(4, 2))
    with pytest.raises(ValueError):
        BucketedEpsilonGreedy([NG2], epsilon=1.5)
    with pytest.raises(ValueError):
        Strategy("ngram", 0)
    with pytest.raises(ValueError):
        BucketedEpsilonGreedy([NG2]).record(1, NG4, 1.0, 1.0)


def test_fixed_strategy() -> None:
    fixed = FixedStrategy(EA4)
    assert fixed.choose(1) == EA4 and fixed.choose(32, available={"eagle"}) == EA4
    with pytest.raises(NoStrategyAvailable):
        fixed.choose(1, available={"ngram"})
    fixed.record(3, EA4, 2.0, 0.1)
    assert fixed.snapshot() == {3: {"eagle/k4": {"count": 1, "median_reward": None}}}


# -- priors from a cost model, and plain decoding as an arm --------------------------------


def _with_priors(**kw) -> BucketedEpsilonGreedy:
    return BucketedEpsilonGreedy([NG2, NG4, EA4], plain_arm=True, **kw)


PRIORS = {PLAIN: 100.0, "ngram/k2": 150.0, "ngram/k4": 130.0, "eagle/k4": 50.0}


def test_without_priors_plain_decoding_is_measured_first() -> None:
    beg = _with_priors(epsilon=0.0)
    assert beg.choose(1) is None
    beg.record_plain(1, 0.01)
    assert beg.choose(1) == NG2  # then the untried strategies, in order
    assert beg.snapshot()[1][PLAIN] == {"count": 1, "median_reward": 100.0}


def _measure_plain(beg: BucketedEpsilonGreedy, batch: int, reward: float = 100.0) -> None:
    """The first step of a bucket with priors: the plain baseline."""
    assert beg.choose(batch, priors=PRIORS) is None
    beg.record_plain(batch, batch / reward)


def test_priors_start_from_the_predicted_best_without_trying_every_arm() -> None:
    beg = _with_priors(epsilon=0.0)
    _measure_plain(beg, 4)
    picks = []
    for _ in range(20):
        s = beg.choose(4, priors=PRIORS)
        picks.append(s)
        beg.record(4, s, accepted_tokens=150.0 / 4, step_seconds=1.0)  # as predicted
    assert set(picks) == {NG2}
    assert beg.choose(8, priors=PRIORS) is None  # another bucket: its baseline first


def test_measured_rewards_override_the_prior() -> None:
    beg = _with_priors(epsilon=0.0)
    _measure_plain(beg, 1)
    picks = []
    for _ in range(8):
        s = beg.choose(1, priors=PRIORS)
        picks.append(s)
        if s is None:
            beg.record_plain(1, 1 / 100.0)  # plain as predicted: 100 tokens/s
        else:
            beg.record(1, s, accepted_tokens=60.0, step_seconds=1.0)  # SD far worse than hoped
    # One ngram/k2 step measures the n-gram efficiency 60 / 150 = 0.4, blended with the
    # prediction's 1 (worth 2 steps): (0.4 + 2) / 3 = 0.8. ngram/k2's estimate
    # (60 + 2 x 0.8 x 150) / 3 = 100 ties plain's; ngram/k4's 0.8 x 130 = 104 is tried. It
    # measures 60 / 130: the efficiency is (2 x median(0.4, 0.46) + 2) / 4 = 0.72, and both
    # n-gram arms fall below plain's 100; eagle/k4, predicted below plain, never runs.
    assert picks == [NG2, NG4] + [None] * 6
    assert beg.efficiency(1, "ngram") == pytest.approx((0.4 + 60 / 130 + 2) / 4)
    assert beg.efficiency(1, "eagle") == 1
    assert beg.efficiency(2, "ngram") == 1.0  # another bucket: its own


def test_one_unlucky_step_does_not_condemn_a_drafter_in_its_bucket() -> None:
    """An EAGLE step that keeps none of its drafts measures a fraction of its prediction;
    the next steps, as predicted, make it the bucket's pick again."""
    beg = _with_priors(epsilon=0.0)
    priors = {PLAIN: 100.0, "ngram/k2": 90.0, "ngram/k4": 80.0, "eagle/k4": 250.0}
    _measure_plain(beg, 1)
    assert beg.choose(1, priors=priors) == EA4
    beg.record(1, EA4, accepted_tokens=75.0, step_seconds=1.0)  # 0.3 of the predicted 250
    # Alone, 0.3 would price eagle/k4 at (75 + 2 x 75) / 3 = 75, below plain, for good.
    assert beg.efficiency(1, "eagle") == pytest.approx((0.3 + 2) / 3)
    assert beg.choose(1, priors=priors) == EA4
    beg.record(1, EA4, accepted_tokens=250.0, step_seconds=1.0)  # as predicted
    assert [beg.choose(1, priors=priors) for _ in range(5)] == [EA4] * 5


def test_predictions_are_gains_over_measured_plain_decoding() -> None:
    beg = _with_priors(epsilon=0.0)
    priors = {PLAIN: 100.0, "ngram/k2": 150.0, "ngram/k4": 130.0, "eagle/k4": 140.0}
    _measure_plain(beg, 1, reward=50.0)  # the device is half as fast as when it was timed
    assert beg.estimates(1, priors) == {
        PLAIN: 50.0,
        "ngram/k2": 75.0,  # predicted gain 1.5 x plain's measured 50
        "ngram/k4": 65.0,
        "eagle/k4": 70.0,
    }
    assert beg.choose(1, priors=priors) == NG2
    beg.record(1, NG2, accepted_tokens=25.0, step_seconds=1.0)  # 1/3 of the predicted 75
    assert beg.efficiency(1, "ngram") == pytest.approx((1 / 3 + 2) / 3)  # blended with 1
    assert beg.choose(1, priors=priors) == EA4  # 70 > the n-grams' 47 and 51 > plain's 50
    beg.record(1, EA4, accepted_tokens=17.5, step_seconds=1.0)  # 1/4 of the predicted 70
    assert beg.choose(1, priors=priors) == NG4  # 0.78 x 65 = 51, just above plain's 50
    beg.record(1, NG4, accepted_tokens=65.0 / 3, step_seconds=1.0)  # 1/3 again
    assert beg.choose(1, priors=priors) is None  # every SD arm now below plain's 50
    beg.forget("eagle")
    assert beg.efficiency(1, "eagle") == 1.0
    assert beg.choose(1, priors=priors) == EA4  # forgotten: the predicted gain again
    assert beg.estimates(2, priors)["ngram/k2"] == float("-inf")  # no plain baseline there


def test_exploration_only_tries_contenders() -> None:
    beg = _with_priors(epsilon=1.0, explore_margin=0.2, seed=3)  # explore at every step
    _measure_plain(beg, 2)
    picks = {beg.choose(2, priors=PRIORS) for _ in range(300)}
    assert picks == {NG2, NG4}  # within 20% of the best (>= 120); plain and eagle are not


def test_exploration_rate_with_priors_is_epsilon() -> None:
    eps, n = 0.1, 20_000
    beg = _with_priors(epsilon=eps, explore_margin=0.2, seed=5)
    _measure_plain(beg, 1)
    off_best = sum(beg.choose(1, priors=PRIORS) != NG2 for _ in range(n))
    p = eps / 2  # exploring picks among the two contenders
    sd = math.sqrt(n * p * (1 - p))
    assert abs(off_best - n * p) < 4 * sd


def test_a_missing_prior_falls_back_to_trying_untried_arms() -> None:
    beg = _with_priors(epsilon=0.0)
    assert beg.choose(1, priors={PLAIN: 100.0, "ngram/k2": 150.0}) is None  # eagle/k4 unknown


def test_unavailable_drafters_need_no_prior() -> None:
    beg = _with_priors(epsilon=0.0)
    priors = {PLAIN: 100.0, "ngram/k2": 90.0, "ngram/k4": 80.0}
    assert beg.choose(1, available={"ngram"}, priors=priors) is None


def test_forget_drops_one_drafters_rewards() -> None:
    beg = _with_priors(epsilon=0.0)
    _measure_plain(beg, 1)
    _tried(beg, 1, {NG2: 10.0, EA4: 30.0})
    beg.forget("eagle")
    snap = beg.snapshot()[1]
    assert snap["eagle/k4"] == {"count": 1, "median_reward": None}
    assert snap["ngram/k2"] == {"count": 1, "median_reward": 10.0}
    est = beg.estimates(1, PRIORS)
    assert est["eagle/k4"] == 50.0 and est["ngram/k2"] == pytest.approx((10 + 2 * 150) / 3)


def test_plain_rewards_need_the_plain_arm() -> None:
    with pytest.raises(ValueError, match="plain arm"):
        BucketedEpsilonGreedy([NG2]).record_plain(1, 0.1)


def test_explore_runs_a_drafters_best_strategy_after_the_baseline() -> None:
    beg = _with_priors(epsilon=0.0)
    assert beg.choose(1, priors=PRIORS, explore="eagle") is None  # the baseline comes first
    beg.record_plain(1, 0.01)
    assert beg.choose(1, priors=PRIORS) == NG2
    assert beg.choose(1, priors=PRIORS, explore="eagle") == EA4  # predicted below plain
    assert beg.choose(1, available={"ngram"}, priors=PRIORS, explore="eagle") == NG2
