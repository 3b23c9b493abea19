"""The cost model: interpolation, accepted-length formula, per-bucket prediction, measurement."""

from __future__ import annotations

import math

import pytest

from tests.engine.helpers import make_checkpoint
from tltd_workers.engine.bandit import PLAIN, Strategy
from tltd_workers.engine.costs import (
    BucketCost,
    CostModel,
    arm_rewards,
    expected_tokens,
    fallback_pays,
    measure_costs,
    predict,
    smoothed,
)
from tltd_workers.engine.datatypes import EngineConfig
from tltd_workers.engine.transformer import load_model

NG2, NG4, EA2, EA4 = (Strategy(d, k) for d in ("ngram", "eagle") for k in (2, 4))


def _model(plain: dict[int, float], verify: dict[int, float], draft: dict[int, float]):
    """A cost model from per-batch plain ms, verify/plain ratio at width 5 (k=4), plain/draft."""
    return CostModel(
        {b: BucketCost(ms, {5: ms * verify[b]}, ms / draft[b]) for b, ms in plain.items()},
        context=500,
    )


def test_verify_is_piecewise_linear_in_width():
    c = BucketCost(10.0, {3: 12.0, 7: 20.0}, 1.0)
    assert c.verify(2) == 12.0 and c.verify(6) == 20.0
    assert c.verify(4) == pytest.approx(16.0)  # width 5: between 3 and 7
    assert c.verify(1) == pytest.approx(11.0)  # width 2: between the plain step and 3
    assert c.verify(8) == pytest.approx(24.0)  # width 9: extrapolated from 3 and 7
    assert BucketCost(10.0, {}, 1.0).verify(3) == 40.0  # no verify measured: k + 1 steps
    assert c.step_ms(Strategy("eagle", 4)) == pytest.approx(16.0 + 4 * 1.0)
    assert c.step_ms(Strategy("ngram", 4)) == pytest.approx(16.0)  # n-gram drafts are free


def test_eagle_for_a_history_step_s_other_rows_pays_at_small_batch_only():
    # CPU-like costs: a verified position costs 0.138 ms at batch 128 and 0.18 ms at 8.
    big = BucketCost(163.0, {7: 163.0 + 6 * 128 * 0.138}, 3.0)
    small = BucketCost(14.4, {7: 14.4 + 6 * 8 * 0.18}, 0.8)
    # 128 rows, 100 of them with 14-token history drafts gaining 14 tokens each: the step
    # makes (1400 + 28) tokens in 163 + 1400 x 0.138 = 356 ms, 4.0 per ms. EAGLE on the 28
    # others: 28 x 6 x 0.138 + 6 x 3.0 = 41.2 ms for 28 x 1.6 = 44.8 tokens, 1.1 per ms.
    assert not fallback_pays(big, 128, 128, 100, 1400.0, 1400, 28, 2.6, 6)
    # 6 rows, one with a 12-token history draft gaining 11: (11 + 5) tokens in
    # 14.4 x 6/8 + 12 x 0.18 = 12.96 ms, 1.23 per ms. EAGLE on the 5 others: 5 x 6 x 0.18 +
    # 6 x 0.8 x 6/8 = 9.0 ms for 5 x 2.8 = 14 tokens, 1.56 per ms.
    assert fallback_pays(small, 8, 6, 1, 11.0, 12, 5, 3.8, 6)
    # The same rows when EAGLE is expected to keep little: 5 x 0.6 = 3 tokens for 9.0 ms.
    assert not fallback_pays(small, 8, 6, 1, 11.0, 12, 5, 1.6, 6)
    assert not fallback_pays(small, 8, 6, 1, 11.0, 12, 0, 3.8, 6)  # no row to draft for
    # ... nor when the drafter must first take in 60 unseen positions (6 x 0.8 / 8 ms each).
    assert not fallback_pays(small, 8, 6, 1, 11.0, 12, 5, 3.8, 6, backlog_positions=60)


def test_expected_tokens_per_step():
    assert expected_tokens(0.0, 1.0, 4) == 1.0
    assert expected_tokens(1.0, 1.0, 4) == 5.0
    assert expected_tokens(0.5, 1.0, 2) == pytest.approx(1.75)
    assert expected_tokens(0.5, 0.5, 2) == pytest.approx(0.5 * 1.75 + 0.5)  # half never draft


def test_deep_narrow_policy_speculates_at_every_batch_size():
    """The CPU analog (16 layers x hidden 128, 1 thread): plain steps of 10..142 ms from batch
    1 to 64, verify ~1.2x a plain step, a drafter step 1/15: SD pays in every bucket."""
    costs = _model(
        {1: 10.0, 4: 17.0, 16: 39.0, 32: 70.0, 64: 142.0},
        dict.fromkeys((1, 4, 16, 32, 64), 1.2),
        dict.fromkeys((1, 4, 16, 32, 64), 15.0),
    )
    a = expected_tokens(0.7, 1.0, 4)
    pred = predict(costs, {EA4: a})
    assert set(pred) == {1, 4, 16, 32, 64}
    for b, p in pred.items():
        assert p.best == "eagle/k4", b
        assert p.gain == pytest.approx(a / (1.2 + 4 / 15))
        assert p.rewards[PLAIN] == pytest.approx(1000 * b / costs.buckets[b].plain_ms)


def test_compute_bound_policy_speculates_only_at_small_batch():
    """The first policy (6 x 256): verify 1.05x at batch 1 but 2.2x at 32, drafter 1/6..1/4."""
    costs = _model({1: 3.0, 32: 16.0}, {1: 1.05, 32: 2.2}, {1: 6.0, 32: 4.0})
    tokens = {s: expected_tokens(0.5, 1.0, s.k) for s in (EA2, EA4)}
    pred = predict(costs, tokens)
    assert pred[1].best in ("eagle/k2", "eagle/k4") and pred[1].gain > 1
    assert pred[32].best == PLAIN and pred[32].gain < 1


def test_smoothing_drops_a_disturbed_timing():
    costs = {
        1: BucketCost(10.0, {3: 11.0}, 1.0),
        2: BucketCost(12.0, {3: 30.0}, 1.2),  # verify disturbed by another process
        4: BucketCost(16.0, {3: 17.6}, 1.6),
    }
    out = smoothed(costs)
    assert out[2].verify_ms[3] == pytest.approx(12.0 * 1.1)  # median of 1.1, 2.5, 1.1
    assert out[1].verify_ms[3] == pytest.approx(10.0 * 1.1)  # at an end: the 3 nearest too
    assert smoothed({1: costs[1], 2: costs[2]})[1].verify_ms[3] == pytest.approx(18.0)  # 2 only
    assert out[4].draft_ms == pytest.approx(1.6) and out[2].plain_ms == 12.0


def test_arm_rewards_are_tokens_per_second():
    c = BucketCost(10.0, {3: 10.0}, 1.0)
    r = arm_rewards(c, 8, {NG2: 2.0, EA2: 2.0})
    assert r == {PLAIN: 800.0, "ngram/k2": 1600.0, "eagle/k2": pytest.approx(1600 * 10 / 12)}


def test_measure_costs_times_every_bucket_and_restores_the_cache(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "m", vocab=32))
    cache = model.new_cache(8, 128)
    cache.lens[:3] = [5, 6, 7]
    costs = measure_costs(model, cache, (1, 2, 4, 8, 16), (2, 4, 6), 64, budget_s=30, rounds=1)
    assert cache.lens[:4] == [5, 6, 7, 0]
    assert set(costs.buckets) == {1, 2, 4, 8}  # 16 > the cache's slots
    for c in costs.buckets.values():
        assert set(c.verify_ms) == {3, 7} and c.plain_ms > 0 and c.draft_ms > 0
    assert costs.context == 64 and costs.seconds > 0
    assert measure_costs(model, cache, (1, 2), (2,), 64, budget_s=0).buckets == {}


def test_a_draft_wider_than_a_short_cache_is_extrapolated_not_timed(tmp_path):
    """A 16-position cache cannot hold the history arms' 17-token verify beside any context:
    the widths that fit are timed, the wider one priced by extrapolation."""
    model = load_model(make_checkpoint(tmp_path / "m", vocab=32))
    cache = model.new_cache(4, 16)
    costs = measure_costs(model, cache, (1, 2), (2, 4, 16), 512, budget_s=30, rounds=1)
    for c in costs.buckets.values():
        assert set(c.verify_ms) == {3} and math.isfinite(c.verify(16))
    assert costs.context + 3 <= cache.max_len


def test_default_buckets_reach_the_gates_top():
    assert EngineConfig(max_batch=64).bucket_sizes() == (1, 2, 4, 8, 16, 32, 64)
    assert EngineConfig(max_batch=48).bucket_sizes() == (1, 2, 4, 8, 16, 32, 48)
    assert EngineConfig(gate="threshold").bucket_sizes() == (1, 2, 4, 8, 16, 32)
    assert EngineConfig(gate="threshold", batch_threshold=4, max_batch=3).bucket_sizes() == (
        1,
        2,
        3,
    )
    assert EngineConfig(buckets=(1, 8)).bucket_sizes() == (1, 8)
