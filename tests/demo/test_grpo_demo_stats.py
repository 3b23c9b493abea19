"""The demo's SD share column on real engine rollouts: it counts the samples' own steps with a
draft, not every sample of a verify pass."""

from __future__ import annotations

import math

import pytest
import torch

from examples.demo_report import StepRow, Window, projected_speedup, reward_trend
from examples.grpo_demo import sd_share, summarize
from tests.engine.helpers import make_checkpoint
from tltd.api.convert import sample_to_pb
from tltd.domain import SamplingParams
from tltd_clients.rollout import _sample_from_pb
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.engine import Engine, EngineConfig, Request


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_sd_share_column_is_the_per_sample_share(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m", vocab=32, seed=2, logit_scale=2.0)
    # n-gram speculation on every decode pass: rows with no match decode plainly inside them.
    engine = Engine(
        str(ckpt),
        EngineConfig(max_batch=16, spec_mode="fixed", strategies=(Strategy("ngram", 3),)),
    )
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=1)
    prompts = [[1, 2, 3, 1, 2, 3], [7, 8, 9], [4, 4, 5, 4, 4]]
    outs = engine.generate(Request(f"r{i}", p, sp, prompt_index=i) for i, p in enumerate(prompts))
    # The client's view of them, as the demo gets them through the daemon.
    samples = [_sample_from_pb(sample_to_pb(o.to_domain())) for o in outs]
    summary = engine.stats.summary()
    assert summary["verify_pass_share"] == 1.0  # every pass verified: the per-row count differs
    share = sd_share(samples)
    assert 0 < share < 1
    assert share == pytest.approx(summary["sd_step_share"])
    row = summarize(0, samples, [1.0] * len(samples), 1.0, [], 0.0, 0.0, Window())
    assert row.sd_share == share
    assert row.accepted_length == pytest.approx(summary["mean_accepted_length"])


def test_reward_trend_is_the_per_sample_regression():
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = ((0.1, 40), (0.2, 32), (0.35, 48))
    per_step = [rng.binomial(1, p, size=n).astype(float) for p, n in sizes]
    rows = [
        StepRow(
            step=i,
            epoch=i / 2,
            rollout_s=1.0,
            tail_s=0.0,
            samples=len(y),
            tokens=0,
            p50=0,
            p99=0,
            max_len=0,
            capped=0.0,
            sd_share=0.0,
            accepted_length=0.0,
            drafter_version=0,
            policy_version=0,
            window=Window(),
            mean_reward=float(y.mean()),
            reward_var=float(y.var()),
            update_s=0.0,
            logprob_gap=0.0,
        )  # fmt: skip
        for i, y in enumerate(per_step)
    ]
    x = np.concatenate([np.full(len(y), i, dtype=float) for i, y in enumerate(per_step)])
    y = np.concatenate(per_step)
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, sse, *_ = np.linalg.lstsq(design, y, rcond=None)
    se = np.sqrt(sse[0] / (len(y) - 2) / ((x - x.mean()) ** 2).sum())
    slope, slope_se = reward_trend(rows)
    assert slope == pytest.approx(coef[1]) and slope > 0
    assert slope_se == pytest.approx(se)
    assert all(math.isnan(v) for v in reward_trend(rows[:1]))  # one step has no trend


def test_harvest_share_and_end_to_end_projection():
    w = Window(rollout_idle=3.0, rollout_training=9.0, update_idle=1.0, update_training=4.0)
    assert w.harvested == pytest.approx(0.75)  # training used 9 of the 12 free device-seconds
    assert Window().harvested == 0.0
    # A trainer's start-up holds the device without training: not counted as used.
    loading = Window(rollout_idle=3.0, rollout_training=9.0, rollout_loading=3.0)
    assert loading.harvested == pytest.approx(0.5)
    # Training after the rollout: in the measurement gap and in the update.
    assert Window(gap_training=1.5, update_training=4.0).outside_training == pytest.approx(5.5)
    # Amdahl: 85% of the step sped up 2x -> 1 / (0.15 + 0.425).
    assert projected_speedup(2.0) == pytest.approx(1 / 0.575)
    assert projected_speedup(2.0, rollout_share=1.0) == pytest.approx(2.0)


def test_held_out_score_splits_guesses_from_worked_answers():
    from examples.heldout import HeldOutScore

    score = HeldOutScore(
        rewards=[1.0, 0.0, 1.0, 0.0, 0.0], lengths=[40, 50, 9, 9, 9],
        guesses=[False, False, True, True, True],
    )  # fmt: skip
    assert score.guess_share == pytest.approx(0.6)
    assert score.worked_mean == pytest.approx(0.5)
    assert score.guess_mean == pytest.approx(1 / 3)
    assert HeldOutScore([], [], []).worked_mean == 0.0
