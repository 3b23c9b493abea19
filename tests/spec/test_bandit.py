"""Tests for the bucketed epsilon-greedy strategy chooser (BEG) and the fixed ablation."""

from __future__ import annotations

import math

import pytest

from workers.engine.bandit import (
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
