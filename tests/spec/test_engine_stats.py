"""Tests for the engine statistics arithmetic."""

from __future__ import annotations

import pytest

from workers.engine.bandit import Strategy
from workers.engine.stats import EngineStats


def _sample() -> EngineStats:
    st = EngineStats()
    st.record_plain_step(batch_size=16, tokens=16, seconds=0.04)
    st.record_plain_step(batch_size=8, tokens=8, seconds=0.02)
    st.record_spec_step(
        2,
        Strategy("ngram", 4),
        drafted=[4, 4],
        accepted=[3, 0],
        emitted=[4, 1],
        draft_seconds=0.001,
        verify_seconds=0.019,
    )
    st.record_spec_step(
        1, "eagle/k3", drafted=3, accepted=2, emitted=[3], draft_seconds=0.005, verify_seconds=0.015
    )
    st.record_phase("prefill", 0.5)
    return st


def test_summary_arithmetic() -> None:
    s = _sample().summary()
    assert s["steps"] == {"plain": 2, "spec": 2, "total": 4}
    assert s["sd_step_share"] == 0.5
    assert s["tokens"] == {"plain": 24, "spec": 8, "total": 32}
    tps = s["tokens_per_s"]
    assert tps["plain"] == pytest.approx(24 / 0.06)
    assert tps["spec"] == pytest.approx(8 / 0.04)
    assert tps["decode"] == pytest.approx(32 / 0.10)
    assert s["mean_batch"] == {"plain": 12.0, "spec": 1.5}
    assert s["mean_accepted_length"] == pytest.approx(8 / 3)  # 8 tokens over 3 row-steps
    assert s["acceptance_rate"] == pytest.approx(5 / 11)
    assert s["accepted_length_hist"] == {1: 1, 3: 1, 4: 1}
    assert s["seconds"] == pytest.approx(
        {"plain_decode": 0.06, "draft": 0.006, "verify": 0.034, "prefill": 0.5}
    )
    ng = s["per_strategy"]["ngram/k4"]
    assert ng["steps"] == 1 and ng["emitted"] == 5
    assert ng["mean_accepted_length"] == 2.5 and ng["acceptance_rate"] == 3 / 8
    assert s["per_strategy"]["eagle/k3"]["tokens_per_s"] == pytest.approx(3 / 0.02)


def test_empty_summary_has_no_division_by_zero() -> None:
    s = EngineStats().summary()
    assert s["sd_step_share"] is None and s["mean_accepted_length"] is None
    assert s["tokens_per_s"] == {"plain": None, "spec": None, "decode": None}


def test_merge_and_reset() -> None:
    a, b = _sample(), _sample()
    a.merge(b)
    s = a.summary()
    assert s["steps"] == {"plain": 4, "spec": 4, "total": 8}
    assert s["accepted_length_hist"] == {1: 2, 3: 2, 4: 2}
    assert s["seconds"]["prefill"] == pytest.approx(1.0)
    assert s["mean_accepted_length"] == pytest.approx(8 / 3)
    assert b.summary()["steps"]["total"] == 4  # merge leaves the source alone
    a.reset()
    assert a.summary() == EngineStats().summary()


def test_per_row_emitted_must_match_batch() -> None:
    with pytest.raises(ValueError):
        EngineStats().record_spec_step(2, "ngram/k2", 4, 1, [2], 0.0, 0.0)
