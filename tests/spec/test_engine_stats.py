"""Tests for the engine statistics arithmetic."""

from __future__ import annotations

import pytest

from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.stats import EngineStats


def _sample() -> EngineStats:
    st = EngineStats()
    st.first_tokens = 5
    st.record_plain_step(batch_size=16, tokens=16, seconds=0.04)
    st.record_plain_step(batch_size=8, tokens=8, seconds=0.02)
    # Rows: a rejection after 3 accepted drafts, a rejection of the first draft, and a row
    # that had no draft (a plain row step inside the verify pass).
    st.record_spec_step(
        3,
        Strategy("ngram", 4),
        drafted=[4, 4, 0],
        accepted=[3, 0, 0],
        emitted=[4, 1, 1],
        draft_seconds=0.001,
        verify_seconds=0.019,
    )
    # Rows: a fully accepted chain + bonus token, and a chain whose last accepted draft was a
    # stop token (no draw of the target's own).
    st.record_spec_step(
        2,
        "eagle/k3",
        drafted=[3, 2],
        accepted=[3, 2],
        emitted=[4, 2],
        draft_seconds=0.005,
        verify_seconds=0.015,
    )
    st.record_phase("prefill", 0.5)
    return st


def test_summary_arithmetic() -> None:
    s = _sample().summary()
    assert s["steps"] == {"plain": 2, "spec": 2, "total": 4}
    assert s["verify_pass_share"] == 0.5
    assert s["row_steps"] == {"draft": 4, "plain": 25, "total": 29}
    assert s["sd_step_share"] == pytest.approx(4 / 29)
    assert s["tokens"] == {
        "first": 5,
        "plain": 25,
        "accepted": 8,
        "residual": 2,
        "bonus": 1,
        "total": 41,
    }
    assert s["drafted_tokens"] == 13
    tps = s["tokens_per_s"]
    assert tps["plain"] == pytest.approx(24 / 0.06)
    assert tps["spec"] == pytest.approx(12 / 0.04)  # every row of the verify passes
    assert tps["decode"] == pytest.approx(36 / 0.10)
    assert s["mean_batch"] == {"plain": 12.0, "spec": 2.5}
    assert s["mean_accepted_length"] == pytest.approx(12 / 4)  # (8 accepted + 4) / 4 steps
    assert s["acceptance_rate"] == pytest.approx(8 / 13)
    assert s["accepted_length_hist"] == {1: 1, 3: 1, 4: 2}  # the no-draft row is not in it
    assert s["seconds"] == pytest.approx(
        {"plain_decode": 0.06, "draft": 0.006, "verify": 0.034, "prefill": 0.5}
    )
    ng = s["per_strategy"]["ngram/k4"]
    assert (ng["steps"], ng["rows"], ng["draft_rows"], ng["emitted"]) == (1, 3, 2, 6)
    assert (ng["drafted"], ng["accepted"], ng["residual"], ng["bonus"]) == (8, 3, 2, 0)
    assert ng["draft_row_share"] == pytest.approx(2 / 3)
    assert ng["mean_accepted_length"] == 2.5 and ng["acceptance_rate"] == 3 / 8
    eg = s["per_strategy"]["eagle/k3"]
    assert (eg["bonus"], eg["residual"], eg["accepted"]) == (1, 0, 5)
    assert eg["tokens_per_s"] == pytest.approx(6 / 0.02)


def test_verify_passes_of_rows_without_drafts_are_plain_row_steps() -> None:
    """The share that read 1.000 while most rows had no draft: every pass is a verify pass,
    but only the rows that verified drafts count as speculative steps."""
    st = EngineStats()
    for _ in range(10):
        st.record_spec_step(8, "ngram/k4", [2, 0, 0, 0, 0, 0, 0, 0], [1] + [0] * 7, [2] + [1] * 7,
                            0.0, 0.01)  # fmt: skip
    s = st.summary()
    assert s["verify_pass_share"] == 1.0
    assert s["sd_step_share"] == pytest.approx(1 / 8)
    assert s["row_steps"] == {"draft": 10, "plain": 70, "total": 80}
    assert s["mean_accepted_length"] == 2.0  # over the rows that drafted, not all 80


def test_empty_summary_has_no_division_by_zero() -> None:
    s = EngineStats().summary()
    assert s["sd_step_share"] is None and s["mean_accepted_length"] is None
    assert s["tokens_per_s"] == {"plain": None, "spec": None, "decode": None}


def test_merge_and_reset() -> None:
    a, b = _sample(), _sample()
    a.merge(b)
    s = a.summary()
    assert s["steps"] == {"plain": 4, "spec": 4, "total": 8}
    assert s["row_steps"] == {"draft": 8, "plain": 50, "total": 58}
    assert s["tokens"]["first"] == 10 and s["tokens"]["bonus"] == 2
    assert s["accepted_length_hist"] == {1: 2, 3: 2, 4: 4}
    assert s["seconds"]["prefill"] == pytest.approx(1.0)
    assert s["mean_accepted_length"] == pytest.approx(3.0)
    assert b.summary()["steps"]["total"] == 4  # merge leaves the source alone
    a.reset()
    assert a.summary() == EngineStats().summary()


def test_per_row_counts_must_match_batch() -> None:
    with pytest.raises(ValueError, match="emitted"):
        EngineStats().record_spec_step(2, "ngram/k2", [2, 2], [1, 0], [2], 0.0, 0.0)
    with pytest.raises(ValueError, match="drafted"):  # totals cannot say which rows drafted
        EngineStats().record_spec_step(2, "ngram/k2", 4, 1, [2, 1], 0.0, 0.0)


def test_the_prefill_fit_is_the_slope_of_seconds_on_positions():
    st = EngineStats()
    for positions in (64, 128, 256, 1024):
        st.record_prefill(positions, 0.010 + 0.0002 * positions)  # 10 ms fixed, 0.2 ms a token
    summary = st.summary()
    assert summary["prefill_seconds_per_token"] == pytest.approx(0.0002)
    assert summary["seconds"]["prefill"] == pytest.approx(0.04 + 0.0002 * 1472)
    one_size = EngineStats()
    for _ in range(5):
        one_size.record_prefill(128, 0.03)
    assert one_size.summary()["prefill_seconds_per_token"] is None  # no spread: no slope
    one_size.merge(st)
    assert one_size.prefill_fit.n == 9 and one_size.summary()["prefill_seconds_per_token"] > 0
