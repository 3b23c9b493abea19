"""How many tokens a sample may generate, and how many it is predicted to: the rules the
daemon's scheduler and the workers' engines both apply."""

from __future__ import annotations


def new_token_cap(max_new_tokens: int, prompt_len: int, max_seq_len: int) -> int:
    """The tokens a sample may generate: its `max_new_tokens`, at most what a sequence of
    `max_seq_len` leaves after its prompt (<= 0 when the prompt alone fills it)."""
    return min(max_new_tokens, max_seq_len - prompt_len)


def predicted_left(mean_length: float | None, cap: int, emitted: int = 0) -> int | None:
    """The tokens a sample is predicted to still generate: the mean length of its prompt's
    earlier answers less the `emitted` tokens, at least 1 and at most `cap - emitted`; None
    without a mean (the caller's fallback)."""
    if mean_length is None:
        return None
    return max(1, min(cap - emitted, round(mean_length) - emitted))
