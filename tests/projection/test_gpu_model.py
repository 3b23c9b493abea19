"""The GPU roofline model (a projection) against EAGLE-3's published H100 anchors, and its form."""

from __future__ import annotations

import pytest

from benchmarks.gpu_model import (
    ANCHOR_PLAIN_MS,
    ANCHORS,
    H100,
    H200,
    LLAMA31_8B,
    QWEN25_7B,
    SHAPES,
    Rollout,
    alpha_for,
    anchor_gain,
    bucket_cost,
    cost_model,
    forward_ms,
    rollout_seconds,
    sd_gain,
    untailed_seconds,
)
from tltd_workers.engine.costs import expected_tokens, predict


def test_batch_1_plain_decode_of_llama_8b_on_h100_is_the_anchor_s_6_3_ms():
    assert forward_ms(H100, LLAMA31_8B, 1, 1, 1024) == pytest.approx(ANCHOR_PLAIN_MS, rel=0.05)


@pytest.mark.parametrize("anchor", ANCHORS, ids=lambda a: f"batch{a.batch}")
def test_sd_gains_land_within_15_percent_of_eagle3_s_h100_figures(anchor):
    assert anchor_gain(anchor) == pytest.approx(anchor.gain, rel=0.15)


def test_the_published_fall_with_batch_is_predicted_not_fitted():
    """Batch 2 and 32 share one accepted length; only batch 2's was fitted."""
    two, thirty_two = (a for a in ANCHORS if a.batch in (2, 32))
    assert two.accepted == thirty_two.accepted and not thirty_two.fitted
    assert anchor_gain(thirty_two) < anchor_gain(two)


def test_the_drafter_s_lm_head_is_counted():
    """TLT's drafter reads the target's whole LM head: most of a Qwen2.5-7B drafter."""
    lm_head = QWEN25_7B.vocab * QWEN25_7B.hidden
    assert lm_head > QWEN25_7B.drafter_params() - lm_head > 0
    assert 0.05 < bucket_cost(H100, QWEN25_7B, 1, 2048, [4]).draft_ms / forward_ms(
        H100, QWEN25_7B, 1, 1, 2048) < 0.2  # fmt: skip


def test_costs_are_in_the_engine_s_form_and_its_predict_decides_from_them():
    costs = cost_model(H200, SHAPES["Qwen2.5-7B"], [1, 32, 128], 2048, [2, 4])
    assert costs.key[0] == "projection" and sorted(costs.buckets) == [1, 32, 128]
    c1, c128 = costs.buckets[1], costs.buckets[128]
    assert c1.verify(4) / c1.plain_ms < 1.2  # memory-bound: verifying 5 costs about a step
    assert c128.verify(4) / c128.plain_ms > c1.verify(4) / c1.plain_ms
    from tltd_workers.engine.bandit import Strategy

    pred = predict(costs, {Strategy("eagle", 4): expected_tokens(0.75, 1.0, 4)})
    assert pred[1].gain > pred[32].gain > pred[128].gain


def test_alpha_for_inverts_expected_tokens():
    assert expected_tokens(alpha_for(3.2, 5), 1.0, 5) == pytest.approx(3.2, rel=1e-6)


def test_sd_pays_less_on_a_small_policy_and_a_faster_memory():
    _, small = sd_gain(H100, SHAPES["Qwen2.5-1.5B"], 32, 2048, 0.75, [2, 4, 6])
    _, big = sd_gain(H100, SHAPES["Qwen2.5-32B"], 32, 2048, 0.75, [2, 4, 6])
    _, h200 = sd_gain(H200, SHAPES["Qwen2.5-32B"], 32, 2048, 0.75, [2, 4, 6])
    assert small < big and h200 < big


def test_a_long_tailed_rollout_gains_from_sd():
    r = Rollout(rows=32, median=400, max_new=4096)
    lengths = r.lengths()
    assert sorted(lengths)[16] == pytest.approx(400, rel=0.1)
    assert 4096 >= max(lengths) > 5 * 400  # the tail
    off = rollout_seconds(H100, QWEN25_7B, r, None, [2, 4])
    on = rollout_seconds(H100, QWEN25_7B, r, 0.75, [2, 4])
    assert 1.2 < off / on < 3.0


def test_without_a_tail_the_untailed_rollout_is_the_synchronous_one():
    """Equal lengths: nothing to wait for, so keeping the batch full changes nothing (the
    mean context stands for the chunks' contexts: within 2%; 768 tokens are whole chunks of
    the synchronous integration's 64)."""
    r = Rollout(rows=32, median=768, tail=1.0, max_new=4096)
    assert set(r.lengths()) == {768}
    for alpha in (None, 0.75):
        sync = rollout_seconds(H100, QWEN25_7B, r, alpha, [2, 4])
        assert untailed_seconds(H100, QWEN25_7B, r, alpha, [2, 4]) == pytest.approx(sync, rel=0.02)


def test_a_long_tail_is_what_the_untailed_rollout_saves():
    r = Rollout(rows=32, median=400, max_new=4096)
    off = rollout_seconds(H100, QWEN25_7B, r, None, [2, 4])
    untailed = untailed_seconds(H100, QWEN25_7B, r, None, [2, 4])
    assert 1.5 < off / untailed < 10  # the tail ran at a small batch; here every step is full
