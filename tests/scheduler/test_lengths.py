"""The length rules the daemon and the engines share (tltd/contract/lengths.py)."""

from __future__ import annotations

from tltd.contract.lengths import new_token_cap, predicted_left


def test_the_cap_is_max_new_tokens_within_the_sequence():
    assert new_token_cap(100, prompt_len=10, max_seq_len=2048) == 100
    assert new_token_cap(100, prompt_len=2000, max_seq_len=2048) == 48
    assert new_token_cap(100, prompt_len=2048, max_seq_len=2048) <= 0  # no room: refused


def test_the_prediction_is_the_mean_less_what_was_emitted_within_one_and_the_cap():
    assert predicted_left(None, 100) is None  # no answers yet: the caller's fallback
    assert predicted_left(30.4, 100) == 30
    assert predicted_left(30.6, 100, emitted=10) == 21
    assert predicted_left(500.0, 100, emitted=10) == 90  # at most the cap left
    assert predicted_left(30.0, 100, emitted=40) == 1  # past the mean: at least one more
